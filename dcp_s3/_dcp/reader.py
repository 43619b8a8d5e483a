"""``S3StorageReader``: DCP's StorageReader over any object store (S3, S3-compatible, local disk).

Call order (torch DCP): ``reset`` → ``read_metadata`` (one GET of ``.metadata``)
→ ``set_up_storage_reader`` → ``prepare_local_plan``/``prepare_global_plan`` →
``read_data`` on every rank. ``read_data`` turns each ReadItem into byte ranges of
its object — only the bytes the plan needs — coalesces neighbours into ranged
GETs and runs them concurrently across and within objects. Tensor bytes land
directly in the destination tensor when its layout allows; otherwise in a
bounded staging buffer that is copied (and cast) into it. How one item becomes
its reads, and is checked once they are in: :mod:`dcp_s3._dcp.item_reads`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_s3._codec import Codec
from dcp_s3._dcp.item_reads import ItemReads
from dcp_s3._dcp.job_progress import following_job, job_counts
from dcp_s3._dcp.options import WRITER_FIELDS, Settings, pooled
from dcp_s3._dcp.replicated import read_replicated
from dcp_s3._dcp.request_report import Meter, RankFigures, own_rank, summary
from dcp_s3._dcp.session import Location, Session
from dcp_s3._dcp.staging import Stagings, load_pinned_bound
from dcp_s3._layout import METADATA_KEY
from dcp_s3._metadata.compact_chunks import ChunkLookup
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._objstore.base import RangeRead
from dcp_s3._planners.sharing import broadcast_bytes, metadata_source
from dcp_s3._torch_compat import placeholder_metadata
from dcp_s3.errors import BucketNotFoundError, CheckpointNotFoundError, DcpS3Error

__all__ = ["S3StorageReader"]

log = logging.getLogger(__name__)


class S3StorageReader(Location, StorageReader):
    """Load DCP checkpoints from ``s3://bucket/prefix`` with concurrent, coalesced ranged GETs, or
    from a local directory (ranged ``preadv`` into the destination, through the local object store).

    Takes ``path``, ``options`` and keywords as ``S3StorageWriter`` does (any storage option but the
    writer's own, which are refused: :mod:`dcp_s3._dcp.options`), the client and transfer ones
    included. ``max_concurrency`` bounds parallel GETs; ``max_range_size`` the size of one GET
    (larger reads are split), which also bounds staging memory per request, except GETs read
    straight into a CPU tensor (no staging; a compressed item's frames decoded into it one by one
    from a reused buffer), which may reach ``max_direct_range_size`` (64 MiB: fewer GETs, less CPU
    per byte; the larger of the two is used); ``max_whole_read``
    (``TransferConfig.max_whole_read``, 4 GiB) the largest ``.metadata`` read. The reader's own
    settings (``ReaderSettings``):

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
    (see ``dcp_s3._untrusted.byte_items``); ``allow_unsafe_byte_items=True`` skips that check, for
    checkpoints you trust.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, options: Settings | None = None, **keywords: Any
    ) -> None:
        super().__init__()
        settings = Settings.of(options, side="S3StorageReader", refuse=WRITER_FIELDS, **keywords)
        self.allow_unsafe_byte_items = settings.reading.allow_unsafe_byte_items
        self.share_metadata = settings.reading.share_metadata
        self.replica_group = settings.reading.replica_group
        transfer = settings.transfer
        self._session = Session(path, pooled(settings.client, transfer.max_concurrency + 2), transfer)
        self._codec = Codec(threads=transfer.decode_threads)  # decodes compressed checkpoints
        # Pinned staging of reads into CUDA tensors (made at the first one, kept until close).
        self._stagings = Stagings(*load_pinned_bound(transfer.max_range_size, transfer.max_concurrency))
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._chunks: ChunkLookup | None = None  # set up from the load's metadata
        self._metadata_error: DcpS3Error | None = None  # see read_metadata
        self._meter = Meter()
        #: After a load: this rank's request figures for it, ``{rank: figures}`` (each rank its own:
        #: a load has no step where they could reach one rank; see ``dcp_s3._dcp.request_report``).
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
        try:
            if source is None or "rank" in kwargs:
                data = self._get_metadata()
            else:  # one rank reads, the load's group shares it (an error reaches every rank)
                group, src = source
                data = broadcast_bytes(self._get_metadata, src, group, f"{self.checkpoint_id}/{self._metadata_name}")
            metadata = self._decode_metadata(data)
        except DcpS3Error as exc:
            self._metadata_error = exc
            raise
        self._metadata_error = None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @property
    def _coalesce_gap(self) -> int:
        """The largest gap between two reads of an object that one request spans (``TransferConfig.coalesce_gap``)."""
        return self._session.transfer.coalesce_gap

    #: What ``_get_metadata`` reads, for messages (the HF reader reads ``model.safetensors.index.json``).
    _metadata_name = METADATA_KEY

    def _decode_metadata(self, data: bytes) -> Metadata:
        """The load's ``Metadata`` from the bytes ``_get_metadata`` returned (on every rank)."""
        return load_metadata(data, self._session.url(METADATA_KEY))

    def _get_metadata(self) -> bytes:
        """The bytes every rank decodes into the load's metadata (read once and shared, see ``share_metadata``)."""
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
            for plan, count in zip(plans, counts, strict=True)
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
        items = ItemReads(
            self._session,
            self.checkpoint_id,
            self.storage_data,
            self._chunks,
            self._codec,
            self._stagings,
            allow_unsafe_byte_items=self.allow_unsafe_byte_items,
        )
        self._stagings.begin()  # on the caller's thread: the stream the destinations belong to
        for req in plan.items:
            finishers.append(items.plan_item(req, planner, reads))
        self._stagings.wait_current()  # copies into the destinations come after their allocation
        transfer = self._session.transfer
        try:
            self._session.object_store.read_ranges(
                reads,
                executor=self._session.executor,
                max_gap=self._coalesce_gap,
                max_size=transfer.max_range_size,
                max_direct_size=transfer.max_direct_range_size,
            )
        finally:  # every host-to-device copy is done before DCP sees a tensor (or an error leaves the load)
            self._stagings.drain()
            items.release_staged()  # pinned buffers of pieces whose read failed: back in the pool
        self._codec.close()  # decoding is done: stop its threads (recreated on next use)
        # Planner callbacks run on this thread, in plan order, once all bytes are in.
        for finish in finishers:
            finish()
        log.debug("read %d items in %d ranges from %s", len(plan.items), len(reads), self.checkpoint_id)
