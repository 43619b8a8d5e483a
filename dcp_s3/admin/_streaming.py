"""Copy a checkpoint from any DCP storage reader to any DCP storage writer, streaming: memory bounded by the chunk
size, never by the largest tensor or the checkpoint.

``dcp-s3 convert`` (:mod:`dcp_s3.admin._convert`) uses it for ``--format dcp``: from a DCP checkpoint (a compressed
one decompressed) or from a Hugging Face safetensors export (``S3HuggingFaceStorageReader``) to a new DCP
checkpoint. One ``dcp.save`` runs in this process with :class:`StreamingSavePlanner`, which plans the source's
entries from its metadata alone — each tensor split along its first dimension into chunks of at most
``chunk_bytes`` (a chunk of a tensor is what a rank of a sharded save writes: the new checkpoint's metadata lists
the chunks, and every reader reassembles them or reads only the ones it needs) — and reads each chunk from the
source only when the writer asks for its bytes (``resolve_data``), through the source reader's own ranged reads and
checks (CRC32C of every block read, the header checks of an export). The writer holds at most one chunk per data
object it writes at once (``files_per_rank``) besides its part buffers, so the copy's added memory is about
``files_per_rank × chunk_bytes`` plus the transfer buffers.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader

from dcp_s3._planners.save import global_save_plan
from dcp_s3.errors import ConfigError

__all__ = ["DEFAULT_CHUNK_BYTES", "StreamingSavePlanner", "chunk_rows"]

#: The largest chunk a copy reads and holds at once (per data object the writer writes at a time).
DEFAULT_CHUNK_BYTES = 32 << 20


def chunk_rows(md: TensorStorageMetadata, chunk_bytes: int) -> list[ChunkStorageMetadata]:
    """``md``'s tensor as chunks of whole rows (its first dimension) of at most ``chunk_bytes`` each (one row at
    least; a 0-d or empty tensor is one chunk)."""
    size = torch.Size(md.size)
    if len(size) == 0 or size.numel() == 0:
        return [ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)]
    row_bytes = math.prod(size[1:]) * torch.empty((), dtype=md.properties.dtype).element_size()
    rows = max(1, chunk_bytes // max(1, row_bytes))
    zeros = [0] * (len(size) - 1)
    return [
        ChunkStorageMetadata(
            offsets=torch.Size([start, *zeros]), sizes=torch.Size([min(rows, size[0] - start), *size[1:]])
        )
        for start in range(0, size[0], rows)
    ]


class _Into(LoadPlanner):
    """A load planner for one chunk or byte item read by hand: the reader copies into ``dest`` (a tensor of the
    chunk's shape) or hands the bytes over."""

    def __init__(self, dest: torch.Tensor | None) -> None:
        self.dest, self.data = dest, b""

    # The planning steps of a dcp.load: none here (the reads are planned by StreamingSavePlanner).
    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.data = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        assert self.dest is not None
        view = self.dest
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if tensor.data_ptr() != self.resolve_tensor(read_item).data_ptr():  # staged elsewhere: copy it in
            self.resolve_tensor(read_item).copy_(tensor)


@dataclass
class _Source:
    """A set-up source reader and its metadata; reads are made one at a time (the reader's own pool makes each
    read concurrent)."""

    reader: StorageReader
    metadata: Metadata
    lock: threading.Lock

    def read(self, plan: list[ReadItem], planner: _Into) -> None:
        with self.lock:
            local = self.reader.prepare_local_plan(LoadPlan(plan))
            (ready,) = self.reader.prepare_global_plan([local])
            self.reader.read_data(ready, planner).wait()


class StreamingSavePlanner(SavePlanner):
    """Save what ``reader`` holds, chunk by chunk as the writer asks (see the module's docstring). Give it to
    ``dcp.save({}, storage_writer=..., planner=StreamingSavePlanner(reader), no_dist=True)``: the state dict is
    ignored. ``tensors``/``nbytes`` count what was planned; ``progress(done, total)`` is called with the tensor bytes
    read so far after each chunk; ``tensors_only`` leaves the non-tensor entries out (:attr:`skipped`)."""

    def __init__(
        self,
        reader: StorageReader,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Callable[[int, int], None] | None = None,
        *,
        tensors_only: bool = False,
    ) -> None:
        if chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes={chunk_bytes}: expected a positive number of bytes")
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, True)
        self._source = _Source(reader, metadata, threading.Lock())
        self.chunk_bytes = chunk_bytes
        self._progress, self._done, self._done_lock = progress, 0, threading.Lock()
        entries = metadata.state_dict_metadata
        #: Non-tensor entries left out (``tensors_only``: a safetensors export holds tensors only).
        self.skipped = [k for k, md in entries.items() if isinstance(md, BytesStorageMetadata)] if tensors_only else []
        self.tensors = sum(isinstance(md, TensorStorageMetadata) for md in metadata.state_dict_metadata.values())
        self.nbytes = sum(
            math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()
            for md in metadata.state_dict_metadata.values()
            if isinstance(md, TensorStorageMetadata)
        )

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, md in self._source.metadata.state_dict_metadata.items():
            if fqn in self.skipped:
                continue
            if isinstance(md, BytesStorageMetadata):
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                continue
            chunks = chunk_rows(md, self.chunk_bytes)
            kind = WriteItemType.TENSOR if len(chunks) == 1 else WriteItemType.SHARD
            for chunk in chunks:
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, chunk.offsets),
                        type=kind,
                        tensor_data=TensorWriteData(chunk=chunk, properties=md.properties, size=torch.Size(md.size)),
                    )
                )
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = global_save_plan(all_plans)
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        md = self._source.metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            planner = _Into(None)
            zero = torch.Size((0,))  # what torch's planner puts in a byte item's read
            read = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), zero, MetadataIndex(fqn), zero, zero)
            self._source.read([read], planner)
            return io.BytesIO(planner.data)
        assert write_item.tensor_data is not None
        chunk = write_item.tensor_data.chunk
        dest = torch.empty(chunk.sizes, dtype=md.properties.dtype)
        self._source.read(create_read_items_for_chunk_list(fqn, md, [chunk]), _Into(dest))
        if self._progress is not None:
            with self._done_lock:
                self._done += dest.numel() * dest.element_size()
                self._progress(self._done, self.nbytes)
        return dest
