"""``S3StorageWriter``: DCP's StorageWriter over any object store (S3, S3-compatible, local disk).

Call order (torch DCP): every rank calls ``reset`` → ``set_up_storage_writer`` →
``prepare_local_plan``; the coordinator calls ``prepare_global_plan`` (checks the
bucket and the overwrite rule, once); every rank calls ``write_data`` (streams its
items into ``files_per_rank`` objects, named with a token new to this save); the
coordinator calls ``finish``, which PUTs ``.metadata`` last — a checkpoint exists if
and only if its ``.metadata`` does — and then deletes the objects of the checkpoint
that ``.metadata`` replaced.

Why this never loses a checkpoint: a save only ever creates objects no other save
uses, so until its ``.metadata`` PUT lands the checkpoint already at the path is
untouched and loads bit-exact; the PUT replaces the old ``.metadata`` atomically; only
then are the old objects deleted. Two saves racing to one path each commit a complete
``.metadata`` naming only their own objects, so the result is one save's data, never a
mix. Objects of a save that failed or was killed are left for ``dcp-s3 gc``. The commit itself is
:mod:`dcp_s3._dcp.metadata_commit`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_s3._codec import Codec
from dcp_s3._dcp.data_objects import planned_size, split_items, write_item
from dcp_s3._dcp.job_progress import JobCount, following_job, forget_counts, job_counts
from dcp_s3._dcp.metadata_commit import commit_once, commit_replacing, delete_quietly, exists_error
from dcp_s3._dcp.options import READER_FIELDS, Settings, pooled
from dcp_s3._dcp.request_report import Meter, RankFigures, RankResults, own_rank, split_results, summary
from dcp_s3._dcp.session import Location, Session
from dcp_s3._dcp.staging import Stagings, save_pinned_bound
from dcp_s3._layout import (
    FORMAT_TAG,
    METADATA_KEY,
    PROBE_PREFIX,
    data_object_name,
    new_token,
    rank_prefix,
    referenced_objects,
)
from dcp_s3._metadata.compact_write import dump_compact
from dcp_s3._metadata.formats import compact_wanted, dump_metadata, load_metadata
from dcp_s3._objstore.base import wait_all
from dcp_s3._objstore.buffers import BufferPool
from dcp_s3._packed.results import PackedResults
from dcp_s3._torch_compat import _StoragePrefix
from dcp_s3.errors import ConfigError, ServerCapabilityError

__all__ = ["S3StorageWriter"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _RankStorage(_StoragePrefix):
    """A rank's object-name prefix (``prefix``) and where it counts itself finished (``job_progress``)."""

    count: JobCount | None = None


