"""``dcp-s3 cp``: copy a step, a checkpoint or a whole run between S3 and local disk.

Data objects go first, then ``.metadata``, then step markers, so a partial copy never looks
complete; every destination name is checked before anything is written.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dcp_s3._checkpointer.steps import MARKER_SUFFIX
from dcp_s3._dcp import Entry, Store, open_object, open_store
from dcp_s3._layout import METADATA_KEY
from dcp_s3._objstore.base import check_relative_name
from dcp_s3.admin._locations import Progress, resolve
from dcp_s3.admin._locations import is_root as _is_root
from dcp_s3.errors import CheckpointExistsError, DcpS3Error

__all__ = ["CopyReport", "copy_checkpoint"]


@dataclass
class CopyReport:
    source: str
    destination: str
    objects: int
    bytes: int
    seconds: float


def _commit_rank(name: str) -> int:
    """Copy order: data first, then ``.metadata``, then step markers, so a partial copy never looks complete."""
    base = name.rpartition("/")[2]
    if base.endswith(MARKER_SUFFIX):
        return 2
    return 1 if base == METADATA_KEY else 0


def copy_checkpoint(
    src: str,
    dst: str,
    *,
    workers: int = 8,
    overwrite: bool = False,
    follow_symlinks: bool = False,
    progress: Progress | None = None,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> CopyReport:
    """Copy a step, a checkpoint or a whole run between S3 and local disk (either way, or S3 to S3).

    Objects are copied concurrently; each copy's size is checked against the source's.
    ``dst`` names the copy: a step ``.../0000100`` copies to ``<dst>.pth``, ``<dst>.<part>/...``.
    Before anything is written, every destination name is checked: a source key that would
    land outside ``dst`` (``..``, ``.`` or empty segments, as in ``ck/../../x``) is refused
    (``CheckpointFormatError`` naming it), and so is a symbolic link that leads out of a local
    source or destination directory unless ``follow_symlinks``.
    """
    t0 = time.perf_counter()
    src_store, steps = resolve(src, follow_symlinks=follow_symlinks, **(src_options or {}))
    whole = _is_root(src_store, src)
    if whole:  # a directory: everything under it
        entries = src_store.list_objects()
        dst_store = open_store(dst, follow_symlinks=follow_symlinks, **(dst_options or {}))
        pairs = [(e, e.name) for e in entries]
        tops = [""]
    else:  # one step, named by its prefix: <name>.pth, <name>.<part>/...
        (step,) = steps
        dst_store, dst_name = open_object(dst, follow_symlinks=follow_symlinks, **(dst_options or {}))
        pairs = [(e, dst_name + e.name[len(step.name) :]) for e in step.objects]
        tops = [p.name for p in [*step.parts.values(), *step.stale]] + ([step.marker.name] if step.marker else [])
    for entry, name in pairs:
        check_relative_name(entry.name, src_store.url())
        check_relative_name(name, src_store.url(entry.name))
    if not follow_symlinks:
        _refuse_links_out(src_store, tops, "source")
        _refuse_links_out(dst_store, [n for _, n in pairs], "destination")
    # Only the names a step's copy writes (<dst_name>...), not the whole destination directory.
    existing = {e.name for e in dst_store.list_objects("" if whole else dst_name)} & {d for _, d in pairs}
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{dst_store.url(min(existing))} already exists ({len(existing)} objects would be replaced); "
            "pass --overwrite"
        )
    total = sum(e.size for e, _ in pairs)
    done = [0]
    lock = threading.Lock()

    def copy_one(entry: Entry, name: str) -> None:
        _copy_object(src_store, entry.name, dst_store, name)
        size = dst_store.size(name)
        if size != entry.size:
            raise DcpS3Error(
                f"copy of {src_store.url(entry.name)} to {dst_store.url(name)} has {size} bytes, expected {entry.size}"
            )
        with lock:
            done[0] += entry.size
            if progress is not None:
                progress(done[0], total)

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dcp_s3-cp") as pool:
        for rank in (0, 1, 2):
            batch = [(e, n) for e, n in pairs if _commit_rank(e.name) == rank]
            for fut in [pool.submit(copy_one, e, n) for e, n in batch]:
                fut.result()
    return CopyReport(src, dst, len(pairs), total, time.perf_counter() - t0)


def _refuse_links_out(store: Store, names: list[str], role: str) -> None:
    links = store.links_out(names)
    if links:
        path, target = links[0]
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        raise DcpS3Error(
            f"{path} is a symbolic link out of the {role} directory {store.root} (to {target}){more}; "
            "not following it: pass follow_symlinks=True (--follow-symlinks) to copy through it"
        )


def _copy_object(src: Store, src_name: str, dst: Store, dst_name: str) -> None:
    if dst.same_server(src):
        dst.copy_from(src, src_name, dst_name)  # server-side: no bytes through this machine
    else:
        src.stream_to(src_name, dst, dst_name)
