"""Reading the compact ``.metadata`` format (see ``dcp_s3._metadata.compact``) from untrusted bytes.

``load_compact`` returns a real ``Metadata`` whose big parts are lazy views of the bytes:
each tensor's ``chunks`` is a ``Sequence`` (``RuleChunks`` computes chunk ``i`` from the
rule, ``ExplicitChunks`` reads it from the arrays) and ``storage_data`` a ``Mapping``
(``CompactStorage``) that builds and validates an entry when it is looked up. Decoding
costs O(header + tensors with explicit chunks); a rank then pays per item it uses.

Every check of ``dcp_s3._untrusted.metadata_check`` applies, when a value is built (storage entries through
``dcp_s3._untrusted.metadata_check.check_location``); the header is bounded, every array must lie inside the
bytes with the count and type the header gives, every index must point into its table.
Any violation is a ``CheckpointFormatError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3._metadata.compact import DTYPES, FORMAT_VERSION, LAYOUTS, MAGIC, MEMORY_FORMATS
from dcp_s3._metadata.compact_chunks import ExplicitChunks, RuleChunks
from dcp_s3._metadata.compact_storage import ArraysReader, CompactStorage, _bad, _Entry, _get, _int, untag
from dcp_s3._torch_compat import element_size
from dcp_s3._untrusted.metadata_check import MAX_OFFSET, tiling_problem
from dcp_s3._untrusted.metadata_pickle import MAX_NDIM, describe

__all__ = ["load_compact", "materialize"]

#: Largest JSON header accepted.
MAX_HEADER = 64 << 20
#: Chunks + storage entries a compact file may describe per byte of it (plus a floor): rules and
#: constant columns describe many in few bytes; this bounds what iterating them all can cost.
#: (16,384-rank FSDP Llama-70B: ~0.5 per byte.)
EXPANSION_PER_BYTE = 64
EXPANSION_FLOOR = 1 << 20


#: Fields of this torch's ``TensorProperties`` (2.15 adds ``strides``).
_PROPERTY_FIELDS = {field.name for field in dataclasses.fields(TensorProperties)}


def _properties(e: dict[str, Any], ndim: int, where: str) -> TensorProperties:
    dtype = DTYPES.get(_get(e, "dtype", str, where))
    layout = LAYOUTS.get(_get(e, "layout", str, where))
    memory_format = MEMORY_FORMATS.get(_get(e, "memory_format", str, where))
    if dtype is None or layout is None or memory_format is None:
        raise _bad(f"{where}: unknown dtype, layout or memory format")
    extra: dict[str, Any] = {}
    if "strides" in e:  # written by a torch that records strides; a torch without the field ignores them
        strides = _get(e, "strides", list, where)
        if len(strides) != ndim:
            raise _bad(f"{where}: {len(strides)} strides for {ndim} dimensions")
        values = tuple(_int(x, f"{where}: stride") for x in strides)
        if "strides" in _PROPERTY_FIELDS:
            extra["strides"] = values
    return TensorProperties(
        dtype=dtype,
        layout=layout,
        requires_grad=_get(e, "requires_grad", bool, where),
        memory_format=memory_format,
        pin_memory=_get(e, "pin_memory", bool, where),
        **extra,
    )


def _chunks(
    e: dict[str, Any], size: torch.Size, elem: int, explicit: list[np.ndarray], pos: list[int], where: str
) -> Sequence[ChunkStorageMetadata]:
    if "rule" in e:
        rule = _get(e, "rule", dict, where)
        dim = _int(_get(rule, "dim", int, where), f"{where}: rule dim", -1, len(size) - 1)
        n = _int(_get(rule, "n", int, where), f"{where}: rule n", 1, 1 << 40)
        if dim < 0 and (size or n != 1):
            raise _bad(f"{where}: a whole-tensor rule on a tensor of {len(size)} dimensions")
        chunks: Sequence[ChunkStorageMetadata] = RuleChunks(size, dim, n)
        if dim >= 0:
            first = math.prod(chunks[0].sizes) * elem
            if first > MAX_OFFSET:
                raise _bad(f"{where}: chunks of {list(chunks[0].sizes)} are too large")
        return chunks
    n = _int(_get(e, "chunks", int, where), f"{where}: chunk count", 0, 1 << 40)
    ndim = len(size)
    lo, hi = pos[0], pos[0] + n * ndim
    if hi > len(explicit[0]):
        raise _bad(f"{where}: {n} chunks run past the chunk arrays")
    pos[0] = hi
    offsets = explicit[0][lo:hi].astype(np.int64).reshape(n, ndim) if ndim else np.zeros((n, 0), np.int64)
    sizes = explicit[1][lo:hi].astype(np.int64).reshape(n, ndim) if ndim else np.zeros((n, 0), np.int64)
    if ndim:
        dims = np.asarray(size, dtype=np.int64)
        if (offsets < 0).any() or (sizes < 0).any() or (offsets > dims).any() or (sizes > dims - offsets).any():
            raise _bad(f"{where}: a chunk lies outside the tensor's {list(size)}")
        if float(np.prod(sizes.astype(np.float64), axis=1).max(initial=0.0)) * elem >= float(MAX_OFFSET):
            raise _bad(f"{where}: a chunk is too large")
    problem = tiling_problem(size, offsets, sizes)
    if problem is not None:
        raise _bad(f"{where}: {problem} (a reader would return bytes it never read)")
    return ExplicitChunks(size, offsets, sizes)


def load_compact(data: bytes, where: str) -> Metadata:
    """Decode a compact ``.metadata``; ``CheckpointFormatError`` for anything malformed.

    Errors found while decoding are raised without ``where`` (``dcp_s3._metadata.formats.load_metadata`` adds it);
    those found later, when a storage entry is built, name ``where`` themselves.
    """
    data = data if type(data) is bytes else bytes(data)
    header, arrays = _header(data)
    entries = _Entries(arrays, header)
    for i, e in enumerate(_get(header, "entries", list, "header")):
        entries.add(e, i)
    entries.check_all_used()
    described = entries.start_pos + sum(len(e.chunks) for e in entries.entries if e.chunks is not None)
    if described > EXPANSION_FLOOR + EXPANSION_PER_BYTE * len(data):
        raise _bad(f"{described} chunks and storage entries from {len(data)} bytes: refusing to expand that far")
    storage = None
    if "storage" in header:
        storage = CompactStorage(
            data, entries.entries, _get(header, "storage", dict, "header"), arrays, where, storage_of
        )
    elif entries.start_pos:
        raise _bad("entries are stored but the storage section is missing")
    storage_meta = _storage_meta(header.get("storage_meta"))
    version = header.get("metadata_version")
    if version is not None and type(version) is not str:
        raise _bad(f"metadata version is {describe(version)}")
    metadata = Metadata(
        state_dict_metadata=entries.state,
        planner_data=untag(header.get("planner_data")),
        storage_data=storage,
        storage_meta=storage_meta,
    )
    metadata.version = version
    return metadata


def _header(data: bytes) -> tuple[dict[str, Any], ArraysReader]:
    """The JSON header of a compact ``.metadata`` (its magic, length, format and version checked), and its arrays."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise _bad("bad magic or truncated header")
    (head_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if head_len > MAX_HEADER or start + head_len > len(data):
        raise _bad(f"header of {head_len} bytes does not fit in {len(data)} bytes (at most {MAX_HEADER})")
    try:
        header = json.loads(data[start : start + head_len].decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise _bad(f"header is not JSON ({type(exc).__name__})") from None
    if type(header) is not dict or header.get("format") != "dcp_s3.compact":
        raise _bad("header does not describe dcp_s3 compact metadata")
    if header.get("version") != FORMAT_VERSION:
        raise _bad(f"format version {describe(header.get('version'))}: this dcp_s3 reads version {FORMAT_VERSION}")
    return header, ArraysReader(data, start + head_len + (-head_len % 8), header.get("arrays"))


class _Entries:
    """The header's entries, read in order: each one's metadata (``state``) and its span of storage entries
    (``entries``), taking its chunks and stored chunk numbers from the shared arrays as it goes."""

    def __init__(self, arrays: ArraysReader, header: dict[str, Any]) -> None:
        self.explicit = [arrays.get(header.get("chunk_offsets")), arrays.get(header.get("chunk_sizes"))]
        if len(self.explicit[0]) != len(self.explicit[1]):
            raise _bad("chunk offset and size arrays differ in length")
        self.stored_all = arrays.get(header.get("stored_chunks"))
        self.pos, self.stored_pos, self.start_pos = [0], 0, 0
        self.state: dict[str, Any] = {}
        self.entries: list[_Entry] = []

    def add(self, e: Any, i: int) -> None:
        fqn = _get(e, "fqn", str, f"entry {i}")
        what = f"tensor {fqn[:200]}"
        if fqn in self.state:
            raise _bad(f"{what} appears twice")
        if "bytes" in e:
            self.state[fqn] = BytesStorageMetadata()
            count = _int(_get(e, "bytes", int, what), f"{what}: stored count", 0, 1)
            self.entries.append(_Entry(fqn, self.start_pos, count, None, None, 0))
        else:
            count = self._tensor(e, fqn, what)
        self.start_pos += count

    def _tensor(self, e: Any, fqn: str, what: str) -> int:
        """Read a tensor's entry; returns how many of its chunks are stored."""
        size_list = _get(e, "size", list, what)
        if len(size_list) > MAX_NDIM:
            raise _bad(f"{what}: {len(size_list)} dimensions")
        size = torch.Size([_int(d, f"{what}: size") for d in size_list])
        props = _properties(e, len(size), what)
        try:
            elem = element_size(props.dtype)
        except TypeError:
            raise _bad(f"{what}: dtype {props.dtype} has no element size") from None
        chunks = _chunks(e, size, elem, self.explicit, self.pos, what)
        self.state[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=chunks)  # type: ignore[arg-type]
        stored_spec = _get(e, "stored", (str, int), what)
        stored = None
        if stored_spec == "all":
            count = len(chunks)
        else:
            count = _int(stored_spec, f"{what}: stored count", 0, len(chunks))
            stored = self.stored_all[self.stored_pos : self.stored_pos + count]
            self.stored_pos += count
            if (
                len(stored) != count
                or (count and int(stored[-1]) >= len(chunks))
                or (count > 1 and bool((np.diff(stored.astype(np.int64)) <= 0).any()))
            ):
                raise _bad(f"{what}: its stored chunk numbers are out of range or not increasing")
        self.entries.append(_Entry(fqn, self.start_pos, count, chunks, stored, elem))
        return count

    def check_all_used(self) -> None:
        if self.pos[0] != len(self.explicit[0]) or self.stored_pos != len(self.stored_all):
            raise _bad("the chunk arrays hold more values than the entries use")


def _storage_meta(meta: Any) -> StorageMeta | None:
    """The header's ``storage_meta`` (None when absent), its fields checked."""
    if meta is None:
        return None
    storage_meta = StorageMeta()
    for name in ("checkpoint_id", "save_id", "load_id", "modules"):
        setattr(storage_meta, name, untag(_get(meta, name, (str, dict, type(None)), "storage_meta")))
    if type(storage_meta.modules) is not list or any(type(m) is not str for m in storage_meta.modules):
        raise _bad("storage_meta modules is not a list of strings")
    return storage_meta


def materialize(metadata: Metadata) -> Metadata:
    """A copy of ``metadata`` with plain lists and dicts in place of lazy parts (for pickling)."""
    state = {}
    known: dict[tuple[int, ...], torch.Size] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and type(md.chunks) is not list:
            chunks = md.chunks.as_list(known) if type(md.chunks) is RuleChunks else list(md.chunks)
            md = TensorStorageMetadata(properties=md.properties, size=md.size, chunks=chunks)
        state[fqn] = md
    storage = metadata.storage_data
    if storage is not None and type(storage) is not dict:
        storage = dict(storage.items())
    out = Metadata(
        state_dict_metadata=state,
        planner_data=metadata.planner_data,
        storage_data=storage,
        storage_meta=metadata.storage_meta,
    )
    out.version = getattr(metadata, "version", None)
    return out


def storage_of(data: bytes, where: str) -> CompactStorage:
    """The ``storage_data`` of compact ``.metadata`` bytes: what a pickled ``CompactStorage`` loads as."""
    storage = load_compact(data, where).storage_data
    if not isinstance(storage, CompactStorage):
        raise _bad(f"{where}: no storage section")
    return storage
