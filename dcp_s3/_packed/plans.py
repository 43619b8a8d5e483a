"""Save plans that travel as arrays: what ``ScalableSavePlanner`` gathers to, and scatters from, the coordinator.

torch gathers every rank's ``SavePlan`` to the coordinator as a pickle of per-item objects
(``WriteItem``, ``MetadataIndex``, ``TensorWriteData``, ``ChunkStorageMetadata``, several
``torch.Size``): ~240 bytes and ~7 us of unpickling per item, serially on the coordinator, and
the flatten mapping (``planner_data``) again on every rank. At 16,384 ranks of a Llama-70B
FSDP job that is 11.8 million items: minutes before planning starts.

:class:`PackedItems` is a rank's items as a table of its tensors (name, properties, size) and
integer arrays (offsets, chunk sizes, index hints). It pickles as those arrays, unpickles in
microseconds, and is a read-only sequence of the very ``WriteItem`` objects it was made from
(built on first access), so any code that walks ``plan.items`` (the writer, torch's plan
caching) sees ordinary items. :class:`PackedMapping` does the same for the flatten mapping.
The coordinator reads the arrays directly (:mod:`dcp_s3._planners.scale`); items that do not fit the
table (byte items, irregular tensors) ride along as objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dcp_s3._torch_compat import element_size

__all__ = ["PackedItems", "PackedMapping", "PackedSequence", "storage_size"]

Key = tuple[str, Any]
# WriteItem.bytes_io_data exists from torch 2.8 on
_NO_BYTES = {"bytes_io_data": None} if "bytes_io_data" in {f.name for f in dataclasses.fields(WriteItem)} else {}
_TYPES = list(WriteItemType)


T = TypeVar("T")


class PackedSequence(Sequence[T]):
    """A read-only sequence of objects kept as arrays (``ids`` rows) plus ``extras`` (position, object)
    that did not fit them; the objects are built once, on first access (``_objects``)."""

    ids: np.ndarray
    extras: list[tuple[int, T]]

    def _objects(self) -> list[T]:
        raise NotImplementedError

    def row_positions(self) -> np.ndarray:
        """Position in the sequence of each packed row."""
        taken = np.zeros(len(self), bool)
        taken[[p for p, _ in self.extras]] = True
        return np.flatnonzero(~taken)

    def __len__(self) -> int:
        return len(self.ids) + len(self.extras)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        return self._objects()[i]

    def __iter__(self) -> Iterator[T]:
        return iter(self._objects())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self._objects() == list(other)

    __hash__ = None  # type: ignore[assignment]


class PackedItems(PackedSequence[WriteItem]):
    """A rank's write items as arrays (see the module doc); equal, as a sequence, to the items."""

    def __init__(self, state: tuple[Any, ...]) -> None:
        # per tensor: fqns (and their digest), prop_of (into props), size_of (padded), ndim; per packed row:
        # ids (into fqns), types, offsets, sizes (padded), hints (-1: None); extras: (position, WriteItem)
        (
            self.fqns,
            self.digest,
            self.props,
            self.prop_of,
            self.size_of,
            self.ndim,
            self.ids,
            self.types,
            self.offsets,
            self.sizes,
            self.hints,
            self.extras,
        ) = state
        self._items: list[WriteItem] | None = None

    def _state(self) -> tuple[Any, ...]:
        return (
            self.fqns,
            self.digest,
            self.props,
            self.prop_of,
            self.size_of,
            self.ndim,
            self.ids,
            self.types,
            self.offsets,
            self.sizes,
            self.hints,
            self.extras,
        )

    @classmethod
    def pack(cls, items: Sequence[WriteItem]) -> PackedItems | None:
        """The items packed, or None when fewer than half fit the table (then a list is as good)."""
        fqns: dict[str, int] = {}
        props: list[TensorProperties] = []
        prop_of: list[int] = []
        size_of: list[torch.Size] = []
        rows: list[tuple[int, int, Any, Any, int]] = []
        extras: list[tuple[int, WriteItem]] = []
        for pos, item in enumerate(items):
            td = item.tensor_data
            if (
                td is None
                or getattr(item, "bytes_io_data", None) is not None
                or td.chunk is None
                or tuple(td.chunk.offsets) != tuple(item.index.offset or ())
                or not len(td.chunk.offsets) == len(td.chunk.sizes) == len(td.size)
                or min((*td.chunk.offsets, *td.chunk.sizes, *td.size), default=0) < 0
            ):
                extras.append((pos, item))
                continue
            fid = fqns.get(item.index.fqn)
            if fid is None:
                fid = fqns[item.index.fqn] = len(size_of)
                prop_of.append(_find(props, td.properties))
                size_of.append(td.size)
            elif size_of[fid] != td.size or props[prop_of[fid]] != td.properties:
                extras.append((pos, item))
                continue
            hint = item.index.index
            rows.append((fid, _TYPES.index(item.type), td.chunk.offsets, td.chunk.sizes, -1 if hint is None else hint))
        if len(rows) < len(extras) or not rows:
            return None
        width = max(len(s) for s in size_of)
        names = list(fqns)
        digest = hashlib.blake2b("\0".join(names).encode(), digest_size=16).digest()
        packed = cls(
            (
                names,
                digest,
                props,
                np.array(prop_of, np.int32),
                _matrix(size_of, width),
                np.array([len(s) for s in size_of], np.int64),
                np.array([r[0] for r in rows], np.int32),
                np.array([r[1] for r in rows], np.uint8),
                _matrix([r[2] for r in rows], width),
                _matrix([r[3] for r in rows], width),
                np.array([r[4] for r in rows], np.int64),
                extras,
            )
        )
        packed._items = list(items)
        return packed

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedItems, (self._state(),))

    def select(self, rows: np.ndarray, extras: list[tuple[int, WriteItem]], hints: np.ndarray) -> PackedItems:
        """The packed rows ``rows`` (ascending) with new index hints, and ``extras`` (position in this
        sequence, item; ascending), as a new sequence in the same relative order."""
        new_extras: list[tuple[int, WriteItem]] = []
        if extras:
            kept = np.concatenate([self.row_positions()[rows], np.array([p for p, _ in extras], np.int64)])
            order = np.empty(len(kept), np.int64)
            order[np.argsort(kept, kind="stable")] = np.arange(len(kept))
            new_extras = [(int(order[len(rows) + j]), item) for j, (_, item) in enumerate(extras)]
        return PackedItems(
            (
                *self._state()[:6],
                self.ids[rows],
                self.types[rows],
                self.offsets[rows],
                self.sizes[rows],
                hints,
                new_extras,
            )
        )

    def subset(self, positions: list[int]) -> PackedItems:
        """The items at ``positions`` (ascending), hints unchanged."""
        row_of = np.full(len(self), -1, np.int64)
        row_of[self.row_positions()] = np.arange(len(self.ids))
        wanted = np.array(positions, np.int64)
        rows = row_of[wanted]
        extras = dict(self.extras)
        kept_extras = [(int(p), extras[int(p)]) for p in wanted[rows < 0]]
        rows = rows[rows >= 0]
        return self.select(rows, kept_extras, self.hints[rows])

    def storage_size(self, pos: int) -> int:
        """torch's ``tensor_storage_size() or 1`` of the item at ``pos`` (the global tensor's bytes)."""
        rows = self.row_positions()
        row = int(np.searchsorted(rows, pos))
        if row == len(rows) or rows[row] != pos:
            return storage_size(dict(self.extras)[pos])
        fid = int(self.ids[row])
        numel = math.prod(self.size_of[fid, : self.ndim[fid]].tolist())
        return numel * element_size(self.props[int(self.prop_of[fid])].dtype) or 1

    def keys(self) -> list[Key]:
        """``(index.fqn, index.offset)`` of every item, in order (offsets as tuples: equal and hashed alike)."""
        names = [self.fqns[i] for i in self.ids.tolist()]
        offs = self.offsets.tolist()
        dims = self.ndim[self.ids].tolist()
        out: list[Key] = [(n, tuple(o[:d])) for n, o, d in zip(names, offs, dims, strict=True)]
        for pos, item in self.extras:
            out.insert(pos, (item.index.fqn, item.index.offset))
        return out

    def _objects(self) -> list[WriteItem]:
        return self.items()

    def __repr__(self) -> str:
        return f"PackedItems({len(self)} items, {len(self.fqns)} tensors)"

    def items(self) -> list[WriteItem]:
        """The ``WriteItem`` list, built once (fields filled directly: the same objects torch builds)."""
        if self._items is not None:
            return self._items
        new = object.__new__
        props = [self.props[p] for p in self.prop_of.tolist()]
        sizes = [torch.Size(row[:d]) for row, d in zip(self.size_of.tolist(), self.ndim.tolist(), strict=True)]
        out: list[WriteItem] = []
        for fid, kind, off, size, hint in zip(
            self.ids.tolist(),
            self.types.tolist(),
            self.offsets.tolist(),
            self.sizes.tolist(),
            self.hints.tolist(),
            strict=True,
        ):
            dims = len(sizes[fid])
            offsets = torch.Size(off[:dims])
            chunk = new(ChunkStorageMetadata)
            chunk.__dict__.update(offsets=offsets, sizes=torch.Size(size[:dims]))
            data = new(TensorWriteData)
            data.__dict__.update(chunk=chunk, properties=props[fid], size=sizes[fid])
            index = new(MetadataIndex)
            index.__dict__.update(fqn=self.fqns[fid], offset=offsets, index=None if hint < 0 else hint)
            item = new(WriteItem)
            item.__dict__.update(index=index, type=_TYPES[kind], tensor_data=data, **_NO_BYTES)
            out.append(item)
        for pos, extra in self.extras:
            out.insert(pos, extra)
        self._items = out
        return out


