"""How many ranks of a save or load still send requests, counted in the job's c10d store.

The rate controller starts every rank at its share of a prefix's request budget; when ranks finish their
requests, the ranks still sending should take up the capacity they leave, or the save ends with a tail of
ranks paced at their share while the store sits idle. To tell them, the coordinator gives each rank a
:class:`JobCount` in the global plan (the plans DCP already scatters: no collective is added): a fresh key
``dcp_s3/progress/<token>`` for the save or load (``/<h>`` added for the ranks that write under key prefix
``p-<h>/``) and the number of ranks counted under it. A rank adds 1 under its key in the default process
group's store once it has sent all its requests, and a rank waiting for tokens reads the count
(``add(key, 0)``) at most every ``max(1 s, ranks / 2000 s)`` (:mod:`dcp_s3._objstore.throttle`). Nothing is
polled while no rank waits. A save's coordinator removes its counts at ``finish``; a load leaves its one
counter in the store (a load has no step that runs after every rank's reads).

Without a process group or store, or when the store fails, nothing changes: the ranks keep their share.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dcp_s3._layout import new_token
from dcp_s3._objstore.base import ObjectStore
from dcp_s3._torch_compat import default_store

__all__ = ["JobCount", "StoreProgress", "job_counts", "following_job", "forget_counts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobCount:
    """Where the ranks sharing a rank's key prefix count themselves finished, and how many they are."""

    key: str
    ranks: int


def job_counts(ranks: int, prefixes: int = 1) -> list[JobCount]:
    """Each rank's count for a save or load of ``ranks`` ranks, rank ``r`` writing under prefix
    ``r % prefixes`` (``layout.rank_prefix``)."""
    key = f"dcp_s3/progress/{new_token()}"
    if prefixes <= 1:
        return [JobCount(key, ranks)] * ranks
    return [JobCount(f"{key}/{r % prefixes}", len(range(r % prefixes, ranks, prefixes))) for r in range(ranks)]


class StoreProgress:
    """Of the ranks of ``count``, those that have not finished (a ``JobProgress``), read from ``store``."""

    def __init__(self, store: Any, count: JobCount) -> None:
        self._store, self._key, self.ranks = store, count.key, count.ranks
        self._failed = False

    def active(self) -> int | None:
        if self._failed:
            return None
        try:
            finished = int(self._store.add(self._key, 0))
        except Exception as exc:  # noqa: BLE001 - a store that fails only costs the scaling
            self._failed = True
            log.debug("job progress %s unreadable (%s): the ranks keep their share", self._key, type(exc).__name__)
            return None
        return max(1, self.ranks - finished)

    def finished(self) -> None:
        try:
            self._store.add(self._key, 1)
        except Exception as exc:  # noqa: BLE001
            log.debug("job progress %s not counted (%s)", self._key, type(exc).__name__)


@contextmanager
def following_job(object_store: ObjectStore, count: Any) -> Iterator[None]:
    """Send this rank's requests counted with the other ranks of ``count`` (anything but a
    :class:`JobCount`, e.g. a planner that dropped the plan's storage data: not counted); this rank counts
    as finished when the block ends, however it ends."""
    store = default_store() if isinstance(count, JobCount) and count.ranks > 1 else None
    if store is None:
        yield
        return
    progress = StoreProgress(store, count)
    try:
        with object_store.following(progress):
            yield
    finally:
        progress.finished()


def forget_counts(counts: Sequence[JobCount]) -> None:
    """Remove a save's counts from the store (its coordinator, once every rank has finished: at ``finish``)."""
    store = default_store() if counts else None
    for key in sorted({c.key for c in counts}) if store is not None else ():
        try:
            store.delete_key(key)  # type: ignore[union-attr]  # store is set
        except Exception as exc:  # noqa: BLE001 - a store without deletes keeps one small counter
            log.debug("job progress %s not removed (%s)", key, type(exc).__name__)
