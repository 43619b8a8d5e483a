"""``S3HuggingFaceStorageWriter``: ``dcp.save`` from N ranks to a Hugging Face safetensors export in S3 (or a
local directory), with no local disk and no rank holding more than its own chunks.

Call order (torch DCP) and who does what:

1. ``prepare_global_plan`` (coordinator): checks the bucket, and ``model.safetensors.index.json``: present
   and ``overwrite=False`` → ``CheckpointExistsError``; present and ``overwrite=True`` → deleted first, so a
   save that then fails leaves an export that is refused as incomplete, never one that mixes two saves'
   shards (shard names are fixed by the format, so the replace cannot be atomic as ``S3StorageWriter``'s
   is). Then plans every byte (:mod:`dcp_s3._dcp.hf_export_plan`): which tensor goes in which shard at
   which offset, and for each rank, the order of its chunks in its *piece object*, under a staging prefix
   ``.dcp_s3-hf-staging.<token>/`` new to the save.
2. ``write_data`` (every rank): streams its chunks' raw bytes, in that order, into its piece object (a
   multipart upload sent from the tensors' own memory, as ``S3StorageWriter`` sends them).
3. ``finish`` (coordinator): composes each shard, ``model-0000i-of-0000N.safetensors``, as the header bytes
   followed by spans of the piece objects (:func:`dcp_s3._objstore.compose.compose`): on S3 one multipart
   upload whose parts are UploadPartCopy ranges of the pieces, so a consolidated tensor's bytes go from the
   ranks that own them to the shard without passing through any one process; the header, spans under S3's
   5 MiB minimum part and the few MiB at a boundary are read and sent by the coordinator, at most
   ``max_concurrency`` parts of ~5 MiB at once. A server without UploadPartCopy (its ``NotImplemented``
   answer) and a local directory get each shard streamed through the coordinator, ``part_size`` bytes at a
   time. Then the index is PUT — last, and conditionally (``If-None-Match: *``): the index is the commit.
   The staging prefix is deleted in every case.

Why this design: the alternatives each break a requirement. Gathering a tensor to one rank bounds memory by
the largest tensor; one multipart upload fed by every rank's ``UploadPart`` needs the parts' boundaries to
fall on the ranks' chunk boundaries, which S3's 5 MiB minimum forbids for small chunks, and a rank cannot
send part *n* of a file without knowing every byte before it. Copying ranges server-side keeps each rank's
upload a plain streaming write and leaves the coordinator only the small pieces.

What a failure leaves: no index (so readers refuse the prefix as incomplete); the shards already composed;
piece objects of ranks that finished when another rank failed (torch calls no ``finish`` then) under
``.dcp_s3-hf-staging.<token>/``, to delete by hand.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from dcp_s3._commit import publish
from dcp_s3._dcp.hf_export_plan import ExportPlan, RankPieces, plan_export
from dcp_s3._dcp.hf_reader import INDEX_NAME
from dcp_s3._dcp.metadata_commit import delete_quietly, exists_error
from dcp_s3._dcp.options import READER_FIELDS, Settings
from dcp_s3._dcp.safetensors_header import EXPORT_KEY, build_index
from dcp_s3._dcp.tensor_bytes import compact, payload_chunks, streamable
from dcp_s3._dcp.writer import S3StorageWriter
from dcp_s3._layout import PROBE_PREFIX, new_token
from dcp_s3._objstore.buffers import BufferPool
from dcp_s3._objstore.compose import compose
from dcp_s3._objstore.config import int_option
from dcp_s3.errors import ConfigError, ServerCapabilityError

__all__ = ["S3HuggingFaceStorageWriter", "STAGING_PREFIX", "DEFAULT_MAX_SHARD_SIZE"]

log = logging.getLogger(__name__)

#: Name prefix of a save's staging folder of piece objects (``.dcp_s3-hf-staging.<token>/rank-00000``).
STAGING_PREFIX = ".dcp_s3-hf-staging."
#: ``save_pretrained``'s default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


class S3HuggingFaceStorageWriter(S3StorageWriter):
    """Save to a Hugging Face safetensors export at ``s3://bucket/prefix`` (or a local directory) with
    ``dcp.save(state_dict, storage_writer=S3HuggingFaceStorageWriter(path, ...))``: consolidated tensors under
    the state dict's names, in ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json``.

    Takes the location and connection arguments of :class:`~dcp_s3.S3StorageWriter` (``credential_path``,
    ``endpoint_url``, ``region``, ``profile``, ``request_args``, ``client=``, ``transfer=``, ``part_size``,
    ``max_concurrency``, ``require_conditional_writes``...) with the same meaning, and:

    Args:
        max_shard_size: bytes of tensors per shard file (default 5 GB, as ``save_pretrained``); a larger
            tensor is a shard of its own.
        options: a ``StorageOptions`` (or mapping) of these keywords, as for ``S3StorageWriter``.
        **keywords: ``S3StorageWriter``'s. ``overwrite`` differs: replace an export already at ``path``; default
            ``False`` here: refuse with ``CheckpointExistsError`` (checked when the save is planned, and again by
            the conditional PUT of the index). ``True``: the old index is deleted before anything is written, so
            the old export stops loading as the save starts, and a failed save leaves the prefix incomplete.

    The state dict must hold tensors only (DTensors, sharded or replicated, and plain tensors), each of a
    dtype safetensors names. Chunks split across inner dimensions (``Shard(1)``) are exported but cut into
    one run per row, each under S3's 5 MiB minimum copied through the coordinator: export from ``Shard(0)``
    or replicated placements (FSDP2's) for speed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        options: Settings | Mapping[str, Any] | None = None,
        **keywords: Any,
    ) -> None:
        given = {**(options.as_dict() if isinstance(options, Settings) else dict(options or {})), **keywords}
        # An export is never replaced unless asked (S3StorageWriter's own default replaces).
        settings = Settings.of(options, side="S3HuggingFaceStorageWriter", refuse=READER_FIELDS, **keywords)
        if "overwrite" not in given:
            settings = Settings.of(settings, overwrite=False)
        fixed = {
            "compression": settings.writing.compression is None,
            "key_prefixes": settings.writing.key_prefixes == 1,
            "metadata_format": settings.writing.metadata_format == "auto",
            "files_per_rank": settings.transfer.files_per_rank == 1,
        }
        for name, ok in fixed.items():
            if not ok:
                raise ConfigError(f"{name}={given.get(name)!r}: a Hugging Face export's format is fixed")
        super().__init__(path, options=settings)
        self.max_shard_size = int_option("max_shard_size", max_shard_size, 1)
        self._export: ExportPlan | None = None  # the coordinator's, from planning to finish
        self._export_id = ""  # recorded in the index and every shard (EXPORT_KEY)

    def __repr__(self) -> str:
        return f"S3HuggingFaceStorageWriter({str(self._session.location)!r}, overwrite={self.overwrite})"

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator only: the overwrite rule (see the module docstring), then the byte plan."""
        store = self._session.object_store
        store.check_container()
        self._conditional_commit = self._check_conditional_writes()
        index = self._session.key(INDEX_NAME)
        if store.head(index) is not None:
            if not self.overwrite:
                raise exists_error(self.checkpoint_id, "pass overwrite=True to replace it or choose a new path")
            log.info("deleting %s: the export it commits is being replaced", store.url(index))
            store.delete([index])
        self._export_id = new_token()
        self._export = plan_export(
            plans, self.max_shard_size, STAGING_PREFIX + self._export_id, {EXPORT_KEY: self._export_id}
        )
        return [
            dataclasses.replace(p, storage_data=pieces) for p, pieces in zip(plans, self._export.ranks, strict=True)
        ]

    def _check_conditional_writes(self) -> bool:
        store = self._session.object_store
        if store.conditional_writes_supported(self._session.key(PROBE_PREFIX + new_token())):
            return True
        where = store.describe()
        if self.require_conditional_writes:
            raise ServerCapabilityError(
                f"{self.checkpoint_id}: {where} ignores If-None-Match on PUT, so an export racing to the same "
                "path could be replaced unnoticed; pass require_conditional_writes=False to accept a "
                "best-effort check"
            )
        warnings.warn(
            f"{where} ignores If-None-Match: the export at {self.checkpoint_id} is committed after a HEAD "
            "(best effort; a racing export can be replaced)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    # docstring inherited (S3StorageWriter.write_data calls this inside its error handling and figures)
    def _write_all(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        pieces: RankPieces = plan.storage_data
        if not pieces.order:
            return [WriteResult(index=i.index, size_in_bytes=0, storage_data=None) for i in plan.items]
        items = {(i.index.fqn, tuple(int(o) for o in i.index.offset or ())): i for i in plan.items}
        transfer = self._session.transfer
        pool = BufferPool(transfer.max_concurrency + 1, transfer.part_size, transfer.max_direct_part_size)
        key = self._session.key(pieces.name)
        writer = self._session.object_store.open_writer(
            key, pool=pool, executor=self._session.executor, expected_size=pieces.size
        )
        results = []
        try:
            for chunk in pieces.order:
                item = items.get(chunk)
                if item is None:
                    raise ConfigError(f"{chunk[0]!r} at {chunk[1]}: planned for this rank, not in its save plan")
                tensor = planner.resolve_data(item)
                if not isinstance(tensor, torch.Tensor) or not streamable(tensor):
                    raise ConfigError(f"{chunk[0]!r}: not a dense tensor ({type(tensor).__name__})")
                tensor = compact(tensor)
                start = writer.tell()
                if tensor.device.type == "cpu":  # sent from its memory: each view keeps it alive until its part is sent
                    for view in payload_chunks(tensor):
                        writer.write_stable(view)
                else:
                    for view in payload_chunks(tensor):
                        writer.write(view)
                results.append(WriteResult(index=item.index, size_in_bytes=writer.tell() - start, storage_data=None))
            written = set(pieces.order)
            results += [  # zero-element chunks: in the header, no bytes
                WriteResult(index=item.index, size_in_bytes=0, storage_data=None)
                for chunk, item in items.items()
                if chunk not in written
            ]
            if writer.tell() != pieces.size:
                raise ConfigError(f"{writer.tell()} bytes written of the {pieces.size} planned for {pieces.name}")
            writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            pool.clear()
        return results

    def _finish(self, metadata: Metadata, results: Sequence[Sequence[WriteResult]]) -> None:
        """Coordinator only: compose the shards, then PUT the index (the commit); delete the pieces."""
        export, self._export = self._export, None
        if export is None:
            raise ConfigError("finish without prepare_global_plan on this writer (the coordinator's)")
        session = self._session
        transfer = session.transfer
        try:
            for name, pieces in export.files:
                keyed = [p if isinstance(p, bytes) else dataclasses.replace(p, key=session.key(p.key)) for p in pieces]
                compose(
                    session.object_store,
                    session.key(name),
                    keyed,
                    executor=session.executor,
                    chunk=transfer.part_size,
                    max_buffered=transfer.max_concurrency,
                )
            self._commit(build_index(export.weight_map, export.total_size, self._export_id))
        finally:
            delete_quietly(
                session, self.checkpoint_id, [r.name for r in export.ranks if r.size], "staged pieces of the export"
            )
        log.info("exported %s: %d tensors in %d files", self.checkpoint_id, len(export.weight_map), len(export.files))

    def _commit(self, body: bytes) -> None:
        """Publish the index, the commit (:func:`dcp_s3._commit.publish`): refused if another export holds it."""
        taken = publish(
            self._session.object_store, self._session.key(INDEX_NAME), body, conditional=self._conditional_commit
        )
        if taken is not None:
            raise exists_error(
                self.checkpoint_id, "another export committed it while this one was being written; not committed"
            )
