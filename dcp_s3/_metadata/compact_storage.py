"""``CompactStorage``: the lazy ``storage_data`` of compact metadata, and the column decoding.

Every storage field is a ``Column`` of the compact file (see ``dcp_s3._metadata.compact``); an entry
is built, and checked with ``dcp_s3._untrusted.metadata_check.check_location``, when it is looked up, and
kept. Column-wide bounds (table indices, value ranges) are checked at decode without
expanding a column.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from dcp_s3._codec.format import FrameIndex
from dcp_s3._layout import ItemLocation
from dcp_s3._metadata.compact import FRAME_COLUMNS, KIND_ITEM_LOCATION, OPTIONAL_COLUMNS, STORAGE_COLUMNS
from dcp_s3._torch_compat import _StorageInfo
from dcp_s3._untrusted.metadata_check import MAX_OFFSET, check_location, check_object_name
from dcp_s3._untrusted.metadata_pickle import MAX_INT_KEY, MAX_NDIM, describe
from dcp_s3.errors import CheckpointFormatError

__all__ = ["CompactStorage", "Column", "untag"]

_INT_TYPES = ("<u1", "<u2", "<u4", "<u8", "<i1", "<i2", "<i4", "<i8")
#: Deepest nesting of a tagged JSON value.
MAX_DEPTH = 64


def _bad(what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"compact metadata: {what}")


def _get(obj: Any, key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    if type(obj) is not dict or key not in obj:
        raise _bad(f"{where}: field {key} is missing")
    value = obj[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if type(value) not in kinds:
        raise _bad(f"{where}: {key} is {describe(value)}")
    return value


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_OFFSET) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{what} is {describe(value)}, expected an integer in [{lo}, {hi}]")
    return value


def untag(value: Any, depth: int = 0) -> Any:
    """Inverse of ``dcp_s3._metadata.compact.tag`` for untrusted JSON."""
    if depth > MAX_DEPTH:
        raise _bad("a tagged value nests too deeply")
    if value is None or type(value) in (bool, int, str, float):
        return value
    if type(value) is not dict or len(value) != 1:
        raise _bad(f"a tagged value is {describe(value)}")
    ((kind, inner),) = value.items()
    if kind == "S" and type(inner) is list and len(inner) <= MAX_NDIM:
        return torch.Size([_int(v, "a torch.Size element") for v in inner])
    if kind in ("P", "PP") and type(inner) is str:
        return pathlib.PosixPath(inner) if kind == "P" else pathlib.PurePosixPath(inner)
    if kind in ("L", "T") and type(inner) is list:
        items = [untag(v, depth + 1) for v in inner]
        return items if kind == "L" else tuple(items)
    if kind == "D" and type(inner) is list:
        out: dict[Any, Any] = {}
        for pair in inner:
            if type(pair) is not list or len(pair) != 2:
                raise _bad("a tagged dict item is not a pair")
            key = untag(pair[0], depth + 1)
            # str hashes are randomized; small ints have distinct hashes: no crafted collisions
            if not (
                type(key) is str or key is None or type(key) is bool or (type(key) is int and abs(key) <= MAX_INT_KEY)
            ):
                raise _bad(f"a dict key is {describe(key)}")
            out[key] = untag(pair[1], depth + 1)
        return out
    raise _bad(f"unknown tagged value {describe(kind)}")


class ArraysReader:
    def __init__(self, data: bytes, base: int, table: Any) -> None:
        if type(table) is not dict:
            raise _bad("the array table is missing")
        self.data, self.base, self.table = data, base, table

    def get(self, name: Any, count: int | None = None) -> np.ndarray:
        spec = self.table.get(name) if type(name) is str else None
        if type(spec) is not list or len(spec) != 3 or spec[0] not in _INT_TYPES:
            raise _bad(f"array {describe(name)} is not described")
        dtype = np.dtype(spec[0])
        offset = _int(spec[1], f"array {name} offset")
        n = _int(spec[2], f"array {name} count")
        if count is not None and n != count:
            raise _bad(f"array {name} holds {n} values, expected {count}")
        if self.base + offset + n * dtype.itemsize > len(self.data):
            raise _bad(f"array {name} ({n} x {dtype.itemsize} bytes at {offset}) runs past the end of the data")
        return np.frombuffer(self.data, dtype=dtype, count=n, offset=self.base + offset)


class Column:
    """One integer per storage entry (or frame index), described as in ``dcp_s3._metadata.compact``."""

    def __init__(self, spec: Any, n: int, arrays: ArraysReader, name: str, nested: bool = False) -> None:
        self.n = n
        self.segments: tuple[int, Column, Column] | None = None
        self.const: int | None = None
        self.values: np.ndarray | None = None
        self.run_ends: np.ndarray | None = None
        self.period = 0
        if type(spec) is not dict or len(spec) != 1:
            raise _bad(f"column {name} is {describe(spec)}")
        ((kind, arg),) = spec.items()
        if kind == "c":
            self.const = _int(arg, f"column {name}", -1)
            self.start, self.step = self.const, 0
        elif kind in ("a", "m"):
            nums = arg if type(arg) is list else []
            if len(nums) != (2 if kind == "a" else 3):
                raise _bad(f"column {name} is {describe(arg)}")
            if kind == "m":
                self.period = _int(nums[0], f"column {name} period", 1, max(1, n))
                if n % self.period:
                    raise _bad(f"column {name}: period {self.period} does not divide {n}")
            self.start = _int(nums[-2], f"column {name} start", -1)
            self.step = _int(nums[-1], f"column {name} step", -MAX_OFFSET)
        elif kind == "r":
            pair = arg if type(arg) is list and len(arg) == 2 else [None, None]
            lengths = arrays.get(pair[1]).astype(np.int64)
            self.values = arrays.get(pair[0], len(lengths))
            if len(lengths) and int(lengths.min()) < 1 or int(lengths.sum()) != n:
                raise _bad(f"column {name}: runs do not add up to {n} entries")
            self.run_ends = np.cumsum(lengths)
        elif kind == "x":
            self.values = arrays.get(arg, n)
        elif kind == "s" and not nested:
            parts = arg if type(arg) is list and len(arg) == 2 else []
            if len(parts) != 2 or any(type(p) is not list or len(p) != 2 for p in parts):
                raise _bad(f"column {name} segments are {describe(arg)}")
            head = _int(parts[0][1], f"column {name} head", 0, n)
            if parts[1][1] != n - head:
                raise _bad(f"column {name}: segments do not add up to {n} entries")
            self.segments = (
                head,
                Column(parts[0][0], head, arrays, name, True),
                Column(parts[1][0], n - head, arrays, name, True),
            )
        else:
            raise _bad(f"column {name} has unknown encoding {describe(kind)}")

    def __getitem__(self, i: int) -> int:
        if self.segments is not None:
            head, first, rest = self.segments
            return first[i] if i < head else rest[i - head]
        if self.const is not None:
            return self.const
        if self.values is None:
            return self.start + self.step * (i % self.period if self.period else i)
        if self.run_ends is not None:
            i = int(np.searchsorted(self.run_ends, i, side="right"))
        return int(self.values[i])

    def array(self) -> np.ndarray:
        """Every value, as int64."""
        if self.segments is not None:
            return np.concatenate((self.segments[1].array(), self.segments[2].array()))
        if self.values is not None:
            if self.run_ends is None:
                return self.values.astype(np.int64)
            return np.repeat(self.values.astype(np.int64), np.diff(self.run_ends, prepend=0))
        i = np.arange(self.n, dtype=np.int64)
        return self.start + self.step * (i % self.period if self.period else i)

    def bounds(self) -> tuple[int, int]:
        """(smallest, largest) value, computed without expanding the column."""
        if self.n == 0:
            return 0, 0
        if self.segments is not None:
            parts = [c.bounds() for c in self.segments[1:] if c.n]
            return min(p[0] for p in parts), max(p[1] for p in parts)
        if self.values is not None:
            return int(self.values.min()), int(self.values.max())
        last = self.start + self.step * ((self.period or self.n) - 1)
        return min(self.start, last), max(self.start, last)


class _Entry:
    __slots__ = ("fqn", "start", "count", "chunks", "stored", "elem")

    def __init__(
        self,
        fqn: str,
        start: int,
        count: int,
        chunks: Sequence[ChunkStorageMetadata] | None,
        stored: np.ndarray | None,
        elem: int,
    ) -> None:
        self.fqn, self.start, self.count, self.chunks, self.stored, self.elem = fqn, start, count, chunks, stored, elem


class CompactStorage(Mapping[MetadataIndex, _StorageInfo]):
    """``Metadata.storage_data`` of a compact ``.metadata``: entries built (and checked) on lookup."""

    def __init__(
        self,
        data: bytes,
        entries: list[_Entry],
        header: dict[str, Any],
        arrays: ArraysReader,
        where: str,
        rebuild: Callable[[bytes, str], CompactStorage],
    ) -> None:
        self._data = data
        self._where = where  # named by errors found when an entry is built
        self._rebuild = rebuild  # (data, where) -> an equal CompactStorage: how a pickle of this one loads
        self._entries = entries
        self._by_fqn = {e.fqn: e for e in entries}
        self._pos_entry = np.array([e.start for e in entries], dtype=np.int64)
        self.count = _int(_get(header, "count", int, "storage"), "storage count")
        if self.count != sum(e.count for e in entries):
            raise _bad(f"storage holds {self.count} entries, its state-dict entries {sum(e.count for e in entries)}")
        self.objects = _get(header, "objects", list, "storage")
        for name in self.objects:
            check_object_name(name)
        self.transforms = [untag(t) for t in _get(header, "transforms", list, "storage")]
        for t in self.transforms:
            if type(t) not in (list, tuple) or len(t) > 16 or any(type(x) is not str for x in t):
                raise _bad(f"transform descriptors {describe(t)}")
        columns = _get(header, "columns", dict, "storage")
        self.cols = {
            c: Column(
                columns.get(c, {"c": OPTIONAL_COLUMNS[c]} if c in OPTIONAL_COLUMNS else None), self.count, arrays, c
            )
            for c in STORAGE_COLUMNS
        }
        self.bcrcs = arrays.get(header["blocks"]) if "blocks" in header else np.zeros(0, np.uint32)
        self._block_at: np.ndarray | None = None
        fr = _get(header, "frames", dict, "storage")
        self.nframes = _int(_get(fr, "count", int, "frames"), "frame count")
        self.codecs = _get(fr, "codecs", list, "frames")
        fcols = _get(fr, "columns", dict, "frames")
        self.fcols = {c: Column(fcols.get(c), self.nframes, arrays, f"frames {c}") for c in FRAME_COLUMNS}
        self.fends = arrays.get(fr.get("ends"))
        self.fcrcs = arrays.get(fr.get("crcs"))
        self.fraw = arrays.get(fr.get("raw"))
        limits = {
            "kind": (0, 1),
            "object": (0, len(self.objects) - 1),
            "transform": (-1, len(self.transforms) - 1),
            "frame": (-1, self.nframes - 1),
            "offset": (0, MAX_OFFSET),
            "length": (0, MAX_OFFSET),
            "payload": (-1, MAX_OFFSET),
            "crc": (-1, 0xFFFFFFFF),
            "hint": (-1, MAX_OFFSET),
            "block": (-1, MAX_OFFSET),
            "nblocks": (0, MAX_OFFSET),
        }
        for name, (lo, hi) in limits.items():  # (an empty column has no values to check: bounds() says (0, 0))
            have = self.cols[name].bounds()
            if self.count and (have[0] < lo or have[1] > hi):
                raise _bad(f"storage column {name} holds values in [{have[0]}, {have[1]}], outside [{lo}, {hi}]")
        for name in FRAME_COLUMNS:
            if self.fcols[name].bounds()[0] < 0:
                raise _bad(f"frame column {name} holds a negative value")
        if (self.nframes and self.fcols["codec"].bounds()[1] >= len(self.codecs)) or any(
            type(c) is not str for c in self.codecs
        ):  # (an empty codecs table: every index is out of range)
            raise _bad(f"frame column codec indexes a codecs table of {len(self.codecs)} names out of range")
        self._frame_at: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._cache: dict[int, _StorageInfo] = {}

    def __len__(self) -> int:
        return self.count

    def referenced_objects(self) -> set[str]:
        """The object names the entries use, from the object column alone (no entry is built)."""
        return {self.objects[i] for i in np.unique(self.cols["object"].array()).tolist()}

    def _position(self, key: MetadataIndex) -> tuple[_Entry, int, int] | None:
        entry = self._by_fqn.get(key.fqn) if isinstance(key, MetadataIndex) else None
        if entry is None or entry.count == 0:
            return None
        if entry.chunks is None:
            return (entry, entry.start, 0) if key.offset is None else None
        if key.offset is None:
            return None
        c = entry.chunks.find(key.offset)  # type: ignore[attr-defined]
        if c is None:
            return None
        if entry.stored is None:
            return entry, entry.start + c, c
        k = int(np.searchsorted(entry.stored, c))
        return (entry, entry.start + k, c) if k < entry.count and int(entry.stored[k]) == c else None

    def __getitem__(self, key: MetadataIndex) -> _StorageInfo:
        found = self._position(key)
        if found is None:
            raise KeyError(key)
        return self._info(*found)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, MetadataIndex) and self._position(key) is not None

    def _chunk_of(self, entry: _Entry, k: int) -> int:
        return k if entry.stored is None else int(entry.stored[k])

    def _pairs(self) -> Iterator[tuple[MetadataIndex, _StorageInfo]]:
        for entry in self._entries:
            for k in range(entry.count):
                c = self._chunk_of(entry, k)
                yield self._index(entry, entry.start + k, c), self._info(entry, entry.start + k, c)

    def _index(self, entry: _Entry, p: int, c: int) -> MetadataIndex:
        hint = self.cols["hint"][p]
        offset = entry.chunks[c].offsets if entry.chunks is not None else None
        return MetadataIndex(entry.fqn, offset, None if hint == -1 else hint)

    def __iter__(self) -> Iterator[MetadataIndex]:
        for entry in self._entries:
            for k in range(entry.count):
                yield self._index(entry, entry.start + k, self._chunk_of(entry, k))

    def items(self) -> ItemsView[MetadataIndex, _StorageInfo]:
        return _Items(self)

    def values(self) -> ValuesView[_StorageInfo]:
        return _Values(self)

    def _info(self, entry: _Entry, p: int, c: int) -> _StorageInfo:
        info = self._cache.get(p)
        if info is None:
            try:
                info = self._cache[p] = self._build(entry, p, c)
            except CheckpointFormatError as exc:
                raise CheckpointFormatError(f"{self._where}: {exc}") from None
        return info

    def _build(self, entry: _Entry, p: int, c: int) -> _StorageInfo:
        col = self.cols
        t = col["transform"][p]
        args = (
            self.objects[col["object"][p]],
            col["offset"][p],
            col["length"][p],
            None if t == -1 else self.transforms[t],
        )
        if col["kind"][p] == KIND_ITEM_LOCATION:
            payload, crc, f = col["payload"][p], col["crc"][p], col["frame"][p]
            frames, frame_crcs = self._frames(f) if f != -1 else (None, None)
            block = col["block"][p]
            info: _StorageInfo = ItemLocation(
                *args,
                payload_offset=None if payload == -1 else payload,
                crc32c=None if crc == -1 else crc,
                frames=frames,
                frame_crc32c=frame_crcs,
                block_size=None if block == -1 else block,
                block_crc32c=self._blocks(p),
            )
        else:
            info = _StorageInfo(*args)
        nbytes = None
        if entry.chunks is not None:
            nbytes = math.prod(entry.chunks[c].sizes) * entry.elem
            if nbytes > MAX_OFFSET:
                raise _bad(f"tensor {entry.fqn[:200]}: chunk {c} is too large")
        check_location(
            MetadataIndex(entry.fqn, entry.chunks[c].offsets if entry.chunks is not None else None), info, nbytes
        )
        return info

    def _blocks(self, p: int) -> tuple[int, ...] | None:
        """Entry ``p``'s ``block_crc32c`` (positions in the block array computed on first use)."""
        if self._block_at is None:
            at = np.concatenate(([0], np.cumsum(self.cols["nblocks"].array())))
            if int(at[-1]) != len(self.bcrcs):
                raise _bad("the block array does not hold what the nblocks column counts")
            self._block_at = at
        lo, hi = int(self._block_at[p]), int(self._block_at[p + 1])
        return tuple(self.bcrcs[lo:hi].tolist()) if hi > lo else None

    def _frame_positions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where each frame index's ends, CRCs and raw bits start (computed on first use)."""
        if self._frame_at is None:
            n = self.fcols["frames"].array()
            has = self.fcols["crcs"].array()
            at = tuple(np.concatenate(([0], np.cumsum(x))) for x in (n, n * (has != 0), (n + 7) // 8))
            if (at[0][-1], at[1][-1], at[2][-1]) != (len(self.fends), len(self.fcrcs), len(self.fraw)):
                raise _bad("frame arrays do not hold what the frame columns count")
            self._frame_at = at  # type: ignore[assignment]
        assert self._frame_at is not None
        return self._frame_at

    def _frames(self, f: int) -> tuple[FrameIndex, tuple[int, ...] | None]:
        fc = self.fcols
        ends_at, crcs_at, raw_at = self._frame_positions()
        ends = tuple(self.fends[ends_at[f] : ends_at[f + 1]].tolist())
        raw = int.from_bytes(self.fraw[raw_at[f] : raw_at[f + 1]].tobytes(), "little")
        try:
            frames = FrameIndex(
                self.codecs[fc["codec"][f]],
                fc["version"][f],
                fc["element_size"][f],
                fc["grouping"][f],
                fc["raw_length"][f],
                fc["frame_size"][f],
                ends,
                raw,
            )
        except TypeError:
            raise _bad(f"frame index {f} is malformed") from None
        crcs = tuple(self.fcrcs[crcs_at[f] : crcs_at[f + 1]].tolist()) if fc["crcs"][f] else None
        return frames, crcs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping) or len(other) != len(self):
            return False
        return all(other.get(k) == v for k, v in self._pairs())

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (self._rebuild, (bytes(self._data), self._where))

    def __repr__(self) -> str:
        return f"CompactStorage({self.count} entries in {len(self.objects)} objects)"


class _Items(ItemsView[MetadataIndex, _StorageInfo]):
    _mapping: CompactStorage

    def __iter__(self) -> Iterator[tuple[MetadataIndex, _StorageInfo]]:
        return self._mapping._pairs()


class _Values(ValuesView[_StorageInfo]):
    _mapping: CompactStorage

    def __iter__(self) -> Iterator[_StorageInfo]:
        return (info for _, info in self._mapping._pairs())
