"""Per-rank request statistics of one save or load: measured, carried to the coordinator, summarised.

Each rank takes a snapshot of its process's request statistics
(:func:`dcp_s3._objstore.rate_hooks.request_stats`) when the save or load starts and reports the
difference when its part ends. A save carries each rank's figures to the coordinator inside the
write results DCP already gathers for ``finish`` (:class:`RankResults`); ``finish`` takes them out
before anything else reads the results, so they never reach ``.metadata``. A load has no step in
which one rank receives the others' data (torch gathers ``None`` from each rank's read), so each
rank keeps its own.

The figures are per process: requests of another save or load running in the same process at the
same time (an async save behind a load) are counted in both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.storage import WriteResult

from dcp_s3._objstore.rate_hooks import request_stats, request_stats_since

__all__ = ["KeyFigures", "RankFigures", "RankResults", "Meter", "own_rank", "split_results", "summary"]

log = logging.getLogger(__name__)

#: One key's figures: ``attempts``, ``refusals``, ``wait_s`` (seconds waited for tokens), ``rate`` and
#: ``peak_rate`` (requests per second).
KeyFigures = dict[str, float]
#: A rank's figures, per paced key (``"s3://bucket/prefix/ (write)"``).
RankFigures = dict[str, KeyFigures]


def own_rank(rank: int | None) -> int:
    """The rank whose figures these are: ``rank`` as DCP gave it, else (torch < 2.9 gives the writer none) the
    process's rank in the default group, else 0."""
    if rank is not None:
        return rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Meter:
    """The request statistics of this process from :meth:`start` on."""

    def __init__(self) -> None:
        self._before: RankFigures = request_stats()

    def start(self) -> None:
        self._before = request_stats()

    def since_start(self) -> RankFigures:
        return request_stats_since(self._before)


class RankResults(Sequence[WriteResult]):
    """One rank's write results (a list or a ``PackedResults``) with its request figures for the save.

    What ``S3StorageWriter.write_data`` returns, so DCP gathers the figures to the coordinator with
    the results; a read-only sequence of the same ``WriteResult`` objects. ``finish`` unwraps it
    (:func:`split_results`) before the results are encoded: the figures are never stored.
    """

    __slots__ = ("results", "rank", "figures")

    def __init__(self, results: Sequence[WriteResult], rank: int | None, figures: RankFigures) -> None:
        self.results = results
        self.rank = rank
        self.figures = figures

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankResults, (self.results, self.rank, self.figures))

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: Any) -> Any:
        return self.results[i]

    def __iter__(self) -> Iterator[WriteResult]:
        return iter(self.results)

    def __repr__(self) -> str:
        return f"RankResults(rank={self.rank}, {self.results!r})"


def split_results(
    results: Sequence[Sequence[WriteResult]],
) -> tuple[list[Sequence[WriteResult]], dict[int, RankFigures]]:
    """The gathered results without their figures, and the figures per rank (by rank, or by
    position where a rank did not say; results from another writer carry none)."""
    plain: list[Sequence[WriteResult]] = []
    figures: dict[int, RankFigures] = {}
    for pos, per_rank in enumerate(results):
        if isinstance(per_rank, RankResults):
            figures[pos if per_rank.rank is None else per_rank.rank] = per_rank.figures
            plain.append(per_rank.results)
        else:
            plain.append(per_rank)
    return plain, figures


def summary(what: str, figures: Mapping[int, RankFigures]) -> str:
    """One line: ranks, attempts, refusals, seconds waited, and the key with the most refusals."""
    attempts = refusals = 0.0
    waited = 0.0
    per_key: dict[str, list[float]] = {}
    for ranks_keys in figures.values():
        for key, f in ranks_keys.items():
            attempts += f["attempts"]
            refusals += f["refusals"]
            waited += f["wait_s"]
            entry = per_key.setdefault(key, [0.0, 0.0])
            entry[0] += f["refusals"]
            entry[1] = max(entry[1], f["peak_rate"])
    line = (
        f"{what}: {len(figures)} rank(s), {attempts:.0f} paced requests, {refusals:.0f} refused, "
        f"{waited:.1f} s waiting for tokens"
    )
    if per_key:
        key, (refused, peak) = max(per_key.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        line += f"; most refused on {key}: {refused:.0f} (peak rate {peak:.1f}/s)"
    return line
