"""Writing the compact ``.metadata`` format (see ``dcp_s3._metadata.compact``): ``dump_compact``.

Storage entries come either from a ``storage_data`` mapping (one Python step per entry) or
straight from the writer's gathered results (``dcp_s3._packed.results.PackedResults``: integer arrays
per rank, so a save of millions of items builds no per-item object on the coordinator). Both
become the same rows (state-dict entry, chunk number, arrival order, one integer per storage
column), which are sorted, deduplicated (a later entry for the same chunk wins, as in a dict)
and encoded as columns: the two give byte-identical files.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from dcp_s3._codec.format import FrameIndex
from dcp_s3._codec.frame_table import Framed, FrameTable
from dcp_s3._layout import ItemLocation
from dcp_s3._metadata.compact import (
    FORMAT_VERSION,
    FRAME_COLUMNS,
    KIND_ITEM_LOCATION,
    KIND_STORAGE_INFO,
    MAGIC,
    STORAGE_COLUMNS,
    ArraysBuilder,
    _narrow,
    _properties,
    _unsupported,
    tag,
)
from dcp_s3._metadata.compact_chunks import RuleChunks, chunk_rule
from dcp_s3._metadata.compact_entries import Entries, listed, no_chunk
from dcp_s3._packed.results import PackedResults
from dcp_s3._torch_compat import _StorageInfo

__all__ = ["dump_compact"]

#: Storage columns a row carries before sorting (``frame`` is numbered after it).
_ROW = tuple(c for c in STORAGE_COLUMNS if c != "frame")
_LIMIT = 1 << 63
#: Rows of packed results processed at once (see ``_Rows._packed_rows``).
_BATCH_ROWS = 1 << 16


def dump_compact(metadata: Metadata, results: Sequence[Sequence[WriteResult]] | None = None) -> bytes:
    """``metadata`` in the compact format; ``ConfigError`` if it holds what the format cannot describe.

    With ``results`` (every rank's write results, as ``S3StorageWriter.finish`` receives them)
    the storage entries are those results, and ``metadata.storage_data`` is not read.
    """
    arrays = ArraysBuilder()
    state = metadata.state_dict_metadata
    storage = metadata.storage_data
    if results is None and storage is not None and not hasattr(storage, "items"):
        raise _unsupported(f"storage_data of type {type(storage).__name__}")
    table = Entries()
    chunk_offsets: list[int] = []
    chunk_sizes: list[int] = []
    for fqn, md in state.items():
        if type(fqn) is not str:
            raise _unsupported(f"state-dict key {fqn!r}")
        if type(md) is BytesStorageMetadata:
            table.add(fqn, {"fqn": fqn, "bytes": 0}, (0, 0, 0, 0, 0, 0), None)
            continue
        if type(md) is not TensorStorageMetadata:
            raise _unsupported(f"state-dict entry {fqn!r} of type {type(md).__name__}")
        entry: dict[str, Any] = {"fqn": fqn, **_properties(md.properties), "size": list(md.size)}
        rule = chunk_rule(md.size, md.chunks)
        if rule is not None:
            entry["rule"] = rule
            chunks = RuleChunks(md.size, rule["dim"], rule["n"])
            length = md.size[rule["dim"]] if md.size else 0
            table.add(
                fqn, entry, (1, len(md.size), rule["dim"], rule["n"], -(-length // rule["n"]), length), chunks.find
            )
            continue
        entry["chunks"] = len(md.chunks)
        first: dict[tuple[int, ...], int] = {}
        for i, chunk in enumerate(md.chunks):
            chunk_offsets.extend(chunk.offsets)
            chunk_sizes.extend(chunk.sizes)
            first.setdefault(tuple(chunk.offsets), i)
        table.add(fqn, entry, (2, len(md.size), 0, len(md.chunks), 0, 0), listed(first))
    rows = _Rows(table)
    if results is not None:
        rows.add_results(results)
    elif storage is not None:
        for seq, (index, info) in enumerate(storage.items()):
            rows.add(seq, index, info)
    header: dict[str, Any] = {
        "format": "dcp_s3.compact",
        "version": FORMAT_VERSION,
        "metadata_version": getattr(metadata, "version", None),
        "planner_data": tag(metadata.planner_data),
        "storage_meta": _storage_meta(metadata),
        "entries": table.headers,
        "chunk_offsets": arrays.add("chunk_offsets", np.array(chunk_offsets, dtype=np.uint64)),
        "chunk_sizes": arrays.add("chunk_sizes", np.array(chunk_sizes, dtype=np.uint64)),
    }
    section = rows.section(arrays, with_columns=results is not None or storage is not None)
    header["stored_chunks"] = arrays.add("stored_chunks", rows.stored_chunks)
    if section is not None:
        header["storage"] = section
    header["arrays"] = arrays.table
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, b"\0" * (-len(head) % 8), *arrays.parts])


class _Rows:
    """Storage entries as rows (see the module doc)."""

    def __init__(self, entries: Entries) -> None:
        self.entries = entries
        self.single = array("q")  # rows added from objects: entry, chunk, seq, frame (-1 or in framed), *_ROW
        self.packs: list[tuple[Any, int]] = []  # (PackedResults, seq of its first result)
        self.framed: list[Framed] = []  # frame indexes of the rows added from objects
        self.blocks: list[int] = []  # block checksums of the rows added from objects, in row order
        self.frame_tables: list[FrameTable] = []  # of packed rows: the frames table is framed's, then these
        self.objects: dict[str, int] = {}
        self.transforms: dict[str, int] = {}  # JSON of the tagged descriptors -> id
        self.tagged: list[Any] = []
        self.stored_chunks = np.zeros(0, np.uint32)

    def transform(self, descriptors: Any) -> int:
        if descriptors is None:
            return -1
        value = tag(descriptors)
        key = json.dumps(value)
        t = self.transforms.get(key)
        if t is None:
            t = self.transforms[key] = len(self.tagged)
            self.tagged.append(value)
        return t

    def add(self, seq: int, index: Any, info: _StorageInfo) -> None:
        """One storage entry from objects, checked as the format requires."""
        e = self.entries.number.get(index.fqn) if type(index) is MetadataIndex else None
        if e is None:
            raise _unsupported(f"storage key {getattr(index, 'fqn', index)!r} names no state-dict entry")
        c = self.entries.chunk(e, index.offset)
        if c is None:
            raise _unsupported(no_chunk(index.fqn, index.offset))
        kind = {_StorageInfo: KIND_STORAGE_INFO, ItemLocation: KIND_ITEM_LOCATION}.get(type(info))
        if (
            kind is None
            or type(info.relative_path) is not str
            or type(info.offset) is not int
            or type(info.length) is not int
        ):
            raise _unsupported(f"storage entry {index.fqn!r}: {type(info).__name__} {info!r}"[:300])
        payload = crc = block = None
        block_crcs: tuple[int, ...] = ()
        frame = -1
        if isinstance(info, ItemLocation):
            payload, crc, block = info.payload_offset, info.crc32c, info.block_size
            if info.block_crc32c is not None:
                block_crcs = info.block_crc32c
                if type(block_crcs) is not tuple or not all(type(v) is int and 0 <= v < 1 << 32 for v in block_crcs):
                    raise _unsupported(f"storage entry {index.fqn!r}: block checksums {block_crcs!r}"[:300])
            if info.frames is not None:
                if type(info.frames) is not FrameIndex or type(info.frames.codec) is not str:
                    raise _unsupported(
                        f"storage entry {index.fqn!r}: a frame index of type {type(info.frames).__name__}"
                    )
                if not FrameTable.fits(info.frames, info.frame_crc32c):
                    raise _unsupported(
                        f"storage entry {index.fqn!r}: frame checksums that do not match its frame index"
                    )
                frame = len(self.framed)
                self.framed.append((info.frames, info.frame_crc32c))
            elif info.frame_crc32c is not None:
                raise _unsupported(f"storage entry {index.fqn!r}: frame checksums without frames")
        if index.index is not None and (type(index.index) is not int or index.index < 0):
            raise _unsupported(f"storage entry {index.fqn!r}: index hint {index.index!r}")
        values = (
            kind,
            self.objects.setdefault(info.relative_path, len(self.objects)),
            info.offset,
            info.length,
            self.transform(getattr(info, "transform_descriptors", None)),
            _opt(payload),
            _opt(crc),
            _opt(index.index),
            _opt(block),
            len(block_crcs),
        )
        for name, value in zip(_ROW, values, strict=True):
            if type(value) is not int or not -1 <= value < _LIMIT:
                raise _unsupported(f"storage entry {index.fqn!r}: {name} {value!r}")
        self.single.extend((e, c, seq, frame, *values))
        self.blocks.extend(block_crcs)

    def add_results(self, results: Iterable[Sequence[WriteResult]]) -> None:
        """Every rank's results, in order (a later result for the same chunk replaces an earlier one)."""
        seq = 0
        for per_rank in results:
            if type(per_rank) is PackedResults:
                for pos, result in per_rank.extras:
                    self.add(seq + pos, result.index, result.storage_data)
                self.packs.append((per_rank, seq))
            else:
                for pos, result in enumerate(per_rank):
                    self.add(seq + pos, result.index, result.storage_data)
            seq += len(per_rank)

    def _packed_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's packed rows: entry, chunk, seq, frame (-1 or its index), columns (rows x ``_ROW``).

        A first pass maps each rank's tables (names, objects, transforms) to global ids with
        a few Python steps per rank; then ranks are taken in batches of about ``_BATCH_ROWS``
        rows, each found and renumbered with array steps on data small enough to stay in cache.
        """
        tables: dict[tuple[bytes, bytes], int] = {}  # (name digest, ndims) -> where its names start below
        to_entry: list[int] = []
        ndims: list[int] = []
        objects: list[int] = []
        transforms: list[int] = []
        ranks: list[tuple[Any, ...]] = []  # (packed, seq base, and where its names, objects, transforms, frames start)
        frame_base = len(self.framed)
        for pk, base in self.packs:
            key = (pk.digest, pk.ndim.tobytes())
            start = tables.get(key)
            if start is None:
                fqns = pk.fqns()
                missing = [f for f in fqns if f not in self.entries.number]
                if missing:
                    raise _unsupported(f"storage key {missing[0]!r} names no state-dict entry")
                start = tables[key] = len(to_entry)
                to_entry.extend(self.entries.number[f] for f in fqns)
                ndims.extend(pk.ndim.tolist())
            ranks.append((pk, base, start, len(objects), len(transforms), frame_base))
            if pk.frames is not None:
                self.frame_tables.append(pk.frames[1])
                frame_base += len(pk.frames[1])
            objects.extend(self.objects.setdefault(name, len(self.objects)) for name in pk.objects)
            transforms.extend([*(self.transform(t) for t in pk.transforms), -1])  # the -1: none, at least one
        maps = (
            np.array(to_entry, np.int64),
            np.array(ndims, np.int64),
            np.array(objects, np.int64),
            np.array(transforms, np.int64),
        )
        width = max(pk.offsets.shape[1] for pk, _ in self.packs)
        total = sum(len(pk.ids) for pk, _ in self.packs)
        out = (
            np.empty(total, np.int64),
            np.empty(total, np.int64),
            np.empty(total, np.int64),
            np.full(total, -1, np.int64),
            np.empty((total, len(_ROW)), np.int64),
        )
        first = rows = done = 0
        for i, (pk, *_) in enumerate(ranks):
            rows += len(pk.ids)
            if rows >= _BATCH_ROWS or i == len(ranks) - 1:
                self._batch(ranks[first : i + 1], maps, width, tuple(a[done : done + rows] for a in out))
                first, done, rows = i + 1, done + rows, 0
        return out

    def _batch(
        self, ranks: list[tuple[Any, ...]], maps: tuple[np.ndarray, ...], width: int, out: tuple[np.ndarray, ...]
    ) -> None:
        """Rows of ``ranks`` into ``out`` (entry, chunk, seq, frame, columns: slices of the whole)."""
        to_entry, ndims, objects, transforms = maps
        entry_out, chunk_out, seq, frame, cols = out
        lens = np.array([len(pk.ids) for pk, *_ in ranks], np.int64)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))

        def per_row(values: list[int]) -> np.ndarray:
            return np.repeat(np.array(values, np.int64), lens)

        names = per_row([r[2] for r in ranks]) + np.concatenate([pk.ids for pk, *_ in ranks])
        entry, ndim = to_entry[names], ndims[names]
        offsets = np.concatenate(
            [
                pk.offsets
                if pk.offsets.shape[1] == width
                else np.pad(pk.offsets, ((0, 0), (0, width - pk.offsets.shape[1])), constant_values=-1)
                for pk, *_ in ranks
            ]
        )
        chunk = self.entries.numbers(entry, offsets, ndim)
        if (chunk < 0).any():
            i = int(np.flatnonzero(chunk < 0)[0])
            raise _unsupported(no_chunk(self.entries.fqns[int(entry[i])], offsets[i, : ndim[i]].tolist()))
        entry_out[:], chunk_out[:] = entry, chunk
        fields = np.concatenate([pk.fields for pk, *_ in ranks])  # dcp_s3._packed.results.FIELDS
        cols[:, 0] = KIND_ITEM_LOCATION
        cols[:, 1] = objects[per_row([r[3] for r in ranks]) + fields[:, 0]]
        cols[:, 2:4] = fields[:, 1:3]
        local = fields[:, 4]
        cols[:, 4] = np.where(local < 0, -1, transforms[per_row([r[4] for r in ranks]) + np.maximum(local, 0)])
        cols[:, 5:] = fields[:, 5:]
        seq[:] = per_row([r[1] for r in ranks]) + np.arange(len(fields)) - np.repeat(starts, lens)
        for (pk, base, *_, frame_base), at in zip(ranks, starts.tolist(), strict=True):
            if pk.extras:  # its rows are not its first results: their positions
                seq[at : at + len(pk.ids)] = base + pk.row_positions()
            if pk.frames is not None:
                frame[at + pk.frames[0]] = frame_base + np.arange(len(pk.frames[0]))

    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """entry, chunk, seq, frame and the columns (rows x ``_ROW``) of every row."""
        single = np.frombuffer(self.single, np.int64).reshape(-1, 4 + len(_ROW))
        rows = (single[:, 0], single[:, 1], single[:, 2], single[:, 3], single[:, 4:])
        if not self.packs:
            return rows
        packed = self._packed_rows()
        return packed if not len(single) else tuple(np.concatenate(pair) for pair in zip(packed, rows, strict=True))  # type: ignore[return-value]

    def section(self, arrays: ArraysBuilder, with_columns: bool) -> dict[str, Any] | None:
        """The storage section of the header (None without columns); fills ``stored`` in each
        entry's header and ``stored_chunks``."""
        entry, chunk, seq, frame, cols = self._rows()
        order = self.entries.ordered(self.entries.keys(entry, chunk), seq)
        e, c, frame = entry[order], chunk[order], frame[order]
        values = dict(zip(_ROW, cols[order].T, strict=True))
        objects = _by_name(values["object"], list(self.objects))
        transforms = _by_name(values["transform"], list(self.transforms))
        framed = frame >= 0
        frames = FrameTable.concat([FrameTable.of(self.framed), *self.frame_tables]).take(frame[framed])
        frame[framed] = np.arange(len(frames))
        counts = np.bincount(e, minlength=len(self.entries.fqns))
        bounds = np.concatenate(([0], np.cumsum(counts)))
        stored: list[np.ndarray] = []
        for i, (header, spec) in enumerate(zip(self.entries.headers, self.entries.spec, strict=True)):
            if spec[0] == 0:
                header["bytes"] = int(counts[i])
            elif counts[i] == spec[3]:  # every chunk (numbers are unique and below the count)
                header["stored"] = "all"
            else:
                header["stored"] = int(counts[i])
                stored.append(c[bounds[i] : bounds[i + 1]])
        self.stored_chunks = np.concatenate(stored).astype(np.uint32) if stored else np.zeros(0, np.uint32)
        if not with_columns:
            return None
        values["object"], values["transform"], values["frame"] = objects[0], transforms[0], frame
        blocks = self._block_crcs(cols[:, _ROW.index("nblocks")], order)
        return {
            "count": len(e),
            "objects": objects[1],
            "transforms": [self.tagged[self.transforms[k]] for k in transforms[1]],
            "columns": {name: arrays.column(f"s.{name}", values[name]) for name in STORAGE_COLUMNS},
            "frames": _frames(arrays, frames),
            "blocks": arrays.add("b.crcs", blocks.astype("<u4")),
        }

    def _block_crcs(self, nblocks: np.ndarray, order: np.ndarray) -> np.ndarray:
        """The block checksums of the rows ``order`` keeps, in that order (``nblocks``: each row's count,
        rows as ``_rows`` gives them: packed ranks' first, then those added from objects)."""
        crcs = np.concatenate([*(pk.blocks for pk, _ in self.packs), np.array(self.blocks, np.uint32)]).astype(np.int64)
        if len(crcs) != int(nblocks.sum()):
            raise _unsupported(f"{len(crcs)} block checksums for rows that count {int(nblocks.sum())}")
        starts = np.cumsum(nblocks) - nblocks
        kept = nblocks[order]
        if not int(kept.sum()):
            return np.zeros(0, np.int64)
        first = np.repeat(starts[order] - (np.cumsum(kept) - kept), kept)
        return crcs[first + np.arange(int(kept.sum()))]


def _by_name(ids: np.ndarray, names: list[str]) -> tuple[np.ndarray, list[str]]:
    """``ids`` (into ``names``; -1 kept) renumbered into the used names, sorted."""
    used = np.flatnonzero(np.bincount(ids[ids >= 0], minlength=len(names)))
    kept = sorted(used.tolist(), key=names.__getitem__)
    renumber = np.full(len(names) + 1, -1, np.int64)  # [-1]: none
    renumber[kept] = np.arange(len(kept))
    return renumber[ids], [names[i] for i in kept]


def _frames(arrays: ArraysBuilder, table: FrameTable) -> dict[str, Any]:
    out: dict[str, Any] = {"count": len(table), "codecs": table.codecs}
    out["columns"] = {c: arrays.column(f"f.{c}", table.rows[:, i]) for i, c in enumerate(FRAME_COLUMNS)}
    out["ends"] = arrays.add("f.ends", _narrow(table.ends) if len(table.ends) else table.ends)
    out["crcs"] = arrays.add("f.crcs", table.crcs.astype("<u4"))
    out["raw"] = arrays.add("f.raw", table.raw.astype("<u1"))
    return out


def _storage_meta(metadata: Metadata) -> dict[str, Any] | None:
    meta = metadata.storage_meta
    if meta is None:
        return None
    return {
        "checkpoint_id": tag(meta.checkpoint_id),
        "save_id": tag(meta.save_id),
        "load_id": tag(meta.load_id),
        "modules": tag(meta.modules),
    }


def _opt(value: int | None) -> int:
    return -1 if value is None else value
