"""How one ``ReadItem`` of a load plan becomes ranged reads of its object, and what runs once they are in.

Only the bytes the plan needs are read: the rows of the stored chunk that the item covers (the codec's
frames around them for a compressed item), straight into the destination tensor when its layout allows,
otherwise into bounded staging that is copied (and cast) into it; items other writers wrote are fetched
whole and loaded as torch would. Every byte that reaches a tensor is checked, before the planner sees it,
against a stored checksum covering exactly the bytes hashed: a raw item's blocks, the read widened to whole
blocks (:mod:`dcp_s3._dcp.block_checks`), or a compressed item's frames, each decoded whole; byte items
are checked whole before anything unpickles them (:mod:`dcp_s3._untrusted.byte_items`). The reader
(:mod:`dcp_s3._dcp.reader`) makes one :class:`ItemReads` per read, with the load's metadata, and runs
the reads it gathers.
"""

from __future__ import annotations

import io
import itertools
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from crc32c import crc32c
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_s3._codec import DEFAULT_FRAME_SIZE, Codec, FrameIndex, accepts, stored_span, supported
from dcp_s3._dcp.block_checks import BlockLedger, ledger_for
from dcp_s3._dcp.session import Session
from dcp_s3._dcp.staging import Stagings
from dcp_s3._dcp.tensor_bytes import StagedRows, raw_bytes_view
from dcp_s3._layout import checksum_error
from dcp_s3._metadata.compact_chunks import ChunkLookup
from dcp_s3._objstore.base import RangeRead
from dcp_s3._torch_compat import element_size, narrow_tensor_by_index
from dcp_s3._untrusted.byte_items import check_byte_item
from dcp_s3._untrusted.foreign_items import decode_byte_item, load_tensor_archive
from dcp_s3.errors import CheckpointFormatError

__all__ = ["ItemReads"]


