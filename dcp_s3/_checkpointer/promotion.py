"""Promotion of a node-local step to S3: each rank uploads its own objects, rank 0 commits.

A step of the local tier (:mod:`dcp_s3._checkpointer.tiers`) is, on every rank, a self-contained DCP
checkpoint of that rank's own state (saved without collectives) under the rank's local root. Promoting it
turns the per-rank checkpoints into one ordinary step on S3, in the layout every reader knows
(:mod:`dcp_s3._checkpointer.steps`, parts in generation directories ``<step>.<key>_<kind>.<token>/``
named by the marker's ``part_dirs``, :mod:`dcp_s3._checkpointer.generations`):

1. every rank streams the data objects its local ``.metadata`` references to the part directory on S3
   (:meth:`dcp_s3._dcp.store.Store.stream_to`: ranged reads, bounded memory) and then writes its local
   ``.metadata`` there as ``__rankmeta_<rank>.distcp`` — its report that it is done;
2. rank 0 waits (polling S3, bounded by ``timeout``) for every rank's report, merges the per-rank
   metadata into one (:func:`merge_metadata`: the union of the chunks, one copy of replicated items),
   writes each part's ``.metadata`` (the part's commit), then the marker (the step's commit), deletes
   the reports and applies ``keep_last``.

No collective runs here: the ranks meet through S3, so a promotion in a background thread can never
interleave with the training job's collectives, and ranks may be at different iterations meanwhile.
A kill at any point leaves S3's last committed step as it was: the new step has no marker until every
part is committed. Its objects (``.distcp``, and ``.metadata`` of parts) are then those of an incomplete
step, which ``dcp-s3 gc`` removes; a promotion of the same step started again uploads everything again.
Each request is retried ``attempts`` times; a promotion that keeps failing raises (the caller reports it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_s3._checkpointer.generations import commit_step
from dcp_s3._checkpointer.local_layout import globalize
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY, referenced_objects
from dcp_s3._metadata.compact_read import materialize
from dcp_s3._metadata.formats import dump_metadata, load_metadata
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes
from dcp_s3.errors import DcpS3Error, S3TransferError

__all__ = ["merge_metadata", "report_name", "upload_rank", "commit_promoted", "retry"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def report_name(part_dir: str, rank: int) -> str:
    """Where rank ``rank`` leaves its local ``.metadata`` in ``part_dir`` once its objects are uploaded
    (a ``.distcp`` name, so that ``gc`` and retention treat a leftover one as a checkpoint object)."""
    return f"{part_dir}/__rankmeta_{rank}.distcp"


def retry(fn: Callable[[], T], what: str, attempts: int, delay: float = 0.5) -> T:
    """``fn()``, tried ``attempts`` times with a growing pause between failures; the last failure raises."""
    for attempt in range(1, attempts):
        try:
            return fn()
        except (DcpS3Error, OSError) as exc:
            log.warning("promotion: %s failed (attempt %d of %d), retrying: %s", what, attempt, attempts, exc)
            time.sleep(delay * attempt)
    return fn()


def layout_name(part_dir: str, rank: int) -> str:
    """Where rank ``rank`` leaves the layout of its shards in ``part_dir`` (beside its report)."""
    return f"{part_dir}/__ranklayout_{rank}.distcp"


def upload_rank(local: Store, s3: Store, parts: Sequence[tuple[str, str, Any]], rank: int, attempts: int) -> int:
    """Rank ``rank``: for each (local part directory, S3 part directory, layout), stream every object the
    local ``.metadata`` references to S3, then write the layout and the report. Returns the bytes uploaded."""
    sent = 0
    for local_dir, s3_dir, layout in parts:
        meta = local.read(f"{local_dir}/{METADATA_KEY}")
        md = load_metadata(meta, local.url(f"{local_dir}/{METADATA_KEY}"))
        for name in sorted(referenced_objects(md)):
            src, dst = f"{local_dir}/{name}", f"{s3_dir}/{name}"
            retry(partial(local.stream_to, src, s3, dst), f"upload of {local.url(src)} to {s3.url(dst)}", attempts)
            sent += local.size(src) or 0
        body = torch_save_bytes(layout)
        retry(
            partial(s3.write, layout_name(s3_dir, rank), body), f"layout of rank {rank} to {s3.url(s3_dir)}", attempts
        )
        retry(
            partial(s3.write, report_name(s3_dir, rank), meta), f"report of rank {rank} to {s3.url(s3_dir)}", attempts
        )
    return sent


def merge_metadata(per_rank: Sequence[Metadata]) -> Metadata:
    """One checkpoint's metadata from the per-rank checkpoints of the same state: every chunk each rank
    stored (a chunk stored by several ranks, a replicated tensor, once: the lowest rank's), every
    non-tensor item once (the lowest rank's). Chunks of one tensor must agree on its size and properties."""
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    seen: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for md in map(materialize, per_rank):
        planner.update({k: v for k, v in (md.planner_data or {}).items() if k not in planner})
        for fqn, entry in md.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                state.setdefault(fqn, entry)
                continue
            have = state.setdefault(fqn, TensorStorageMetadata(entry.properties, entry.size, []))
            if not isinstance(have, TensorStorageMetadata) or have.size != entry.size:
                raise DcpS3Error(f"{fqn}: the ranks' local checkpoints disagree on its size or kind")
            keys = seen.setdefault(fqn, set())
            for chunk in entry.chunks:
                key = (tuple(chunk.offsets), tuple(chunk.sizes))
                if key not in keys:
                    keys.add(key)
                    have.chunks.append(chunk)
        for index, info in (md.storage_data or {}).items():
            storage.setdefault(index, info)
    out = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage, storage_meta=None)
    out.version = getattr(per_rank[0], "version", None) if per_rank else None
    return out


def _read(s3: Store, name: str, attempts: int) -> bytes:
    return retry(lambda: s3.read(name), f"GET of {s3.url(name)}", attempts)


def commit_promoted(
    s3: Store,
    step: str,
    parts: Sequence[tuple[str, str]],
    marker: bytes,
    token: str,
    world: int,
    *,
    timeout: float,
    attempts: int,
    poll: float = 0.2,
) -> None:
    """Rank 0: wait for every rank's report in every S3 part directory, write each part's merged
    ``.metadata``, then the marker (``commit_step``), then delete the reports."""
    suffixes = [s3_dir.rsplit(".", 1)[0].split(".", 1)[1] for _, s3_dir in parts]
    deadline = time.monotonic() + timeout
    for _, s3_dir in parts:
        missing = list(range(world))
        while missing:
            missing = [r for r in missing if s3.size(report_name(s3_dir, r)) is None]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise S3TransferError(
                    f"promotion of {s3.url(step)}: ranks {missing} did not report their upload to "
                    f"{s3.url(s3_dir)} within {timeout:.0f}s"
                )
            time.sleep(poll)
            poll = min(poll * 1.5, 2.0)
    for _, s3_dir in parts:
        reports = [_read(s3, report_name(s3_dir, r), attempts) for r in range(world)]
        layouts = [_read(s3, layout_name(s3_dir, r), attempts) for r in range(world)]
        merged = merge_metadata(
            [
                globalize(
                    load_metadata(b, s3.url(report_name(s3_dir, r))),
                    torch_load(layouts[r], s3.url(layout_name(s3_dir, r))),
                    s3.url(report_name(s3_dir, r)),
                )
                for r, b in enumerate(reports)
            ]
        )
        body = dump_metadata(merged, "dcp")
        retry(partial(s3.write, f"{s3_dir}/{METADATA_KEY}", body), f"commit of {s3.url(s3_dir)}", attempts)
    retry(lambda: commit_step(s3, step, marker, token, suffixes), f"marker of {s3.url(step)}", attempts)
    for _, s3_dir in parts:
        try:
            s3.delete([n for r in range(world) for n in (report_name(s3_dir, r), layout_name(s3_dir, r))])
        except (DcpS3Error, OSError) as exc:  # the step is committed; leftovers are gc's
            log.warning("promoted %s, but could not delete the upload reports: %s", s3.url(step), exc)
