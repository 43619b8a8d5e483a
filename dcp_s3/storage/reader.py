"""``S3StorageReader``: DCP's StorageReader over any object store (S3, S3-compatible, local disk).

Call order (torch DCP): ``reset`` → ``read_metadata`` (one GET of ``.metadata``)
→ ``set_up_storage_reader`` → ``prepare_local_plan``/``prepare_global_plan`` →
``read_data`` on every rank. ``read_data`` turns each ReadItem into byte ranges of
its object — only the bytes the plan needs — coalesces neighbours into ranged
GETs and runs them concurrently across and within objects. Tensor bytes land
directly in the destination tensor when its layout allows; otherwise in a
bounded staging buffer that is copied (and cast) into it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from crc32c import crc32c
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_s3._torch_compat import element_size, narrow_tensor_by_index, placeholder_metadata
from dcp_s3.codec import Codec, FrameIndex, accepts, stored_span, supported
from dcp_s3.errors import BucketNotFoundError, CheckpointFormatError, CheckpointNotFoundError, DcpS3Error
from dcp_s3.layout import METADATA_KEY, checksum_error
from dcp_s3.metadata.compact_chunks import ChunkLookup
from dcp_s3.metadata.formats import load_metadata
from dcp_s3.objstore.base import RangeRead
from dcp_s3.objstore.config import ClientConfig, TransferConfig, client_config
from dcp_s3.planners.sharing import broadcast_bytes, metadata_source
from dcp_s3.storage.job_progress import following_job, job_counts
from dcp_s3.storage.options import check_allow_unsafe_byte_items, check_replica_group, check_share_metadata
from dcp_s3.storage.replicated import read_replicated
from dcp_s3.storage.request_report import Meter, RankFigures, own_rank, summary
from dcp_s3.storage.session import Location, Session
from dcp_s3.storage.staging import Stagings, load_pinned_bound
from dcp_s3.storage.tensor_bytes import StagedRows, raw_bytes_view
from dcp_s3.untrusted.byte_items import check_byte_item
from dcp_s3.untrusted.foreign_items import decode_byte_item, load_tensor_archive

__all__ = ["S3StorageReader"]

log = logging.getLogger("dcp_s3")


class S3StorageReader(Location, StorageReader):
    """Load DCP checkpoints from ``s3://bucket/prefix`` with concurrent, coalesced ranged GETs, or
    from a local directory (ranged ``preadv`` into the destination, through the local object store).

    Takes the same location, credential and ``client`` arguments as ``S3StorageWriter``.
    ``max_concurrency`` bounds parallel GETs; ``max_range_size`` the size of one GET
    (larger reads are split), which also bounds staging memory per request, except GETs read
    straight into a CPU tensor (no staging), which may reach ``max_direct_range_size`` (64 MiB:
    fewer GETs, less CPU per byte; the larger of the two is used); ``max_whole_read``
    (``TransferConfig.max_whole_read``, 4 GiB) the largest ``.metadata`` read.

    ``share_metadata`` (default True): inside ``dcp.load`` on several ranks, ``.metadata``
    is read by the load's coordinator and broadcast over the load's own process group
    (found in the running ``dcp.load``, so a load on a sub-group shares over that
    sub-group); where that group cannot be found every rank reads it. ``False``: every
    rank reads it. A ``ProcessGroup``: share over that group (it must be the group
    ``dcp.load`` runs on; a different one is refused with ``ConfigError``).

    ``replica_group``: the ranks that load exactly what this rank loads (the replicas
    of its shard in HSDP, e.g. ``mesh.get_group("replicate")``, or ``dist.group.WORLD``
    when every rank loads the whole model). Each member reads a share of the common
    plan from S3 and broadcasts it to the others, so the group reads the bytes once.
    Every member must pass its own group; members whose plans differ get ``ConfigError``.
    Byte items (non-tensor values, which torch's default planner reads with
    ``torch.load(..., weights_only=False)``) are checked first, whatever the planner, and
    refused with a ``CheckpointFormatError`` if weights-only loading would refuse them
    (see ``dcp_s3.untrusted.byte_items``); ``allow_unsafe_byte_items=True`` skips that check, for
    checkpoints you trust.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        credential_path: str | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        request_args: Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        max_range_size: int | None = None,
        max_direct_range_size: int | None = None,
        transfer: TransferConfig | None = None,
        share_metadata: bool | dist.ProcessGroup = True,
        replica_group: dist.ProcessGroup | None = None,
        client: ClientConfig | None = None,
        allow_unsafe_byte_items: bool = False,
        max_whole_read: int | None = None,
    ) -> None:
        super().__init__()
        self.allow_unsafe_byte_items = check_allow_unsafe_byte_items(allow_unsafe_byte_items)
        self.share_metadata = check_share_metadata(share_metadata)
        self.replica_group = check_replica_group(replica_group)
        transfer = (transfer or TransferConfig()).override(
            max_concurrency=max_concurrency,
            max_range_size=max_range_size,
            max_direct_range_size=max_direct_range_size,
            max_whole_read=max_whole_read,
        )
        client = client_config(
            client,
            transfer.max_concurrency + 2,
            credential_path=credential_path,
            endpoint_url=endpoint_url,
            region=region,
            profile=profile,
            request_args=request_args,
        )
        self._session = Session(path, client, transfer)
        self._codec = Codec(threads=transfer.decode_threads)  # decodes compressed checkpoints
        # Pinned staging of reads into CUDA tensors (made at the first one, kept until close).
        self._stagings = Stagings(*load_pinned_bound(transfer.max_range_size, transfer.max_concurrency))
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._chunks: ChunkLookup | None = None  # set up from the load's metadata
        self._metadata_error: DcpS3Error | None = None  # see read_metadata
        self._meter = Meter()
        #: After a load: this rank's request figures for it, ``{rank: figures}`` (each rank its own:
        #: a load has no step where they could reach one rank; see ``dcp_s3.storage.request_report``).
        self.request_stats: dict[int, RankFigures] = {}

    def __repr__(self) -> str:
        return f"S3StorageReader({str(self._session.location)!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Process groups do not pickle: a copy finds dcp.load's group again (share_metadata=True),
        # an explicit group becomes False (every rank reads) and replica_group None.
        return {
            "_session": self._session,
            "_codec": self._codec,
            "load_id": self.load_id,
            "_stagings": self._stagings,
            "share_metadata": self.share_metadata is True,
            "allow_unsafe_byte_items": self.allow_unsafe_byte_items,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            state,
            storage_data={},
            _chunks=None,
            replica_group=None,
            _metadata_error=None,
            _meter=Meter(),
            request_stats={},
        )

    def close(self) -> None:
        """Release the pinned host buffers kept for reads into CUDA tensors (a later load makes new ones)."""
        self._stagings.close()

    # docstring inherited
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reset_location(checkpoint_id)
        self.storage_data = {}
        self._chunks = None
        self._metadata_error = None
        self.load_id = str(uuid.uuid4())

    # The parameter must be literally named ``kwargs`` for DCP to pass rank/use_collectives.
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, unpickled by a restricted unpickler: one GET per load (see ``share_metadata``).

        When the read fails, torch asks again with ``rank=`` (for rank-local metadata, which
        dcp_s3 never writes) and, before 2.12, then drops both errors. That second call gets
        placeholder metadata at once, without waiting for the endpoint again, and the first
        error is raised by ``set_up_storage_reader``, so the user sees it on every torch.
        """
        if "rank" in kwargs and self._metadata_error is not None:
            return placeholder_metadata()
        if "rank" not in kwargs:  # the load's first call: its requests count from here
            self._meter.start()
            self.request_stats = {}
        source = metadata_source(self.share_metadata)  # ConfigError for a wrong explicit group, on both calls
        key = self._session.key(METADATA_KEY)
        try:
            if source is None or "rank" in kwargs:
                data = self._get_metadata()
            else:  # one rank reads, the load's group shares it (an error reaches every rank)
                group, src = source
                data = broadcast_bytes(self._get_metadata, src, group, f"{self.checkpoint_id}/{METADATA_KEY}")
            metadata = load_metadata(data, self._session.object_store.url(key))
        except DcpS3Error as exc:
            self._metadata_error = exc
            raise
        self._metadata_error = None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _get_metadata(self) -> bytes:
        key = self._session.key(METADATA_KEY)
        try:
            data = self._session.object_store.get(key)
        except BucketNotFoundError:
            raise
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"no checkpoint at {self.checkpoint_id}: {METADATA_KEY} is missing "
                "(never written, or the save did not complete)"
            ) from exc
        return data

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._metadata_error is not None:
            raise self._metadata_error
        self.storage_data = metadata.storage_data  # a lazy Mapping for compact metadata
        self._chunks = ChunkLookup(metadata)  # finds chunks on lookup: no walk over all of them
        self._session.plan_requests()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator only: where each rank counts itself finished (``job_progress``); a plan that already
        carries storage data (another reader's, wrapped) keeps it."""
        counts = job_counts(len(plans))
        return [
            plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=count)
            for plan, count in zip(plans, counts)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            with following_job(self._session.object_store, plan.storage_data):
                if self.replica_group is not None:
                    read_replicated(self._read_all, self.storage_data, plan, planner, self.replica_group)
                else:
                    self._read_all(plan, planner)
            fut.set_result(None)
        except Exception as exc:  # delivered through the future, as DCP expects
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the result
        rank = own_rank(None)
        self.request_stats = {rank: self._meter.since_start()}
        level = logging.INFO if any(f["refusals"] for f in self.request_stats[rank].values()) else logging.DEBUG
        log.log(level, "%s", summary(f"load of {self.checkpoint_id}, rank {rank}", self.request_stats))
        return fut

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        if not plan.items:
            return
        reads: list[RangeRead] = []
        finishers: list[Callable[[], None]] = []
        self._stagings.begin()  # on the caller's thread: the stream the destinations belong to
        for req in plan.items:
            finishers.append(self._plan_item(req, planner, reads))
        self._stagings.wait_current()  # copies into the destinations come after their allocation
        transfer = self._session.transfer
        try:
            self._session.object_store.read_ranges(
                reads,
                executor=self._session.executor,
                max_gap=transfer.coalesce_gap,
                max_size=transfer.max_range_size,
                max_direct_size=transfer.max_direct_range_size,
            )
        finally:  # every host-to-device copy is done before DCP sees a tensor (or an error leaves the load)
            self._stagings.drain()
        self._codec.close()  # decoding is done: stop its threads (recreated on next use)
        # Planner callbacks run on this thread, in plan order, once all bytes are in.
        for finish in finishers:
            finish()
        log.debug("read %d items in %d ranges from %s", len(plan.items), len(reads), self.checkpoint_id)

    def _plan_item(self, req: ReadItem, planner: LoadPlanner, reads: list[RangeRead]) -> Callable[[], None]:
        """Append the ranges ``req`` needs to ``reads``; return what to run once they are in."""
        info = self.storage_data.get(req.storage_index)
        if info is None:
            raise CheckpointFormatError(f"{self.checkpoint_id}: no storage entry for {req.storage_index.fqn}")
        key = self._session.key(info.relative_path)
        frames = getattr(info, "frames", None)
        transforms = list(info.transform_descriptors or ())
        if frames is not None and not accepts(transforms, frames):
            raise CheckpointFormatError(
                f"{req.storage_index.fqn} in {self.checkpoint_id} uses transforms {transforms} "
                f"that this reader does not support (it reads {supported()})"
            )
        # Transforms of torch's own writer (FileSystemWriter(_extensions=...)): undone as torch does.
        foreign = transforms if frames is None else []
        if req.type == LoadItemType.BYTE_IO:
            held: dict[str, bytearray] = {}

            def open_buffer() -> memoryview:  # once the server has confirmed that the range exists
                held["buf"] = bytearray(info.length)
                return memoryview(held["buf"])

            reads.append(RangeRead(key, info.offset, info.offset + info.length, open_buffer))

            def load_bytes() -> None:
                buf = held.pop("buf") if info.length else bytearray()
                self._verify(req, info, memoryview(buf))
                if foreign:
                    where = f"byte item {req.storage_index.fqn} in {self._session.object_store.url(key)}"
                    buf = decode_byte_item(foreign, buf, where)
                if not self.allow_unsafe_byte_items:
                    check_byte_item(buf, req.storage_index.fqn, self._session.object_store.url(key))
                planner.load_bytes(req, io.BytesIO(buf))

            return load_bytes

        dest = planner.resolve_tensor(req).detach()
        if tuple(dest.shape) != tuple(req.lengths):
            raise CheckpointFormatError(
                f"{req.storage_index.fqn}: destination shape {tuple(dest.shape)} does not match the "
                f"checkpoint's {tuple(req.lengths)}"
            )
        whole = False
        if frames is None and (foreign or getattr(info, "payload_offset", None) is None):
            self._plan_torch_load(req, key, info, dest, reads, foreign)
        else:
            whole = self._plan_tensor(req, key, info, dest, reads)

        def commit() -> None:
            if whole:  # the destination holds the item's entire payload: check it
                self._verify(req, info, raw_bytes_view(dest))
            planner.commit_tensor(req, dest)

        return commit

    def _verify(self, req: ReadItem, info: Any, payload: memoryview) -> None:
        error = checksum_error(info, payload)
        if error is not None:
            where = self._session.url(info.relative_path)
            raise CheckpointFormatError(
                f"{req.storage_index.fqn}: {where} bytes {info.offset}-{info.offset + info.length}: {error}"
            )

    def _verify_frames(self, key: str, info: Any, frames: FrameIndex, lo: int, hi: int, out: memoryview) -> None:
        """Check the CRC32C of every frame that raw bytes ``[lo, hi)`` (now in ``out``) cover whole."""
        crcs = getattr(info, "frame_crc32c", None)
        if crcs is None:  # load_metadata refuses this; metadata built in-process could still lack them
            raise CheckpointFormatError(f"{self._session.object_store.url(key)}: compressed item without checksums")
        for i in range(lo // frames.frame_size, frames.num_frames):
            f_lo, f_hi = frames.raw_range(i)
            if f_lo >= hi:
                break
            if f_lo >= lo and f_hi <= hi and crc32c(out[f_lo - lo : f_hi - lo]) != crcs[i]:
                raise CheckpointFormatError(
                    f"{self._session.object_store.url(key)}: frame {i} of the item at bytes "
                    f"{info.offset}-{info.offset + info.length} fails its checksum: the stored object is corrupt"
                )

    def _plan_torch_load(
        self, req: ReadItem, key: str, info: Any, dest: torch.Tensor, reads: list[RangeRead], transforms: list[str]
    ) -> None:
        """Items written by other writers: fetch the whole ``torch.save`` blob, undo torch's ``transforms``
        (bounded by the chunk's size) and load it (see ``dcp_s3.untrusted.foreign_items``)."""
        index = req.storage_index
        found = self._chunks.find(index.fqn, index.offset or ()) if self._chunks is not None else None
        if found is None:
            raise CheckpointFormatError(f"{self.checkpoint_id}: no chunk metadata for {req.storage_index}")
        state: dict[str, bytearray] = {}

        def open_buffer() -> memoryview:  # allocated only while the request is in flight
            state["buf"] = bytearray(info.length)
            return memoryview(state["buf"])

        def done() -> None:
            where = f"{req.storage_index.fqn} in {self._session.object_store.url(key)}"
            tensor = load_tensor_archive(state.pop("buf"), transforms, found[0], found[1], where)
            dest.copy_(narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths))

        reads.append(RangeRead(key, info.offset, info.offset + info.length, open_buffer, done))

    def _plan_tensor(self, req: ReadItem, key: str, info: Any, dest: torch.Tensor, reads: list[RangeRead]) -> bool:
        """Fetch the rows of the stored chunk that ``req`` covers, straight into ``dest`` if possible.

        Returns whether ``dest`` then holds the whole stored payload (so its checksum can be checked).
        """
        fqn = req.storage_index.fqn
        found = self._chunks.find(fqn, req.storage_index.offset or ()) if self._chunks is not None else None
        if found is None:
            raise CheckpointFormatError(f"{self.checkpoint_id}: no chunk metadata for {req.storage_index}")
        sizes, dtype = found
        if len(req.lengths) != len(sizes) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, sizes)
        ):
            raise CheckpointFormatError(
                f"{fqn}: the plan reads {list(req.lengths)} at {list(req.storage_offsets)} of a stored chunk of {list(sizes)}"
            )
        elem = element_size(dtype)
        rows_total = sizes[0] if len(sizes) else 1
        row_bytes = math.prod(sizes[1:]) * elem if len(sizes) else elem
        frames: FrameIndex | None = getattr(info, "frames", None)
        stored = frames.raw_length if frames is not None else info.length - info.payload_offset
        if stored < rows_total * row_bytes:
            raise CheckpointFormatError(
                f"{fqn} in {info.relative_path}: item holds {stored} bytes, too few for a {list(sizes)} {dtype} tensor"
            )
        row0 = req.storage_offsets[0] if len(sizes) else 0
        rows = req.lengths[0] if len(sizes) else 1
        if rows == 0 or math.prod(req.lengths) == 0:
            return False
        transfer = self._session.transfer
        max_bytes = transfer.max_range_size
        whole_rows = tuple(req.lengths[1:]) == tuple(sizes[1:])
        direct = whole_rows and dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
        if direct:
            view = raw_bytes_view(dest)
            start = row0 * row_bytes
            # Raw bytes go straight into ``dest``: no buffer to bound, so larger GETs (fewer, cheaper per byte).
            # Compressed bytes are held while in flight: their GETs keep ``max_range_size``, frame-aligned.
            if frames is None:
                step = max(max_bytes, transfer.max_direct_range_size)
            else:
                step = max(1, max_bytes // frames.frame_size) * frames.frame_size
            # Frame-aligned pieces (in raw offsets) so that no frame is decoded twice.
            cuts = [start, *range(start - start % step + step, start + len(view), step), start + len(view)]
            for lo, hi in zip(cuts, cuts[1:]):
                self._add_read(reads, key, info, lo, hi, _slice_opener(view, lo - start, hi - start), direct=True)
            return row0 == 0 and rows == rows_total
        # Staged: whole rows into a bounded CPU buffer (pinned for a CUDA dest), then narrowed, cast and copied.
        staging = self._stagings.get(dest)
        rows_per_piece = max(1, max_bytes // max(1, row_bytes))
        for r in range(0, rows, rows_per_piece):
            n = min(rows_per_piece, rows - r)
            piece = StagedRows(dest, sizes, dtype, req, r, n, staging)
            start = (row0 + r) * row_bytes
            self._add_read(reads, key, info, start, start + n * row_bytes, piece.open, piece.done)
        return False

    def _add_read(
        self,
        reads: list[RangeRead],
        key: str,
        info: Any,
        lo: int,
        hi: int,
        open_dest: Callable[[], memoryview],
        done: Callable[[], None] | None = None,
        direct: bool = False,
    ) -> None:
        """Deliver raw payload bytes ``[lo, hi)`` of an item into ``open_dest()``, then run ``done``
        (``direct``: ``open_dest`` gives the destination itself, no buffer: see ``RangeRead.direct``)."""
        frames: FrameIndex | None = getattr(info, "frames", None)
        if frames is None:
            start = info.offset + info.payload_offset
            reads.append(RangeRead(key, start + lo, start + hi, open_dest, done, direct=direct))
            return
        s0, s1 = stored_span(frames, lo, hi)
        held: dict[str, bytearray] = {}

        def open_stored() -> memoryview:  # compressed bytes live only while in flight
            held["buf"] = bytearray(s1 - s0)
            return memoryview(held["buf"])

        def decode() -> None:
            out = open_dest()
            self._codec.decode_into(frames, held.pop("buf"), s0, lo, hi, out)
            self._verify_frames(key, info, frames, lo, hi, out)
            if done is not None:
                done()

        reads.append(RangeRead(key, info.offset + s0, info.offset + s1, open_stored, decode))


def _slice_opener(view: memoryview, lo: int, hi: int) -> Callable[[], memoryview]:
    return lambda: view[lo:hi]
