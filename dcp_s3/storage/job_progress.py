"""How many ranks of a save or load still send requests, counted in the job's c10d store.

The rate controller starts every rank at its share of a prefix's request budget; when ranks finish their
requests, the ranks still sending should take up the capacity they leave, or the save ends with a tail of
ranks paced at their share while the store sits idle. To tell them, the coordinator names each save and
load with a fresh token in the global plan (the plans DCP already scatters: no collective is added); a
rank adds 1 under ``dcp_s3/progress/<token>`` in the default process group's store once it has sent all
its requests, and a rank waiting for tokens reads the count (``add(key, 0)``) at most every
``max(1 s, ranks / 2000 s)`` (:mod:`dcp_s3.objstore.throttle`). Nothing is polled while no rank waits.
A save's coordinator removes the count at ``finish``; a load leaves its one counter in the store (a load
has no step that runs after every rank's reads).

Without a process group or store, or when the store fails, nothing changes: the ranks keep their share.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dcp_s3._torch_compat import default_store
from dcp_s3.objstore.base import ObjectStore

__all__ = ["StoreProgress", "following_job", "forget_job", "progress_key"]

log = logging.getLogger("dcp_s3")


def progress_key(token: str) -> str:
    return f"dcp_s3/progress/{token}"


class StoreProgress:
    """The ranks of ``ranks`` that have not finished the save or load ``token`` names (a ``JobProgress``)."""

    def __init__(self, store: Any, token: str, ranks: int) -> None:
        self._store, self._key, self._ranks = store, progress_key(token), ranks
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
        return max(1, self._ranks - finished)

    def finished(self) -> None:
        try:
            self._store.add(self._key, 1)
        except Exception as exc:  # noqa: BLE001
            log.debug("job progress %s not counted (%s)", self._key, type(exc).__name__)


@contextmanager
def following_job(object_store: ObjectStore, token: str | None, ranks: int) -> Iterator[None]:
    """Send this rank's requests of the save or load ``token`` names (None: not named, e.g. a planner
    that dropped the plan's storage data) counted with the job's other ``ranks``; this rank counts as
    finished when the block ends, however it ends."""
    store = default_store() if token and ranks > 1 else None
    if store is None:
        yield
        return
    progress = StoreProgress(store, token, ranks)  # type: ignore[arg-type]  # token is set
    try:
        with object_store.following(progress):
            yield
    finally:
        progress.finished()


def forget_job(token: str | None) -> None:
    """Remove the count of the save ``token`` names from the store (the coordinator, once every rank has
    finished: at ``finish``)."""
    store = default_store() if token else None
    if store is None:
        return
    try:
        store.delete_key(progress_key(token))  # type: ignore[arg-type]  # token is set
    except Exception as exc:  # noqa: BLE001 - a store without deletes keeps one small counter
        log.debug("job progress of %s not removed (%s)", token, type(exc).__name__)
