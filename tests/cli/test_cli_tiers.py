"""``dcp-s3 ls`` of a tiered Checkpointer's local root: ranks, completeness, S3 state, promotion lag.

One process saves to the local tier (step 10 also promoted to S3, step 20 local only); its rank directory
is then copied to a second rank's and both markers rewritten as a 2-rank job would have written them (the
same save), which models a 2-rank local root without starting ranks. Then one rank's copy is wiped, one
marker replaced by garbage and one made hostile: each is reported on its row, never a crash.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from hostile import PeakRss, memory_cap
from torch import nn

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._cli import commands as cli
from dcp_s3._local_server import LocalS3Server


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def row(out: str, step: str) -> list[str]:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(step + " ")]
    return re.split(r"\s{2,}", line.strip())


def as_rank(marker: Path, rank: int, world: int) -> None:
    content = torch.load(marker, weights_only=True)
    content["local_tier"] = {**content["local_tier"], "rank": rank, "world_size": world}
    torch.save(content, marker)


def test_ls_shows_the_tiers_of_a_local_root(
    bucket: str,
    s3_env: LocalS3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in s3_env.env().items():
        monkeypatch.setenv(k, v)
    root, local = f"s3://{bucket}/run", tmp_path / "local"
    model = nn.Linear(8, 4)
    with Checkpointer(root, local_root=local) as ckpt:
        ckpt.save({"m": model}, iteration=10, tier="s3")
        ckpt.wait_promotions()
        ckpt.save({"m": model}, iteration=20, tier="local")
    shutil.copytree(local / "rank00000", local / "rank00001")
    for step in ("0000010", "0000020"):
        as_rank(local / "rank00000" / f"{step}.pth", 0, 2)
        as_rank(local / "rank00001" / f"{step}.pth", 1, 2)

    code, out, _ = run(capsys, "ls", str(local), "--s3", root)
    assert code == 0, out
    ten, twenty = row(out, "0000010"), row(out, "0000020")
    assert ten[:3] == ["0000010", "complete", "0-1 of 2"] and ten[4] == "complete", ten
    lag = float(ten[6].rstrip("s"))  # S3's LastModified has whole seconds: a promotion within one may read < 0
    assert -1.5 < lag < 300, ten
    assert twenty[:3] == ["0000020", "complete", "0-1 of 2"] and twenty[4] == "absent" and twenty[6] == "-", twenty
    assert "2 steps in the local tier" in out and "2 complete on every rank" in out

    # Without --s3: the tier listing too (the rank directories say what the root is), no S3 columns.
    code, out, _ = run(capsys, "ls", str(local))
    assert code == 0 and row(out, "0000010") == ["0000010", "complete", "0-1 of 2", row(out, "0000010")[3]], out

    # Rank 1's copy of step 20 wiped: incomplete, and why.
    for p in (local / "rank00001").glob("0000020*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    # Rank 1's marker of step 10 garbage, rank 0's hostile (a world size that names no rank).
    (local / "rank00001" / "0000010.pth").write_bytes(b"\x80\x02garbage, not a marker")
    marker0 = local / "rank00000" / "0000010.pth"
    content = torch.load(marker0, weights_only=True)
    content["local_tier"]["world_size"] = -3
    torch.save(content, marker0)

    code, out, err = run(capsys, "ls", str(local), "--s3", root)
    assert code == 0 and "Traceback" not in err, (out, err)
    assert row(out, "0000020")[:3] == ["0000020", "INCOMPLETE", "0 of 2"], out
    assert "0000020: saved by 2 ranks, the copies of ranks [1] are not there" in out
    assert row(out, "0000010")[:3] == ["0000010", "UNREADABLE", "-"], out
    (why,) = [ln for ln in out.splitlines() if ln.startswith("0000010: ")]
    assert "rank 0: CheckpointFormatError" in why and "names no rank of a world size" in why, why
    assert "rank 1: CheckpointFormatError" in why, why

    # Not a local tier root: one line, naming it.
    code, _, err = run(capsys, "ls", str(tmp_path), "--s3", root)
    assert code == 1 and "no rank<NNNNN>/ directories" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(120)
def test_ls_reports_crafted_markers_and_lists_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A marker whose iteration is ``[1]`` and one naming a world size of 10**12: each step's row says why it is
    unusable, the other steps are listed, in bounded time and memory (no range of a stored number is built)."""
    local = tmp_path / "local"
    model = nn.Linear(8, 4)
    with Checkpointer(str(tmp_path / "root"), local_root=local, keep_last_local=None) as ckpt:
        for it in (10, 20, 30):
            ckpt.save({"m": model}, iteration=it, tier="local")
    m20, m30 = local / "rank00000" / "0000020.pth", local / "rank00000" / "0000030.pth"
    content = torch.load(m20, weights_only=True)
    content["iteration"] = [1]
    torch.save(content, m20)
    content = torch.load(m30, weights_only=True)
    content["local_tier"]["world_size"] = 10**12
    torch.save(content, m30)

    t0 = time.monotonic()
    with memory_cap(2 << 30), PeakRss().watch() as rss:
        code, out, err = run(capsys, "ls", str(local))
    assert time.monotonic() - t0 < 60 and rss.growth < 512 << 20, rss.growth  # hang and memory guards
    assert code == 0 and "Traceback" not in err, (out, err)
    assert row(out, "0000010")[:3] == ["0000010", "complete", "0 of 1"], out
    assert row(out, "0000020")[:3] == ["0000020", "UNREADABLE", "-"], out
    (why,) = [ln for ln in out.splitlines() if ln.startswith("0000020: ")]
    assert "'iteration' = [1] is not a whole number" in why and "0000020.pth" in why, why
    assert row(out, "0000030")[:3] == ["0000030", "INCOMPLETE", "0 of 1000000000000"], out
    (why,) = [ln for ln in out.splitlines() if ln.startswith("0000030: ")]
    assert "saved by 1000000000000 ranks, the copies of ranks [1, 2" in why and "999999999991 more" in why, why
    assert "3 steps in the local tier" in out and "1 complete on every rank" in out, out
