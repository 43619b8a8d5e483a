"""How one rank's items are streamed into its data objects: balanced over objects by size, each
item a ``torch.save`` file (or the codec's frames of its raw bytes) with its CRC32C.

An item's CRC32C comes from the writer (``ObjectWriter.write_checked``), which hashes the bytes once for
the item and for the upload's own per-part checksums, and is combined across the item's chunks
(:func:`dcp_s3._objstore.checksums.crc32c_combine`)."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Iterator

import torch
from crc32c import crc32c
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_s3._codec import Codec, grouping_for_dtype
from dcp_s3._dcp.staging import Stagings
from dcp_s3._dcp.tensor_bytes import compact, payload_chunks, streamable, tensor_blob
from dcp_s3._layout import BLOCK_SIZE, ItemLocation
from dcp_s3._objstore.base import ObjectWriter
from dcp_s3._objstore.checksums import crc32c_combine
from dcp_s3._torch_compat import element_size
from dcp_s3.errors import CheckpointFormatError, DcpS3Error

__all__ = ["planned_size", "split_items", "write_item"]


def item_size(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * element_size(item.tensor_data.properties.dtype)


def planned_size(items: list[WriteItem]) -> int:
    # Tensor bytes plus headroom for torch.save headers; byte items have no planned size.
    return sum(item_size(i) + 4096 for i in items)


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Balance items over ``bins`` objects by size (largest first into the emptiest)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for item in sorted(items, key=item_size, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += item_size(item) or 1
    return buckets


def write_item(
    writer: ObjectWriter,
    name: str,
    item: WriteItem,
    planner: SavePlanner,
    failed: threading.Event,
    codec: Codec | None,
    stagings: Stagings | None = None,
) -> WriteResult:
    if failed.is_set():
        raise DcpS3Error(f"not writing {item.index.fqn}: another object of this save failed")
    offset = writer.tell()
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise CheckpointFormatError(
                f"{item.index.fqn}: byte item resolved to {type(data).__name__}, expected BytesIO"
            )
        checksum = writer.write_checked(data.getbuffer())
        location = ItemLocation(name, offset, writer.tell() - offset, crc32c=checksum)
    else:
        if not isinstance(data, torch.Tensor):
            raise CheckpointFormatError(f"{item.index.fqn}: tensor item resolved to {type(data).__name__}")
        if not streamable(data):
            raise CheckpointFormatError(f"{item.index.fqn}: cannot save a {data.layout} tensor on {data.device}")
        location = _write_tensor(writer, name, data, codec, stagings)
    return WriteResult(index=item.index, size_in_bytes=location.length, storage_data=location)


def _write_tensor(
    writer: ObjectWriter, name: str, tensor: torch.Tensor, codec: Codec | None, stagings: Stagings | None = None
) -> ItemLocation:
    """Stream one tensor: a ``torch.save`` file, or the codec's frames of its raw bytes.

    A CUDA tensor of an uncompressed save goes through ``stagings``' pinned buffers: ``writer.write``
    copies each chunk into the part buffers before the next is asked for, so a buffer is free again then.
    Compressed saves keep fresh host copies (the codec holds chunks until their frames are encoded)."""
    offset = writer.tell()
    if codec is None:
        blob = tensor_blob(tensor)
        writer.write(blob.header)
        # The caller's own CPU memory stays as it is until the save returns: sent from there, not copied
        # (host copies of device tensors and compacted copies go through the part buffers, bounded).
        staging = stagings.get(blob.tensor) if stagings is not None else None
        # Pinned chunks are reused: copied by the writer, never borrowed.
        stable = blob.borrowed and staging is None
        blocks = _PayloadBlocks(BLOCK_SIZE)
        for chunk in blob.payload_chunks(staging):
            blocks.write(writer, chunk, stable)
        writer.write(blob.trailer)
        checksum, block_crcs = blocks.finish()
        return ItemLocation(
            name,
            offset,
            writer.tell() - offset,
            payload_offset=blob.payload_offset,
            crc32c=checksum,
            block_size=BLOCK_SIZE,
            block_crc32c=block_crcs,
        )
    # Compressed: one CRC per frame covers every byte, and lets partial reads be checked too.
    tensor = compact(tensor)
    element_size, floating = grouping_for_dtype(tensor.dtype)
    block_crcs = _BlockChecksums(codec.frame_size_for(element_size))
    # Chunks are fresh views or host copies, never reused: no need to drain frames between them.
    frames = codec.encode(
        block_crcs.feed(payload_chunks(tensor)), element_size, floating, writer.write, stable_chunks=True
    )
    return ItemLocation(
        name,
        offset,
        writer.tell() - offset,
        transform_descriptors=[f"{frames.codec}/{frames.version}"],  # what codec.accepts checks
        frames=frames,
        frame_crc32c=block_crcs.finish(),
    )


class _PayloadBlocks:
    """The CRC32C of each ``block``-byte block of a raw payload written in chunks of any size, and of the
    whole payload, from the one pass that hashes the bytes for the upload: each chunk is written in pieces
    that end at block boundaries (``ObjectWriter.write_checked`` returns each piece's CRC32C), the pieces'
    CRCs combine into their block's, and the blocks' into the payload's (``crc32c_combine``)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.crcs: list[int] = []
        self._crc = 0  # of the block being filled
        self._filled = 0
        self._total = 0  # CRC32C of the payload before that block

    def write(self, writer: ObjectWriter, chunk: memoryview, stable: bool) -> None:
        view = memoryview(chunk).cast("B")
        while view:
            n = min(len(view), self.block - self._filled)
            crc = writer.write_checked(view[:n], stable=stable)
            self._crc = crc if self._filled == 0 else crc32c_combine(self._crc, crc, n)
            self._filled += n
            view = view[n:]
            if self._filled == self.block:
                self._end_block()

    def _end_block(self) -> None:
        self.crcs.append(self._crc)
        self._total = crc32c_combine(self._total, self._crc, self._filled)
        self._crc, self._filled = 0, 0

    def finish(self) -> tuple[int, tuple[int, ...] | None]:
        """The payload's CRC32C, and its blocks' (None if it is one block: then that is the payload's)."""
        if self._filled:
            self._end_block()
        return self._total, tuple(self.crcs) if len(self.crcs) > 1 else None


class _BlockChecksums:
    """CRC32C of each ``block``-byte slice of a stream that arrives in chunks of any size."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.crcs: list[int] = []
        self._crc = 0
        self._filled = 0

    def feed(self, chunks: Iterable[memoryview]) -> Iterator[memoryview]:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:
                n = min(len(view), self.block - self._filled)
                self._crc = crc32c(view[:n], self._crc)
                self._filled += n
                view = view[n:]
                if self._filled == self.block:
                    self.crcs.append(self._crc)
                    self._crc, self._filled = 0, 0
            yield chunk

    def finish(self) -> tuple[int, ...]:
        if self._filled:
            self.crcs.append(self._crc)
        return tuple(self.crcs)
