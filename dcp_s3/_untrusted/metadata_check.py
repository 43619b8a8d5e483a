"""Validation of an unpickled ``.metadata``: every field of the type and range readers rely on.

Run once, centrally, by :func:`dcp_s3._metadata.formats.load_metadata` so that readers, planners, ``inspect``
and ``verify`` never meet a negative length, a bool where an int belongs, a non-string
path, a chunk outside its tensor or a frame index that does not match its chunk: each
is a ``CheckpointFormatError`` naming the entry and the field.

The walk also bounds the metadata's *expanded* size. A pickle can reference one object
many times (a list of 10,000 chunks shared by 10,000 tensors is 10^8 chunks to every
consumer that iterates it, from a few hundred KiB of pickle). Each entry is charged,
with its multiplicity, before it is iterated, against a budget proportional to the
pickle's size, so neither this walk nor any later consumer does more work than that.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3._codec.format import FrameIndex
from dcp_s3._objstore.base import relative_name_problem
from dcp_s3._torch_compat import _StorageInfo, element_size
from dcp_s3._untrusted.metadata_pickle import MAX_NDIM, describe
from dcp_s3.errors import CheckpointFormatError

__all__ = ["check_metadata", "check_location", "check_object_name", "offsets_key", "tiling_problem", "MAX_OFFSET"]

#: Largest byte offset or length accepted from metadata (S3 objects are at most 5 TiB).
MAX_OFFSET = (1 << 63) - 1
_ATOMS = (str, int, float, bool, bytes, type(None), torch.dtype, torch.layout, torch.memory_format, os.PathLike)
_CONTAINERS = (list, tuple, dict, set, frozenset)


def check_object_name(name: object) -> str:
    """Reject object names from metadata that would escape the checkpoint prefix, or that are not portable.

    The rules of every relative object name (:func:`dcp_s3._objstore.base.relative_name_problem`: no
    empty, ``.`` or ``..`` segment, so no leading ``/`` and no ``://``; no NUL), plus what is specific
    to names read from a ``.metadata``: a ``str`` (the pickle can hold anything), and no backslash on
    any OS — the checkpoint may be read elsewhere, by stock torch readers (``FileSystemReader`` on
    Windows) or fsspec, which would take it for a separator. The error shows the name bounded
    (``describe``): it is untrusted input of any size.
    """
    if type(name) is not str:
        raise CheckpointFormatError(f"metadata names an invalid object path {describe(name)}: it is not a string")
    problem = relative_name_problem(name) or ("it contains a backslash" if "\\" in name else None)
    if problem is not None:
        raise CheckpointFormatError(f"metadata names an invalid object path {describe(name)}: {problem}")
    return name


class _Walk:
    def __init__(self, budget: int) -> None:
        self.left = budget

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise CheckpointFormatError(
                "metadata expands far beyond its size (shared or recursive references): refusing to walk it"
            )


def _int(value: object, what: str, lo: int = 0, hi: int = MAX_OFFSET) -> int:
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise CheckpointFormatError(f"{what} is {describe(value)}, expected an integer in [{lo}, {hi}]")
    return value


def _field(obj: object, name: str, where: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise CheckpointFormatError(f"{where}: field {name} is missing") from None


def _shape(value: object, what: str, ndim: int | None = None) -> torch.Size:
    if type(value) is not torch.Size or len(value) > MAX_NDIM or (ndim is not None and len(value) != ndim):
        want = f"{ndim} dimensions" if ndim is not None else f"at most {MAX_NDIM} dimensions"
        raise CheckpointFormatError(f"{what} is {describe(value)}, expected a torch.Size of {want}")
    for dim in value:
        _int(dim, what)
    return value


def _name(fqn: str) -> str:
    return fqn if len(fqn) <= 200 else fqn[:197] + "..."


def offsets_key(offsets: Sequence[int]) -> str:
    """A dict key for chunk offsets: tuples of ints can be chosen so that their hashes collide
    (every insertion would then scan all the others); a str's hash is randomized per process."""
    return ",".join(map(str, offsets))


def _tensor(fqn: str, md: TensorStorageMetadata, walk: _Walk) -> dict[str, int]:
    """Check one tensor entry; returns the stored bytes of each chunk, by ``offsets_key``."""
    where = f"tensor {_name(fqn)}"
    props = _field(md, "properties", where)
    if type(props) is not TensorProperties:
        raise CheckpointFormatError(f"{where}: properties is {describe(props)}")
    dtype = _field(props, "dtype", where)
    if type(dtype) is not torch.dtype:
        raise CheckpointFormatError(f"{where}: dtype is {describe(dtype)}")
    for name, kind in (
        ("layout", torch.layout),
        ("memory_format", torch.memory_format),
        ("requires_grad", bool),
        ("pin_memory", bool),
    ):
        if type(_field(props, name, where)) is not kind:
            raise CheckpointFormatError(f"{where}: {name} is {describe(getattr(props, name))}")
    size = _shape(_field(md, "size", where), f"{where}: size")
    try:
        elem = element_size(dtype)
    except TypeError:
        raise CheckpointFormatError(f"{where}: dtype {dtype} has no element size") from None
    chunks = _field(md, "chunks", where)
    if type(chunks) is not list:
        raise CheckpointFormatError(f"{where}: chunks is {describe(chunks)}, expected a list")
    walk.spend(len(chunks) * (2 + 2 * len(size)))
    out: dict[str, int] = {}
    for i, chunk in enumerate(chunks):
        if type(chunk) is not ChunkStorageMetadata:
            raise CheckpointFormatError(f"{where}: chunk {i} is {describe(chunk)}")
        offsets = _shape(_field(chunk, "offsets", where), f"{where}: chunk {i} offsets", len(size))
        sizes = _shape(_field(chunk, "sizes", where), f"{where}: chunk {i} sizes", len(size))
        if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
            raise CheckpointFormatError(
                f"{where}: chunk {i} (offsets {list(offsets)}, sizes {list(sizes)}) lies outside the tensor's {list(size)}"
            )
        nbytes = math.prod(sizes) * elem
        if nbytes > MAX_OFFSET:
            raise CheckpointFormatError(f"{where}: chunk {i} of {list(sizes)} is too large")
        out[offsets_key(offsets)] = nbytes
    return out


#: Up to this many chunks, a tensor's are compared pair by pair in Python (cheaper than numpy's set-up).
_PAIRWISE = 8


def _pairwise(size: torch.Size, chunks: Sequence[ChunkStorageMetadata]) -> str | None:
    """:func:`tiling_problem` for a few chunks."""
    numel = math.prod(size)
    boxes = [(c.offsets, c.sizes) for c in chunks if math.prod(c.sizes)]
    total = sum(math.prod(s) for _, s in boxes)
    if total != numel:
        return f"its chunks cover {total} of its {numel} elements" if total < numel else "its chunks overlap"
    for i, (oi, si) in enumerate(boxes):
        for oj, sj in boxes[:i]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oi, si, oj, sj, strict=True)):
                return "its chunks overlap"
    return None