class PackedMapping:
    """A rank's flatten mapping (``planner_data``: fqn -> path in the nested state dict), pickled
    once with a digest, so the coordinator unpickles equal mappings' bytes only once."""

    def __init__(self, blob: bytes, digest: bytes) -> None:
        self.blob, self.digest = blob, digest

    @classmethod
    def pack(cls, mapping: dict[Any, Any]) -> PackedMapping:
        blob = pickle.dumps(mapping, protocol=pickle.HIGHEST_PROTOCOL)
        return cls(blob, hashlib.blake2b(blob, digest_size=16).digest())

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedMapping, (self.blob, self.digest))

    def mapping(self) -> dict[Any, Any]:
        loaded: dict[Any, Any] = pickle.loads(self.blob)  # made by pack on a rank of this job
        return loaded


def _find(table: list[TensorProperties], value: TensorProperties) -> int:
    for i, known in enumerate(table):
        if known == value:
            return i
    table.append(value)
    return len(table) - 1


def _matrix(rows: list[Any], width: int) -> np.ndarray:
    """Ragged int rows as an array padded with -1 (sizes and offsets are never negative in a valid plan)."""
    out = np.full((len(rows), width), -1, np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def storage_size(item: WriteItem) -> int:
    """torch's ``WriteItem.tensor_storage_size() or 1``: the global tensor's bytes."""
    td = item.tensor_data
    if td is None:
        return 1
    return math.prod(td.size) * element_size(td.properties.dtype) or 1
