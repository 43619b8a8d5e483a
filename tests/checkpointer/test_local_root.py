"""The local tier's rank directory names: every rank's name is found again, and no other name is taken for one."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_s3._checkpointer.local_root import RANK_DIR_RE, rank_dir, rank_dirs

RANKS = [0, 7, 99_999, 100_000, 123_456, 1_048_575]


@pytest.mark.parametrize("rank", RANKS)
def test_every_rank_directory_name_is_recognised(rank: int) -> None:
    m = RANK_DIR_RE.fullmatch(rank_dir(rank))
    assert m is not None and int(m.group(1)) == rank


@pytest.mark.parametrize("name", ["rank0100000", "rank000007", "rank7", "rank0007", "rank-1", "rank00007x"])
def test_names_rank_dir_never_produces_are_not_rank_directories(name: str) -> None:
    assert RANK_DIR_RE.fullmatch(name) is None


def test_rank_dirs_lists_ranks_past_99999(tmp_path: Path) -> None:
    for rank in RANKS:
        (tmp_path / rank_dir(rank)).mkdir()
    (tmp_path / "rank0100000").mkdir()  # not a name of this scheme: not ours, not listed
    ours, refused = rank_dirs(str(tmp_path))
    assert sorted(ours) == RANKS and refused == {}
