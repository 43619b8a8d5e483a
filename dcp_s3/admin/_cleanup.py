"""``gc`` and ``rm``: delete exactly the objects that belong to DCP checkpoints, and say which first.

A checkpoint directory can share its prefix with a user's files (``config.yaml``,
``train.log`` next to the ``.distcp`` objects). Only these are *checkpoint objects*:

- in a checkpoint directory: ``.metadata``, data objects ``*.distcp`` (also in ``p-<hex>/``,
  see ``S3StorageWriter(key_prefixes=)``) and writer probes ``.dcp_s3-probe.<hex>``;
- a step's marker ``<step>.pth`` (see :mod:`dcp_s3._checkpointer.steps`).

``gc`` removes, among objects last written more than ``older_than`` ago: the checkpoint
objects of incomplete steps and checkpoints (never a committed DCP checkpoint: a part directory holding its
``.metadata`` stays even when its step has no marker), of directories of a complete step that its marker
does not name (generations of a killed re-save, see :mod:`dcp_s3._checkpointer.generations`), data objects of
committed checkpoints that their ``.metadata`` does not reference (left by a crashed or replaced
save), probes anywhere, and
multipart uploads of checkpoint objects that have received nothing for that long. A step or
checkpoint with a younger upload in progress is left alone. ``rm`` removes the checkpoint
objects of the steps it names (``recursive`` at a prefix: every object under it). Both
return every name before anything is deleted, so a dry run lists exactly what would go.
Deletion goes through :mod:`dcp_s3._checkpointer.retention` (also the Checkpointer's ``keep_last``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from dcp_s3._checkpointer.generations import settle
from dcp_s3._checkpointer.retention import delete_ordered, deletion_order, split_step
from dcp_s3._checkpointer.steps import PROBE_PATTERN, Part, Step, is_checkpoint_key, is_checkpoint_object, scan
from dcp_s3._dcp import Entry, Store, Upload, open_store
from dcp_s3._layout import DATA_SUFFIX, METADATA_KEY
from dcp_s3.admin._locations import is_root, read_metadata, resolve
from dcp_s3.errors import DcpS3Error

__all__ = ["Garbage", "Removal", "find_garbage", "collect_garbage", "remove_checkpoint"]

log = logging.getLogger(__name__)


def _base(name: str) -> str:
    return name.rpartition("/")[2]


def _is_data_object(part: Part, name: str) -> bool:
    return is_checkpoint_object(part.name, name) and name.endswith(DATA_SUFFIX)


def _under(step: Step, name: str) -> bool:
    """True if ``name`` lies in one of ``step``'s checkpoint directories (for a manager step, also
    in a ``<step>.<part>/`` directory that holds no object yet)."""
    if step.kind == "step" and name.startswith(step.name + "."):
        return True
    return any(not p.name or name.startswith(p.name + "/") for p in step.parts.values())


@dataclass
class Garbage:
    """What ``gc`` would remove, every object and upload named, before anything is removed."""

    store: Store
    #: Incomplete steps/checkpoints whose checkpoint objects are removed.
    steps: list[Step]
    #: Every object to delete (checkpoint objects only).
    objects: list[Entry]
    #: Multipart uploads of checkpoint objects idle for longer than the bound.
    uploads: list[Upload]
    #: Objects in those checkpoints' directories that are not checkpoint objects: left alone.
    kept: list[Entry] = field(default_factory=list)
    #: (location, why) of what was not examined or not touched: unreadable ``.metadata``, saves in progress.
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)


def find_garbage(uri: str, *, older_than: float = 3600.0, now: float | None = None, **storage_options: Any) -> Garbage:
    """Checkpoint objects and uploads under ``uri`` that no checkpoint needs, last written more than
    ``older_than`` seconds ago (the bound protects saves in progress: make it longer than your longest save)."""
    store = open_store(uri, **storage_options)
    cutoff = (time.time() if now is None else now) - older_than
    entries = store.list_objects()
    stale: list[Upload] = []
    busy: list[Upload] = []  # uploads that received a part within the bound: a save in progress
    for upload in store.uploads():
        last = upload.initiated if upload.initiated > cutoff else store.upload_activity(upload)
        if last is not None:
            (stale if last <= cutoff else busy).append(upload)
    garbage = Garbage(store, [], [], [u for u in stale if is_checkpoint_key(u.name)])
    steps = settle(store, scan(entries))
    committed = {p.name for s in steps for p in s.parts.values() if p.committed}
    for step in steps:
        in_progress = [u for u in busy if _under(step, u.name)]
        inside = [c for c in committed if step.kind == "dcp" and step.name.startswith(c + "/" if c else "")]
        if in_progress:
            garbage.skipped.append(
                (store.url(step.name), f"an upload is in progress ({store.url(in_progress[0].name)})")
            )
        elif step.error:  # which directories are the step's is unknown: touch none
            garbage.skipped.append(
                (store.url(step.name), f"its marker cannot be followed, so nothing of it is removed: {step.error}")
            )
        elif inside and not step.complete:  # data a committed checkpoint may reference from a subdirectory
            garbage.skipped.append((store.url(step.name), f"inside the complete checkpoint {store.url(inside[0])}"))
        elif not step.complete:
            if step.mtime <= cutoff:
                step = _without_committed_parts(store, step, garbage)
                mine, other = split_step(step)
                if not mine:
                    continue
                garbage.steps.append(step)
                garbage.objects.extend(mine)
                garbage.kept.extend(other)
        else:
            for part in step.parts.values():
                _unreferenced(store, part, cutoff, garbage)
            for part in step.stale:  # generations its marker does not name (a killed re-save), old parts
                if max((o.mtime for o in part.objects), default=0.0) <= cutoff:
                    garbage.objects.extend(o for o in part.objects if is_checkpoint_object(part.name, o.name))
                    garbage.kept.extend(o for o in part.objects if not is_checkpoint_object(part.name, o.name))
    listed = {o.name for o in garbage.objects}
    garbage.objects.extend(
        e for e in entries if PROBE_PATTERN.fullmatch(_base(e.name)) and e.mtime <= cutoff and e.name not in listed
    )
    return garbage


def _without_committed_parts(store: Store, step: Step, garbage: Garbage) -> Step:
    """``step`` (incomplete) less its parts that are complete DCP checkpoints, when it has no marker: a
    ``<step>.<key>_model`` directory holding its ``.metadata`` may be a plain checkpoint written there (or one
    a crash left with every part committed); nothing proves it garbage, so it stays (listed in ``skipped``).
    Generation directories (``<step>.<part>.<token>``, named only by the Checkpointer's saves) still go."""
    if step.kind != "step" or step.marker is not None:
        return step
    kept = {s: p for s, p in step.parts.items() if p.committed}
    for part in kept.values():
        garbage.skipped.append(
            (store.url(part.name), "a complete DCP checkpoint (its .metadata is there): gc never removes one")
        )
    parts = {s: p for s, p in step.parts.items() if s not in kept}
    return Step(step.name, step.kind, None, parts, list(step.stale), step.error, step.named)


def _unreferenced(store: Store, part: Part, cutoff: float, garbage: Garbage) -> None:
    """Add the data objects of committed checkpoint ``part`` that its ``.metadata`` does not reference."""
    candidates = [o for o in part.objects if _is_data_object(part, o.name) and o.mtime <= cutoff]
    if not candidates:
        return
    try:
        metadata = read_metadata(store, part)
    except (DcpS3Error, OSError) as exc:
        garbage.skipped.append(
            (store.url(part.name), f"cannot read {METADATA_KEY}, so nothing in it is removed: {exc}")
        )
        return
    prefix = part.name + "/" if part.name else ""
    referenced = {prefix + str(info.relative_path) for info in metadata.storage_data.values()}
    garbage.objects.extend(o for o in candidates if o.name not in referenced)


def collect_garbage(garbage: Garbage) -> tuple[int, int]:
    """Remove what :func:`find_garbage` found, and nothing else; returns (objects deleted, uploads aborted)."""
    delete_ordered(garbage.store, [o.name for o in garbage.objects])
    for upload in garbage.uploads:
        garbage.store.abort(upload)
    return len(garbage.objects), len(garbage.uploads)


# -- rm ------------------------------------------------------------------------------------------------
@dataclass
class Removal:
    """What ``rm`` removes (or would, in a dry run): every object and upload, named."""

    store: Store
    objects: list[str]
    uploads: list[Upload]
    #: Objects in the removed checkpoints' directories that are not checkpoint objects: left alone.
    kept: list[str] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [self.store.url(n) for n in self.objects]


def remove_checkpoint(uri: str, *, recursive: bool = False, dry_run: bool = False, **storage_options: Any) -> Removal:
    """Delete the step or checkpoint at ``uri`` (marker and ``.metadata`` first); returns what is removed.

    Only checkpoint objects are removed (a ``notes.md`` in a checkpoint directory stays, listed
    in ``kept``), with the multipart uploads of checkpoint objects into it. A location holding
    several checkpoints is refused unless ``recursive``, which removes every object and upload
    under it. ``dry_run``: find and return, delete nothing.
    """
    store, steps = resolve(uri, **storage_options)
    if len(steps) > 1 and not recursive:
        raise DcpS3Error(f"{uri} holds {len(steps)} checkpoints; pass recursive=True (--recursive) to remove them all")
    if recursive and is_root(store, uri):
        removal = Removal(store, [e.name for e in store.list_objects()], store.uploads())
    else:
        removal = Removal(store, [], [])
        uploads = store.uploads()
        for step in steps:
            mine, other = split_step(step)
            removal.objects.extend(e.name for e in mine)
            removal.kept.extend(e.name for e in other)
            removal.uploads.extend(u for u in uploads if _under(step, u.name) and is_checkpoint_key(u.name))
    removal.objects = deletion_order(removal.objects)
    if not dry_run:
        delete_ordered(store, removal.objects)
        for upload in removal.uploads:
            store.abort(upload)
    return removal