def _tiling(fqn: str, md: TensorStorageMetadata) -> None:
    """After the whole walk (whose budget bounds the chunks of every tensor): chunks cover ``md`` exactly."""
    size, chunks, ndim = md.size, md.chunks, len(md.size)
    if len(chunks) == 1 and chunks[0].sizes == size and not any(chunks[0].offsets):
        return  # one chunk, the whole tensor: the common case, without numpy
    if len(chunks) <= _PAIRWISE:
        problem = _pairwise(size, chunks)
    else:
        offsets = np.array([c.offsets for c in chunks], dtype=np.int64).reshape(len(chunks), ndim)
        sizes = np.array([c.sizes for c in chunks], dtype=np.int64).reshape(offsets.shape)
        problem = tiling_problem(size, offsets, sizes)
    if problem is not None:
        raise CheckpointFormatError(
            f"tensor {_name(fqn)} of {list(size)}: {problem} (a reader would return bytes it never read)"
        )


#: Pairs of chunks the overlap sweep may compare (chunks that are not a grid: rare in practice).
MAX_SWEEP_PAIRS = 4_000_000


def tiling_problem(size: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> str | None:
    """Why chunks ``offsets``/``sizes`` (``(n, ndim)`` int64 arrays, each inside the tensor) do not
    cover a tensor of ``size`` exactly once, or None.

    A reader that allocates what the metadata describes (``convert``, torch's
    ``_EmptyStateDictLoadPlanner``) would otherwise hand on memory it never read into. Their
    volumes must add up to the tensor's; then they cover it iff no two overlap. That is found
    in O(n log n) when the chunks form a grid (every chunk one cell between consecutive cut
    points in each dimension, as DCP's sharding makes them), else by a sweep along dimension 0
    comparing chunks whose rows overlap (at most ``MAX_SWEEP_PAIRS`` comparisons).
    """
    numel = math.prod(size)
    volumes = np.prod(sizes, axis=1, dtype=np.int64)  # (each chunk's bytes were checked to fit in int64)
    total = sum(volumes.tolist())
    if total != numel:
        return f"its chunks cover {total} of its {numel} elements" if total < numel else "its chunks overlap"
    if numel == 0 or not len(size):  # (a scalar: exactly one chunk, of volume 1)
        return None
    keep = volumes != 0
    offsets, ends = offsets[keep], offsets[keep] + sizes[keep]
    cells = []
    for k in range(len(size)):
        cuts = np.unique(np.concatenate((offsets[:, k], ends[:, k])))
        first = np.searchsorted(cuts, offsets[:, k])
        if (np.searchsorted(cuts, ends[:, k]) != first + 1).any():
            return _sweep(offsets, ends)
        cells.append(first)
    distinct = len(np.unique(np.stack(cells, axis=1), axis=0))
    return None if distinct == len(offsets) else "its chunks overlap"


def _sweep(offsets: np.ndarray, ends: np.ndarray) -> str | None:
    active: list[int] = []
    pairs = 0
    for i in np.argsort(offsets[:, 0], kind="stable").tolist():
        active = [j for j in active if ends[j, 0] > offsets[i, 0]]
        pairs += len(active)
        if pairs > MAX_SWEEP_PAIRS:
            return f"its {len(offsets)} chunks are too irregular to check for overlaps"
        if active:
            others = np.asarray(active)
            if ((offsets[others] < ends[i]) & (offsets[i] < ends[others])).all(axis=1).any():
                return "its chunks overlap"
        active.append(i)
    return None


def _location(index: MetadataIndex, info: _StorageInfo, nbytes: int | None, walk: _Walk) -> None:
    """Check one storage entry; ``nbytes``: its tensor chunk's bytes, None for a byte item."""
    where = f"storage entry {_name(index.fqn)}" + (f"{list(index.offset)}" if index.offset is not None else "")
    check_object_name(_field(info, "relative_path", where))
    offset = _int(_field(info, "offset", where), f"{where}: offset")
    length = _int(_field(info, "length", where), f"{where}: length", 0, MAX_OFFSET - offset)
    transforms = _field(info, "transform_descriptors", where)
    if transforms is not None and (
        type(transforms) not in (list, tuple) or len(transforms) > 16 or any(type(t) is not str for t in transforms)
    ):
        raise CheckpointFormatError(f"{where}: transform_descriptors is {describe(transforms)}")
    payload_offset = getattr(info, "payload_offset", None)
    crc = getattr(info, "crc32c", None)
    frames = getattr(info, "frames", None)
    frame_crcs = getattr(info, "frame_crc32c", None)
    if crc is not None:
        _int(crc, f"{where}: crc32c", 0, 0xFFFFFFFF)
    if payload_offset is not None:
        _int(payload_offset, f"{where}: payload_offset", 0, length)
    block_size = getattr(info, "block_size", None)
    block_crcs = getattr(info, "block_crc32c", None)
    if nbytes is None:  # a byte item: stored as is
        if payload_offset is not None or frames is not None or frame_crcs is not None or block_size is not None:
            raise CheckpointFormatError(f"{where}: a byte item with a tensor payload offset, frames or blocks")
        if block_crcs is not None:
            raise CheckpointFormatError(f"{where}: a byte item with block checksums")
        return
    _blocks(where, block_size, block_crcs, crc, payload_offset, frames, nbytes, walk)
    if frames is None:
        if frame_crcs is not None:
            raise CheckpointFormatError(f"{where}: frame_crc32c without frames")
        have = length - payload_offset if payload_offset is not None else length
        if have < nbytes and not transforms:  # (a transform such as torch's ZStandard may shrink it)
            raise CheckpointFormatError(f"{where}: holds {have} bytes, too few for its chunk's {nbytes}")
        return
    if type(frames) is not FrameIndex or payload_offset is not None:
        raise CheckpointFormatError(
            f"{where}: frames is {describe(frames)} with payload_offset {describe(payload_offset)}"
        )
    walk.spend(2 * frames.num_frames)
    if frames.raw_length != nbytes:
        raise CheckpointFormatError(
            f"{where}: its frame index decodes to {frames.raw_length} bytes, its chunk holds {nbytes}"
        )
    if frames.stored_length > length:
        raise CheckpointFormatError(f"{where}: frames end at byte {frames.stored_length} of a {length}-byte item")
    # Compressed items are always checksummed: a missing CRC would let altered frames decode unnoticed.
    if type(frame_crcs) is not tuple or len(frame_crcs) != frames.num_frames:
        raise CheckpointFormatError(
            f"{where}: frame_crc32c is {describe(frame_crcs)}, expected {frames.num_frames} checksums"
        )
    for value in frame_crcs:
        _int(value, f"{where}: frame_crc32c", 0, 0xFFFFFFFF)


#: Largest ``block_size`` a checkpoint may claim (a block is read and hashed whole).
MAX_BLOCK_SIZE = 1 << 30


def _blocks(
    where: str,
    size: object,
    crcs: object,
    crc: object,
    payload_offset: object,
    frames: object,
    nbytes: int,
    walk: _Walk,
) -> None:
    """Check a tensor entry's ``block_size``/``block_crc32c`` (``ItemLocation``): none, or a raw item's payload
    cut into blocks, one checksum each (None for a one-block payload, whose checksum is ``crc32c``)."""
    if size is None:
        if crcs is not None:
            raise CheckpointFormatError(f"{where}: block_crc32c without block_size")
        return
    size = _int(size, f"{where}: block_size", 1, MAX_BLOCK_SIZE)
    if frames is not None or payload_offset is None or crc is None:
        raise CheckpointFormatError(f"{where}: block_size on an item that is not a checksummed raw tensor payload")
    count = max(1, -(-nbytes // size))
    if crcs is None:
        if count != 1:
            raise CheckpointFormatError(f"{where}: block_crc32c missing for a payload of {count} blocks")
        return
    walk.spend(len(crcs) if type(crcs) is tuple else 1)
    if type(crcs) is not tuple or len(crcs) != count or count == 1:
        raise CheckpointFormatError(f"{where}: block_crc32c is {describe(crcs)}, expected {count} checksums")
    for value in crcs:
        _int(value, f"{where}: block_crc32c", 0, 0xFFFFFFFF)


def check_location(index: MetadataIndex, info: _StorageInfo, nbytes: int | None) -> None:
    """Check one storage entry built from compact metadata (whose size already bounds the work)."""
    _location(index, info, nbytes, _Walk(MAX_OFFSET))


def _generic(value: object, walk: _Walk) -> None:
    """Charge every object reachable through containers (planner data, storage meta)."""
    todo = [value]
    while todo:
        item = todo.pop()
        walk.spend(1)
        if isinstance(item, dict):
            walk.spend(len(item))
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, _CONTAINERS):
            walk.spend(len(item))  # type: ignore[arg-type]
            todo.extend(item)  # type: ignore[arg-type]
        elif not isinstance(item, _ATOMS) and hasattr(item, "__dict__"):
            todo.extend(vars(item).values())


def check_metadata(metadata: object, budget: int) -> Metadata:
    """``metadata`` if it is well-formed DCP metadata, else a ``CheckpointFormatError`` naming what is not."""
    if type(metadata) is not Metadata:
        raise CheckpointFormatError(f"holds {describe(metadata)}, not DCP Metadata")
    walk = _Walk(budget)
    state = _field(metadata, "state_dict_metadata", "metadata")
    storage = _field(metadata, "storage_data", "metadata")
    if type(state) is not dict or type(storage) is not dict:
        raise CheckpointFormatError("metadata has no state_dict_metadata or storage_data dict")
    walk.spend(len(state) + len(storage))
    chunks = _entries(state, walk)
    for index, info in storage.items():
        _storage_entry(index, info, chunks, walk)
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and type(storage_meta) is not StorageMeta:
        raise CheckpointFormatError(f"storage_meta is {describe(storage_meta)}")
    version = getattr(metadata, "version", None)
    if version is not None and type(version) is not str:
        raise CheckpointFormatError(f"version is {describe(version)}")
    _generic(getattr(metadata, "planner_data", None), walk)
    _generic(storage_meta, walk)
    for fqn, md in state.items():
        if type(md) is TensorStorageMetadata:
            _tiling(fqn, md)
    return metadata


def _entries(state: dict[Any, Any], walk: _Walk) -> dict[str, dict[str, int] | None]:
    """The state dict entries checked: per fqn, its chunks' byte sizes by offsets (None: a byte item)."""
    chunks: dict[str, dict[str, int] | None] = {}
    for fqn, md in state.items():
        if type(fqn) is not str:
            raise CheckpointFormatError(f"metadata key {describe(fqn)} is not a string")
        if type(md) is TensorStorageMetadata:
            chunks[fqn] = _tensor(fqn, md, walk)
        elif type(md) is BytesStorageMetadata:
            chunks[fqn] = None
        else:
            raise CheckpointFormatError(f"{_name(fqn)}: entry is {describe(md)}")
    return chunks


def _storage_entry(index: object, info: object, chunks: dict[str, dict[str, int] | None], walk: _Walk) -> None:
    """A storage entry checked: its key, the item it stores (a described tensor chunk or byte item) and where."""
    if type(index) is not MetadataIndex or not isinstance(info, _StorageInfo):
        raise CheckpointFormatError(f"storage data maps {describe(index)} to {describe(info)}")
    walk.spend(4 + (len(index.offset) if index.offset is not None else 0))
    if index.index is not None:
        _int(index.index, f"storage entry {_name(index.fqn)}: index")
    if index.fqn not in chunks:
        raise CheckpointFormatError(f"storage entry {_name(index.fqn)}: not described in the metadata")
    tensor = chunks[index.fqn]
    nbytes = None
    if tensor is not None:
        nbytes = tensor.get(offsets_key(index.offset)) if index.offset is not None else None
        if nbytes is None:
            raise CheckpointFormatError(
                f"storage entry {_name(index.fqn)}: no chunk of the tensor at offset {describe(index.offset)}"
            )
    _location(index, info, nbytes, walk)
