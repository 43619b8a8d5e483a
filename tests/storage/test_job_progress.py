"""The count of ranks still sending a save's or load's requests (``dcp_s3._dcp.job_progress``), on a real
c10d store; the ranks taking up what finished ranks leave is in ``tests/objstore/test_rate_control.py``."""

from __future__ import annotations

from torch.distributed import HashStore

from dcp_s3._dcp.job_progress import JobCount, StoreProgress, job_counts


def test_ranks_sharing_a_key_prefix_share_a_count() -> None:
    """Rank r writes under p-(r % prefixes): 5 ranks over 2 prefixes count in two groups of 3 and 2; without
    prefixes, one count of all; each save or load its own key."""
    counts = job_counts(5, 2)
    assert [c.ranks for c in counts] == [3, 2, 3, 2, 3]
    assert counts[0].key == counts[2].key == counts[4].key != counts[1].key == counts[3].key
    assert counts[0].key.rpartition("/")[0] == counts[1].key.rpartition("/")[0]
    whole = job_counts(5)
    assert {c for c in whole} == {JobCount(whole[0].key, 5)} and whole[0].key != job_counts(5)[0].key


def test_the_count_falls_as_ranks_finish() -> None:
    store = HashStore()
    count = JobCount("dcp_s3/progress/t", 3)
    ranks = [StoreProgress(store, count) for _ in range(3)]
    assert [r.active() for r in ranks] == [3, 3, 3]
    ranks[0].finished()
    ranks[2].finished()
    assert ranks[1].active() == 1
    ranks[1].finished()
    assert ranks[1].active() == 1  # never 0: the rank asking is still sending


class _BrokenStore:
    def add(self, key: str, value: int) -> int:
        raise RuntimeError("store gone")


def test_a_failing_store_leaves_the_share_unchanged() -> None:
    progress = StoreProgress(_BrokenStore(), JobCount("k", 4))
    assert progress.active() is None and progress.active() is None
    progress.finished()  # not raised: the save goes on