class ItemReads:
    """The reads of one load's items from ``checkpoint_id``: :meth:`plan_item` per ``ReadItem``, on the
    caller's thread, in plan order; the finishers it returns run there too, once all the reads are done."""

    def __init__(
        self,
        session: Session,
        checkpoint_id: str,
        storage_data: Mapping[MetadataIndex, Any],
        chunks: ChunkLookup | None,
        codec: Codec,
        stagings: Stagings,
        *,
        allow_unsafe_byte_items: bool,
    ) -> None:
        self._session = session
        self.checkpoint_id = checkpoint_id
        self.storage_data = storage_data
        self._chunks = chunks
        self._codec = codec
        self._stagings = stagings
        self._frame_buffers = _FrameBuffers()
        #: The pieces staged through a pinned pool: ``release_staged`` gives back what a failed read left held.
        self.staged: list[StagedRows] = []
        self.allow_unsafe_byte_items = allow_unsafe_byte_items

    def plan_item(self, req: ReadItem, planner: LoadPlanner, reads: list[RangeRead]) -> Callable[[], None]:
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
        ledger: BlockLedger | None = None
        if frames is None and (foreign or getattr(info, "payload_offset", None) is None):
            self._plan_torch_load(req, key, info, dest, reads, foreign)
        else:
            ledger = self._plan_tensor(req, key, info, dest, reads)

        def commit() -> None:
            if ledger is not None:  # every block the reads touched, checked before the planner sees it
                ledger.check()
            planner.commit_tensor(req, dest)

        return commit

    def release_staged(self) -> None:
        """Give back the pinned buffers of staged pieces whose read never reached ``done`` (a failed GET); call
        once every read has ended."""
        for piece in self.staged:
            piece.release()

    def _verify(self, req: ReadItem, info: Any, payload: memoryview, crc: int | None = None) -> None:
        """Check ``payload`` against the item's CRC32C (``crc``: its CRC32C, taken as its bytes arrived)."""
        error = checksum_error(info, payload, crc)
        if error is not None:
            where = self._session.url(info.relative_path)
            raise CheckpointFormatError(
                f"{req.storage_index.fqn}: {where} bytes {info.offset}-{info.offset + info.length}: {error}"
            )

    def _decode_checked(
        self,
        key: str,
        info: Any,
        frames: FrameIndex,
        stored: Any,
        s0: int,
        s1: int,
        lo: int,
        hi: int,
        out: memoryview,
    ) -> None:
        """Decode raw bytes ``[lo, hi)`` into ``out`` from ``stored`` (the item's stored bytes ``[s0, s1)``,
        whole frames) and check them: the frames they touch are decoded whole (into scratch where
        ``[lo, hi)`` covers only part of one), each checked against its CRC32C, before ``out`` is written."""
        first, last = lo // frames.frame_size, (hi - 1) // frames.frame_size
        f_lo, f_hi = frames.raw_range(first)[0], frames.raw_range(last)[1]
        if (f_lo, f_hi) == (lo, hi):
            self._decode(key, info, frames, stored, s0, s1, lo, hi, out)
            self._verify_frames(key, info, frames, lo, hi, out)
            return
        scratch = self._frame_buffers.take(f_hi - f_lo)
        try:
            whole = scratch.data[: f_hi - f_lo]
            self._decode(key, info, frames, stored, s0, s1, f_lo, f_hi, whole)
            self._verify_frames(key, info, frames, f_lo, f_hi, whole)
            out[:] = whole[lo - f_lo : hi - f_lo]
        finally:
            self._frame_buffers.give_back(scratch)

    def _verify_frames(self, key: str, info: Any, frames: FrameIndex, lo: int, hi: int, out: memoryview) -> None:
        """Check the CRC32C of every frame in raw bytes ``[lo, hi)`` (frame-aligned, now in ``out``)."""
        crcs = getattr(info, "frame_crc32c", None)
        if crcs is None:  # load_metadata refuses this; metadata built in-process could still lack them
            raise CheckpointFormatError(f"{self._session.object_store.url(key)}: compressed item without checksums")
        for i in range(lo // frames.frame_size, frames.num_frames):
            f_lo, f_hi = frames.raw_range(i)
            if f_lo >= hi:
                break
            if f_lo < lo or f_hi > hi:  # (callers decode whole frames: ``_decode_checked``)
                raise CheckpointFormatError(
                    f"{self._session.object_store.url(key)}: frame {i} of the item at bytes "
                    f"{info.offset}-{info.offset + info.length} was decoded in part and cannot be checked"
                )
            if crc32c(out[f_lo - lo : f_hi - lo]) != crcs[i]:
                s_lo, s_hi = frames.stored_range(i)
                raise CheckpointFormatError(
                    f"{self._session.object_store.url(key)}: frame {i} of the item at bytes {info.offset}-"
                    f"{info.offset + info.length} (the frame: bytes {info.offset + s_lo}-{info.offset + s_hi}) "
                    "fails its checksum: the stored object is corrupt"
                )

    def _plan_torch_load(
        self, req: ReadItem, key: str, info: Any, dest: torch.Tensor, reads: list[RangeRead], transforms: list[str]
    ) -> None:
        """Items written by other writers: fetch the whole ``torch.save`` blob, undo torch's ``transforms``
        (bounded by the chunk's size) and load it (see ``dcp_s3._untrusted.foreign_items``)."""
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

    def _plan_tensor(
        self, req: ReadItem, key: str, info: Any, dest: torch.Tensor, reads: list[RangeRead]
    ) -> BlockLedger | None:
        """Fetch the rows of the stored chunk that ``req`` covers, straight into ``dest`` if possible.

        Returns the ledger that checks a raw item's bytes once they are all in (``block_checks``; None for a
        compressed item, whose frames are checked as they are decoded, or where nothing can check them).
        """
        fqn = req.storage_index.fqn
        found = self._chunks.find(fqn, req.storage_index.offset or ()) if self._chunks is not None else None
        if found is None:
            raise CheckpointFormatError(f"{self.checkpoint_id}: no chunk metadata for {req.storage_index}")
        sizes, dtype = found
        if len(req.lengths) != len(sizes) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, sizes, strict=True)
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
            return None
        ledger = None
        if frames is None:
            nbytes, payload = rows_total * row_bytes, info.offset + info.payload_offset
            url = self._session.object_store.url
            ledger = ledger_for(
                info,
                nbytes,
                row0 * row_bytes,
                (row0 + rows) * row_bytes,
                lambda a, b: f"{fqn}: {url(key)} bytes {payload + a}-{payload + b}",  # (named only on errors)
            )
            if ledger is not None:
                reads.extend(ledger.edge_reads(key, payload))
        transfer = self._session.transfer
        max_bytes = transfer.max_range_size
        whole_rows = tuple(req.lengths[1:]) == tuple(sizes[1:])
        direct = whole_rows and dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
        if direct:
            view = raw_bytes_view(dest)
            start = row0 * row_bytes
            # Raw bytes go straight into ``dest``: no buffer to bound, so larger GETs (fewer, cheaper per byte).
            # A compressed item: one read per frame, each decoded into ``dest`` as soon as its stored bytes are in,
            # from a buffer reused frame after frame (``_FrameBuffers``): nothing held grows with the GET, so its
            # GETs are as large as raw ones, and each frame is decoded and checked while it is still in cache.
            step = max(max_bytes, transfer.max_direct_range_size) if frames is None else frames.frame_size
            cuts = [start, *range(start - start % step + step, start + len(view), step), start + len(view)]
            for lo, hi in itertools.pairwise(cuts):
                opener = _slice_opener(view, lo - start, hi - start)
                self._add_read(reads, key, info, lo, hi, opener, direct=True, ledger=ledger)
            return ledger
        # Staged: whole rows into a bounded CPU buffer (pinned for a CUDA dest), then narrowed, cast and copied.
        staging = self._stagings.get(dest)
        rows_per_piece = max(1, max_bytes // max(1, row_bytes))
        for r in range(0, rows, rows_per_piece):
            n = min(rows_per_piece, rows - r)
            piece = StagedRows(dest, sizes, dtype, req, r, n, staging)
            if staging is not None:
                self.staged.append(piece)
            start = (row0 + r) * row_bytes
            self._add_read(reads, key, info, start, start + n * row_bytes, piece.open, piece.done, ledger=ledger)
        return ledger

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
        ledger: BlockLedger | None = None,
    ) -> None:
        """Deliver raw payload bytes ``[lo, hi)`` of an item into ``open_dest()``, then run ``done``
        (``direct``: ``open_dest`` gives the destination itself, no buffer: see ``RangeRead.direct``;
        for a compressed item, ``[lo, hi)`` then lies in one frame; ``ledger``: a raw item's, which hashes
        the bytes as they arrive, before ``done`` sees them)."""
        frames: FrameIndex | None = getattr(info, "frames", None)
        if frames is None:
            start = info.offset + info.payload_offset
            if ledger is None:
                reads.append(RangeRead(key, start + lo, start + hi, open_dest, done, direct=direct))
                return
            hasher = ledger.hasher(lo, hi)
            opened: list[memoryview] = []

            def open_hashed() -> memoryview:
                opened.append(open_dest())
                return opened[-1]

            def hashed() -> None:
                hasher.finish(opened.pop() if opened else None)
                if done is not None:
                    done()

            reads.append(RangeRead(key, start + lo, start + hi, open_hashed, hashed, direct=direct, received=hasher))
            return
        s0, s1 = stored_span(frames, lo, hi)
        if direct:
            self._add_frame_read(reads, key, info, frames, lo, hi, s0, s1, open_dest)
            return
        held: dict[str, bytearray] = {}

        def open_stored() -> memoryview:  # compressed bytes live only while in flight
            held["buf"] = bytearray(s1 - s0)
            return memoryview(held["buf"])

        def decode() -> None:
            out = open_dest()
            self._decode_checked(key, info, frames, held.pop("buf"), s0, s1, lo, hi, out)
            if done is not None:
                done()

        reads.append(RangeRead(key, info.offset + s0, info.offset + s1, open_stored, decode))

    def _add_frame_read(
        self,
        reads: list[RangeRead],
        key: str,
        info: Any,
        frames: FrameIndex,
        lo: int,
        hi: int,
        s0: int,
        s1: int,
        open_dest: Callable[[], memoryview],
    ) -> None:
        """Raw bytes ``[lo, hi)`` of one frame of a compressed item (stored at ``[s0, s1)``) into ``open_dest()``.

        A raw frame read whole lands in the destination itself (its stored bytes are its raw bytes); any
        other frame's stored bytes go to one of the load's reused frame buffers, are decoded into the
        destination on the reading thread, and the buffer goes back. Either way the frame's CRC32C is
        checked once its raw bytes are in, as for ranges of several frames."""
        i = lo // frames.frame_size
        f_lo, f_hi = frames.raw_range(i)
        if s1 - s0 > f_hi - f_lo:  # every codec version stores a frame that does not shrink raw
            raise CheckpointFormatError(
                f"{self._session.object_store.url(key)}: frame {i} of the item at bytes {info.offset}-"
                f"{info.offset + info.length} claims {s1 - s0} stored bytes for {f_hi - f_lo} raw bytes"
            )
        start, end = info.offset + s0, info.offset + s1
        if frames.is_raw(i) and (lo, hi) == (f_lo, f_hi):

            def check() -> None:
                self._verify_frames(key, info, frames, lo, hi, open_dest())

            reads.append(RangeRead(key, start, end, open_dest, check, direct=True))
            return
        held: list[np.ndarray] = []

        def open_stored() -> memoryview:
            held.append(self._frame_buffers.take(s1 - s0))
            return held[-1].data[: s1 - s0]

        def decode() -> None:
            out = open_dest()
            stored = held.pop()
            try:
                self._decode_checked(key, info, frames, stored[: s1 - s0], s0, s1, lo, hi, out)
            finally:
                self._frame_buffers.give_back(stored)

        reads.append(RangeRead(key, start, end, open_stored, decode, direct=True))

    def _decode(
        self, key: str, info: Any, frames: FrameIndex, stored: Any, s0: int, s1: int, lo: int, hi: int, out: memoryview
    ) -> None:
        """The codec's decode of raw bytes ``[lo, hi)`` of a compressed item from its stored bytes ``[s0, s1)``
        (``stored``), every call site's: the codec knows frames, not objects, so its ``CheckpointFormatError``
        (corrupt or misplaced bytes: a server answering a range with other bytes) is raised again naming the
        object and the byte range read, chained to the codec's."""
        try:
            self._codec.decode_into(frames, stored, s0, lo, hi, out)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(
                f"{self._session.object_store.url(key)}: bytes [{info.offset + s0}, {info.offset + s1}) (frames of "
                f"the item at [{info.offset}, {info.offset + info.length}), its raw bytes [{lo}, {hi})) do not decode: "
                f"{e}"
            ) from e


class _FrameBuffers:
    """The stored bytes of compressed frames while they are read and decoded: buffers taken by one frame's
    read and given back once it is decoded, then reused by the next frame. A thread reads one range at a
    time, so a load holds at most one buffer per reading thread, each the size of the largest stored frame
    it held (4 MiB by default, at most ``codec.MAX_FRAME_SIZE``); they are dropped with the load's
    :class:`ItemReads`. ``numpy.empty``: not zero-filled, and a reused buffer's pages are already mapped."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes."""
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or len(buf) < n:
            buf = np.empty(max(n, DEFAULT_FRAME_SIZE), np.uint8)
        return buf

    def give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)


def _slice_opener(view: memoryview, lo: int, hi: int) -> Callable[[], memoryview]:
    return lambda: view[lo:hi]