class S3StorageWriter(Location, StorageWriter, BlockingAsyncStager):
    """Save DCP checkpoints to ``s3://bucket/prefix`` (streaming multipart uploads) or a local directory.

    A local path (or ``file://`` URL) saves through the local-disk object store with the same
    format, checksums, compression and commit protocol as on S3 (the S3 client options are
    then unused); uncompressed local checkpoints also load with torch's ``FileSystemReader``.

    Args:
        path: ``s3://bucket/key`` or a local directory (or pass ``checkpoint_id=`` to ``dcp.save``).
        options: a :class:`dcp_s3.StorageOptions` (or a mapping of its keywords); ``keywords`` are merged
            over it, once (:mod:`dcp_s3._dcp.options`).
        keywords: any storage option but the reader's (which are refused, ``ConfigError``), each checked
            now (a bad one is a ``ConfigError`` naming it). The writer's own (``WriterSettings``):

            - ``overwrite``: replace a checkpoint already at ``path`` (default, as torch's
              ``FileSystemWriter``), atomically: until the new ``.metadata`` lands the old checkpoint loads
              unchanged, and a failed or killed save leaves it intact. ``False``: refuse with
              ``CheckpointExistsError`` ("Checkpoint already exists ..."), enforced by a conditional PUT of
              ``.metadata``.
            - ``require_conditional_writes``: with ``overwrite=False`` on a server that ignores
              ``If-None-Match`` (tested once per bucket and process), refuse to save with
              ``ServerCapabilityError`` (default). ``False``: fall back to a HEAD just before the commit,
              with a warning — a save racing to the same path can then be replaced.
            - ``compression``: ``"zstd"`` stores tensors as byte-grouped, frame-indexed zstd (smaller,
              decoded in parallel, readable by range); ``None`` (default) keeps torch's uncompressed
              format. Readers need no option. ``compression_level``: zstd level (1 is best for
              checkpoints: fast, and as small); ``compression_threads``: threads compressing frames in
              parallel with the upload.
            - ``key_prefixes``: spread the data objects over this many key prefixes inside the
              checkpoint: rank r writes ``p-<h>/__<r>_<n>.distcp``, ``<h>`` being ``r % key_prefixes`` in
              hex, digits reversed (see ``dcp_s3._layout.rank_prefix``). S3 serves ~3,500 PUT/s and ~5,500
              GET/s per partition of a bucket's key range; with every object under one prefix, saves of
              more than ~250 ranks exceed that. 16 or 256 is typical for such jobs. 1 (default): torch's
              flat layout. Readers need no option.
            - ``metadata_format``: ``"auto"`` (default), ``"pickle"`` or ``"compact"``.

            The client's (``client=`` a ``ClientConfig``, or its fields): ``credential_path`` (JSON file
            of boto3 client arguments; without it the standard boto3 chain applies), ``endpoint_url``,
            ``region``, ``profile``, ``request_args`` (sent with every request that takes them:
            ``ServerSideEncryption``, ``SSEKMSKeyId``, ``StorageClass``...), timeouts and retries. The
            transfer's (``transfer=`` a ``TransferConfig``, or its fields): ``part_size`` (part buffers of
            a save hold at most ``(max_concurrency + files_per_rank) * fit_part_size(part_size, largest
            object)`` bytes, see docs/configuration.md, "Memory"), ``max_direct_part_size`` (largest part
            sent straight from tensor memory), ``max_concurrency`` (parallel part uploads per process),
            ``files_per_rank`` (data objects per rank, each serialized by its own thread),
            ``max_whole_read`` (largest ``.metadata`` read whole: the one an overwrite replaces).
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, options: Settings | None = None, **keywords: Any
    ) -> None:
        StorageWriter.__init__(self)
        settings = Settings.of(options, side="S3StorageWriter", refuse=READER_FIELDS, **keywords)
        writing, transfer = settings.writing, settings.transfer
        self.metadata_format = writing.metadata_format  # metadata.formats.dump_metadata
        BlockingAsyncStager.__init__(self)
        client = pooled(settings.client, transfer.max_concurrency + transfer.files_per_rank + 2)
        self._session = Session(path, client, transfer)
        # Pinned staging of CUDA tensors (made at the first one, kept across saves until close).
        self._stagings = Stagings(*save_pinned_bound(transfer.part_size, transfer.files_per_rank))
        self._codec = (
            Codec(level=writing.compression_level, threads=writing.compression_threads) if writing.compression else None
        )
        self.overwrite = writing.overwrite
        self.require_conditional_writes = writing.require_conditional_writes
        # Coordinator: whether the commit may rely on If-None-Match (see prepare_global_plan).
        self._conditional_commit = True
        self.key_prefixes = writing.key_prefixes
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.is_coordinator = False
        self._meter = Meter()
        #: After a save: this save's request figures (``dcp_s3._dcp.request_report``) by rank —
        #: every rank's on the coordinator, its own on the others.
        self.request_stats: dict[int, RankFigures] = {}
        self._counts: list[JobCount] = []  # the coordinator's: where this save's ranks count themselves finished

    def __repr__(self) -> str:
        return f"S3StorageWriter({str(self._session.location)!r}, overwrite={self.overwrite})"

    # docstring inherited
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reset_location(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def close(self) -> None:
        """Release the pinned host buffers kept for CUDA tensors (a later save makes new ones)."""
        self._stagings.close()
        BlockingAsyncStager.close(self)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id, modules=[FORMAT_TAG])

    # The parameter must be literally named ``kwargs`` for DCP to pass rank/use_collectives.
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self._meter.start()
        self.request_stats = {}
        if kwargs.get("use_collectives") is False:
            raise ConfigError("S3StorageWriter needs use_collectives=True: the coordinator commits one .metadata")
        self._session.require_location()
        self._session.plan_requests(self.key_prefixes)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator only: check bucket and overwrite rule once, name each rank's objects (``rank_prefix``).

        Nothing is deleted here: the checkpoint at the path stays loadable until ``finish``.
        """
        object_store = self._session.object_store
        object_store.check_container()
        if not self.overwrite:
            if object_store.head(self._session.key(METADATA_KEY)) is not None:
                raise exists_error(self.checkpoint_id, "pass overwrite=True to replace it or choose a new path")
            self._conditional_commit = object_store.conditional_writes_supported(
                self._session.key(PROBE_PREFIX + new_token())
            )
            if not self._conditional_commit:
                where = object_store.describe()
                if self.require_conditional_writes:
                    raise ServerCapabilityError(
                        f"overwrite=False for {self.checkpoint_id}: {where} ignores If-None-Match on PUT, so a "
                        "save racing to the same path could replace this one unnoticed; pass overwrite=True "
                        "(atomic replace), or require_conditional_writes=False to accept a best-effort check"
                    )
                warnings.warn(
                    f"{where} ignores If-None-Match: overwrite=False for {self.checkpoint_id} is checked "
                    "with a HEAD before the commit only (best effort; a racing save can be replaced)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        counts = self._counts = job_counts(len(plans), self.key_prefixes)  # the ranks still sending
        return [
            dataclasses.replace(plan, storage_data=_RankStorage(rank_prefix(i, self.key_prefixes), counts[i]))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stream this rank's items into ``files_per_rank`` objects; no object for an empty plan.

        The results are a ``PackedResults`` (a read-only sequence of ``WriteResult``): gathered
        to the coordinator as arrays, not one pickled object per item; wrapped in a ``RankResults``
        with this rank's request figures, which ``finish`` takes out (they are never stored)."""
        fut: Future[list[WriteResult]] = Future()
        try:
            with following_job(self._session.object_store, getattr(plan.storage_data, "count", None)):
                results = self._write_all(plan, planner)
        except Exception as exc:  # delivered through the future, as DCP expects
            self._note_own_stats()
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the result
            return fut
        own = self._note_own_stats()
        fut.set_result(RankResults(results, self.rank, own))  # type: ignore[arg-type]  # a Sequence
        return fut

    def _note_own_stats(self) -> RankFigures:
        own = self._meter.since_start()
        me = own_rank(self.rank)
        self.request_stats = {me: own}
        log.debug("%s", summary(f"save of {self.checkpoint_id}, rank {me}", self.request_stats))
        return own

    def _write_all(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        if not plan.items:
            return []
        prefix: _RankStorage = plan.storage_data
        token = new_token()  # fresh for every write: even a reused writer never names an object twice
        transfer = self._session.transfer
        buckets = [b for b in split_items(plan.items, transfer.files_per_rank) if b]
        object_store, executor = self._session.object_store, self._session.executor
        pool = BufferPool(transfer.max_concurrency + len(buckets), transfer.part_size, transfer.max_direct_part_size)
        failed = threading.Event()
        self._stagings.begin()  # on the caller's thread: the stream CUDA tensors come from

        def write_object(n: int, items: list[WriteItem]) -> list[WriteResult]:
            name = data_object_name(prefix.prefix, n, token)
            writer = object_store.open_writer(
                self._session.key(name), pool=pool, executor=executor, expected_size=planned_size(items)
            )
            try:
                results = [
                    write_item(writer, name, item, planner, failed, self._codec, self._stagings) for item in items
                ]
                writer.close()
            except BaseException:
                failed.set()
                writer.abort()
                raise
            return results

        # Serializer threads are separate from the I/O pool so they never wait on their own parts.
        try:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="dcp_s3-serialize") as serializers:
                futures = [serializers.submit(write_object, n, items) for n, items in enumerate(buckets)]
                try:
                    wait_all(futures)
                except BaseException:
                    # This save will not be committed: remove what this rank already completed.
                    done = {r.storage_data.relative_path for f in futures if not f.exception() for r in f.result()}
                    delete_quietly(self._session, self.checkpoint_id, sorted(done), "objects of a failed save")
                    raise
        finally:
            pool.clear()
            if self._codec is not None:
                self._codec.close()
        results = [r for f in futures for r in f.result()]
        log.debug("rank %s wrote %d items in %d objects", self.rank, len(results), len(buckets))
        return PackedResults.pack(results)  # type: ignore[return-value]  # a Sequence, as torch uses it

    def finish(self, metadata: Metadata, results: Sequence[Sequence[WriteResult]]) -> None:
        """Coordinator only: PUT ``.metadata`` — the commit point — then delete what it replaced.

        ``metadata`` becomes the committed metadata (torch broadcasts it to every rank and
        ``dcp.save`` returns it): for the compact format, a lazy view of the bytes committed,
        which pickles as those bytes rather than as one object per item. Each rank's request figures
        (``RankResults``) are taken out of ``results`` first and kept in ``request_stats``.
        """
        results, gathered = split_results(results)
        try:
            self._finish(metadata, results)
        finally:
            forget_counts(self._counts)
            gathered[own_rank(self.rank)] = self._meter.since_start()  # with the commit's own requests
            self.request_stats = dict(sorted(gathered.items()))
            log.info("%s", summary(f"save of {self.checkpoint_id}", self.request_stats))

    def _finish(self, metadata: Metadata, results: Sequence[Sequence[WriteResult]]) -> None:
        metadata.storage_meta = self.storage_meta()
        metadata.version = "1.0.0"
        object_store = self._session.object_store
        key = self._session.key(METADATA_KEY)
        body = self._compact_body(metadata, results, object_store.url(key))
        if body is None:
            metadata.storage_data = {wr.index: wr.storage_data for per_rank in results for wr in per_rank}
            body = dump_metadata(metadata, "dcp")
        ours = referenced_objects(metadata)
        if self.overwrite:
            commit_replacing(self._session, self.checkpoint_id, body, ours)
        else:
            commit_once(self._session, self.checkpoint_id, body, ours, self._conditional_commit)
        log.info("committed checkpoint %s (%d items)", self.checkpoint_id, len(metadata.storage_data))

    def _compact_body(self, metadata: Metadata, results: Sequence[Sequence[WriteResult]], where: str) -> bytes | None:
        """Compact ``.metadata`` bytes encoded straight from the gathered results (and ``metadata``
        turned into their lazy view), or None where the stock pickle is to be written."""
        if not compact_wanted(metadata, self.metadata_format):
            return None
        try:
            body = dump_compact(metadata, results)
        except ConfigError:
            if self.metadata_format == "compact":
                raise
            return None
        view = load_metadata(body, where)
        metadata.state_dict_metadata, metadata.storage_data = view.state_dict_metadata, view.storage_data
        return body
