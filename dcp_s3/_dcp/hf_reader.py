"""``S3HuggingFaceStorageReader``: ``dcp.load`` from a Hugging Face safetensors export in S3 or a local directory.

The export is ``model.safetensors.index.json`` and the shards its ``weight_map`` names, or one
``model.safetensors`` (as ``save_pretrained`` and torch's ``HuggingFaceStorageWriter`` write them). The
index is the commit: a prefix with shards but neither file is refused as an incomplete export, and
shards are never found by listing.

Metadata (once per load, on the coordinator, shared as ``S3StorageReader`` shares ``.metadata``): the
index (at most ``MAX_INDEX_BYTES``), then a HEAD of every shard and a ranged GET of its header (at most
``MAX_HEADER_BYTES``), checked by :mod:`dcp_s3._dcp.safetensors_header`. Each tensor becomes one
whole-tensor chunk at offset 0 (as torch's ``HuggingFaceStorageReader`` maps it), so torch's
``DefaultLoadPlanner`` plans the load, and its storage entry is an ``ItemLocation`` whose payload is the
tensor's raw bytes: the data reads are then ``S3StorageReader``'s own (``item_reads``) — only the rows a
rank's plan covers, straight into the destination when its dtype and layout allow, staged and cast
otherwise, coalesced and concurrent, with the same client, retries, deadlines and rate control.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._dcp.safetensors_header import (
    MAX_INDEX_BYTES,
    MAX_TOTAL_HEADER_BYTES,
    PREFIX_BYTES,
    TensorEntry,
    check_export_id,
    check_whole_tensors,
    header_length,
    index_export_id,
    parse_header,
    parse_index,
)
from dcp_s3._layout import ItemLocation
from dcp_s3._objstore.base import RangeRead
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = ["S3HuggingFaceStorageReader", "INDEX_NAME", "SINGLE_NAME", "TORCH_DTYPES"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Bytes read with the length prefix in the first GET of a shard: a header up to this size takes one GET, a
#: longer one a second for the rest. Past a short header these are tensor bytes read for nothing (by the
#: coordinator alone, once per shard): small, next to a shard of hundreds of MiB.
FIRST_READ = 16 << 10
#: The safetensors dtype names, as torch types.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}


class S3HuggingFaceStorageReader(S3StorageReader):
    """Load a Hugging Face safetensors export from ``s3://bucket/prefix`` (or a local directory) with
    ``dcp.load(state_dict, storage_reader=S3HuggingFaceStorageReader(path, ...))``.

    Takes every argument of :class:`~dcp_s3.S3StorageReader` (location, credentials, ``client=``,
    ``transfer=``, ``share_metadata``, ``replica_group``...), with the same meaning. The state dict's
    keys are the export's tensor names; a destination of another dtype gets the stored values cast
    (bf16 stored, fp32 loaded). Raises ``CheckpointNotFoundError`` for a prefix without
    ``model.safetensors.index.json`` or ``model.safetensors`` (shards alone are an incomplete export)
    and ``CheckpointFormatError`` naming the object for a malformed index or header.
    """

    _metadata_name = INDEX_NAME

    def __repr__(self) -> str:
        return f"S3HuggingFaceStorageReader({str(self._session.location)!r})"

    @property
    def _coalesce_gap(self) -> int:
        # The gaps between a rank's reads of an export are other ranks' rows of the same tensors (in dcp_s3's
        # own layout a rank's items lie together): reading across them would cost up to the world size in
        # bytes. Reads that touch still merge into one request.
        return 0

    def _get_metadata(self) -> bytes:
        """Read and check the index and every shard's header; the tensors as JSON (decoded on every rank)."""
        files, weight_map, export_id = self._files()
        store = self._session.object_store
        infos = list(self._session.executor.map(store.head, [self._session.key(f) for f in files]))
        for name, info in zip(files, infos, strict=True):
            if info is None:
                raise CheckpointNotFoundError(
                    f"{self._session.url(name)} is missing: {self._index_url()} names it (an incomplete export)"
                )
        headers = self._read_headers(files, [info.size for info in infos if info is not None])
        seen: dict[str, str] = {}
        rows: list[list[Any]] = []
        for name, info, raw in zip(files, infos, headers, strict=True):
            where = self._session.url(name)
            entries, extra = parse_header(raw, info.size if info is not None else 0, where)
            check_whole_tensors(extra, where)
            check_export_id(extra, export_id, where, self._index_url())
            rows.extend(self._check_entries(name, entries, weight_map, seen, where))
        if weight_map is not None:
            for tensor, file in weight_map.items():
                if seen.get(tensor) != file:
                    raise CheckpointFormatError(
                        f"{self._index_url()}: maps {tensor!r} to {file}, whose header has no such tensor"
                    )
        return json.dumps({"files": files, "tensors": rows}).encode()

    def _check_entries(
        self,
        name: str,
        entries: list[TensorEntry],
        weight_map: dict[str, str] | None,
        seen: dict[str, str],
        where: str,
    ) -> list[list[Any]]:
        rows = []
        for e in entries:
            if e.name in seen:
                raise CheckpointFormatError(f"{where}: tensor {e.name!r} is also in {seen[e.name]}")
            if weight_map is not None and weight_map.get(e.name, name) != name:
                raise CheckpointFormatError(
                    f"{where}: holds {e.name!r}, which {self._index_url()} maps to {weight_map[e.name]}"
                )
            seen[e.name] = name
            rows.append([e.name, name, e.dtype, list(e.shape), e.begin, e.end])
        return rows

    def _index_url(self) -> str:
        return self._session.url(INDEX_NAME)

    def _files(self) -> tuple[list[str], dict[str, str] | None, str | None]:
        """The shard names, the index's weight_map (None for a single ``model.safetensors``) and the export id it
        records (dcp_s3's exports: every shard must hold the same)."""
        store = self._session.object_store
        info = store.head(self._session.key(INDEX_NAME))
        if info is not None:
            if info.size > MAX_INDEX_BYTES:
                raise CheckpointFormatError(
                    f"{self._index_url()}: {info.size} bytes; an index of at most {MAX_INDEX_BYTES} is accepted"
                )
            (raw,) = self._read([(INDEX_NAME, 0, info.size)])
            weight_map = parse_index(raw, self._index_url())
            return sorted(set(weight_map.values())), weight_map, index_export_id(raw, self._index_url())
        if store.head(self._session.key(SINGLE_NAME)) is not None:
            return [SINGLE_NAME], None, None
        raise CheckpointNotFoundError(
            f"no Hugging Face export at {self.checkpoint_id}: neither {INDEX_NAME} nor {SINGLE_NAME} is there "
            "(shards without an index are an incomplete export, never loaded)"
        )

    def _read_headers(self, files: list[str], sizes: list[int]) -> list[bytearray]:
        """Each shard's header bytes (after the length prefix): one ranged GET each, two for long headers."""
        firsts = self._read(
            [(f, 0, min(size, PREFIX_BYTES + FIRST_READ)) for f, size in zip(files, sizes, strict=True)]
        )
        lengths = [
            header_length(b, size, self._session.url(f)) for f, b, size in zip(files, firsts, sizes, strict=True)
        ]
        if sum(lengths) > MAX_TOTAL_HEADER_BYTES:
            raise CheckpointFormatError(
                f"{self._index_url()}: its shards' headers take {sum(lengths)} bytes together; at most "
                f"{MAX_TOTAL_HEADER_BYTES} are accepted"
            )
        rest = [
            (f, len(b), PREFIX_BYTES + n)
            for f, b, n in zip(files, firsts, lengths, strict=True)
            if PREFIX_BYTES + n > len(b)
        ]
        more = iter(self._read(rest))
        out = []
        for b, n in zip(firsts, lengths, strict=True):
            if PREFIX_BYTES + n > len(b):
                b = b + next(more)
            out.append(b[PREFIX_BYTES : PREFIX_BYTES + n])
        return out

    def _read(self, spans: list[tuple[str, int, int]]) -> list[bytearray]:
        """Bytes ``[lo, hi)`` of each named object, read concurrently through the object store."""
        bufs = [bytearray(hi - lo) for _, lo, hi in spans]
        reads = [
            RangeRead(self._session.key(name), lo, hi, _opener(buf))
            for (name, lo, hi), buf in zip(spans, bufs, strict=True)
            if hi > lo
        ]
        transfer = self._session.transfer
        self._session.object_store.read_ranges(
            reads,
            executor=self._session.executor,
            max_gap=transfer.coalesce_gap,
            max_size=transfer.max_range_size,
        )
        return bufs

    def _decode_metadata(self, data: bytes) -> Metadata:
        """DCP metadata of the tensors ``_get_metadata`` found: one whole-tensor chunk each."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for name, file, dtype, shape, begin, end in json.loads(data)["tensors"]:
            size = torch.Size(shape)
            zeros = torch.Size([0] * len(shape))
            state[name] = TensorStorageMetadata(
                TensorProperties(dtype=TORCH_DTYPES[dtype]), size, [ChunkStorageMetadata(offsets=zeros, sizes=size)]
            )
            storage[MetadataIndex(name, zeros)] = ItemLocation(
                relative_path=file, offset=begin, length=end - begin, payload_offset=0
            )
        return Metadata(state_dict_metadata=state, storage_data=storage)


def _opener(buf: bytearray) -> Callable[[], memoryview]:
    return lambda: memoryview(buf)
