"""``CompactStorage``: the lazy ``storage_data`` of compact metadata (its columns: ``compact_columns``).

Every storage field is a ``Column`` of the compact file (see ``dcp_s3._metadata.compact``); an entry
is built, and checked with ``dcp_s3._untrusted.metadata_check.check_location``, when it is looked up, and
kept. Column-wide bounds (table indices, value ranges) are checked at decode without
expanding a column.
"""

from __future__ import annotations

import math
from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from dcp_s3._codec.format import FrameIndex
from dcp_s3._layout import ItemLocation
from dcp_s3._metadata.compact import FRAME_COLUMNS, KIND_ITEM_LOCATION, OPTIONAL_COLUMNS, STORAGE_COLUMNS
from dcp_s3._metadata.compact_columns import ArraysReader, Column, _bad, _get, _int, untag
from dcp_s3._torch_compat import _StorageInfo
from dcp_s3._untrusted.metadata_check import MAX_OFFSET, check_location, check_object_name
from dcp_s3._untrusted.metadata_pickle import describe
from dcp_s3.errors import CheckpointFormatError

__all__ = ["CompactStorage"]


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
