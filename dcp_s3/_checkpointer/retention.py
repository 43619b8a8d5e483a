"""The Checkpointer's ``keep_last``: which complete steps go, and deleting a step in an order that
never makes a half-deleted step look complete (markers, then ``.metadata``, then the rest).

Only checkpoint objects are deleted (:func:`dcp_s3._checkpointer.steps.is_checkpoint_object`):
other files sharing a step's directories stay. Which steps ``keep_last`` may delete at all is
:mod:`dcp_s3._checkpointer.ownership`'s rule: complete steps named ``{iteration:07d}`` under the root. ``dcp-s3 gc``/``rm`` (:mod:`dcp_s3.admin._cleanup`)
delete through the same functions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._checkpointer.ownership import CHECKPOINTER_STEPS, Ownership
from dcp_s3._checkpointer.steps import MARKER_SUFFIX, Step, is_checkpoint_object, scan
from dcp_s3._dcp.store import Entry, Store
from dcp_s3._layout import METADATA_KEY

__all__ = ["split_step", "deletion_order", "delete_ordered", "delete_step", "retain_last"]

log = logging.getLogger(__name__)


def split_step(step: Step) -> tuple[list[Entry], list[Entry]]:
    """(checkpoint objects of ``step``, other objects that share its directories)."""
    mine = [step.marker] if step.marker is not None else []
    other: list[Entry] = []
    for part in [*step.parts.values(), *step.stale]:
        for entry in part.objects:
            (mine if is_checkpoint_object(part.name, entry.name) else other).append(entry)
    return mine, other


def _rank(name: str) -> int:
    base = name.rpartition("/")[2]
    return 0 if base.endswith(MARKER_SUFFIX) else 1 if base == METADATA_KEY else 2


def deletion_order(names: Iterable[str]) -> list[str]:
    """Markers first, then ``.metadata``, then the rest: a half-deleted checkpoint never looks complete."""
    return sorted(dict.fromkeys(names), key=lambda n: (_rank(n), n))


def delete_ordered(store: Store, names: list[str]) -> None:
    for group in (0, 1, 2):  # each group is gone before the next is touched
        batch = [n for n in deletion_order(names) if _rank(n) == group]
        if batch:
            store.delete(batch)


def delete_step(store: Store, step: Step, uploads: bool = True) -> int:
    """Delete one step's checkpoint objects (marker first, so it never looks complete while half
    deleted) and, with ``uploads``, abort its unfinished uploads; other files in its directories
    stay. Returns the number of objects deleted."""
    mine, _ = split_step(step)
    delete_ordered(store, [e.name for e in mine])
    if uploads and step.kind == "step":
        for upload in store.uploads(f"{step.name}."):
            store.abort(upload)
    return len(mine)


def retain_last(store: Store, keep_last: int, keep: str) -> list[str]:
    """Delete complete steps under ``store`` older than the newest ``keep_last``, never the step at
    URL ``keep``; steps without parts (single-file checkpoints, maybe the user's own files), incomplete
    steps and steps of other names (``save(path=...)``, another tool's) are never touched nor counted
    (:mod:`dcp_s3._checkpointer.ownership`). Returns the URLs of the deleted steps."""
    ownership = Ownership(f"Checkpointer(keep_last={keep_last})", "", CHECKPOINTER_STEPS)
    complete = [s for s in find_complete(store, None) if s.parts and ownership.owns(s.name)]
    kept = {s.name for s in complete[-keep_last:]}
    deleted = []
    for old in complete:
        if old.name in kept or store.url(old.name) == keep:
            continue
        # Only now its objects: a listing of this step's prefix, not of the whole root.
        (listed,) = [s for s in scan(store.list_objects(f"{old.name}.")) if s.name == old.name] or [old]
        n = delete_step(store, listed)
        log.info("keep_last=%d: deleted step %s (%d objects)", keep_last, store.url(old.name), n)
        deleted.append(store.url(old.name))
    return deleted
