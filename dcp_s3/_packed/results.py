"""A rank's write results as arrays: what ``S3StorageWriter.write_data`` sends to the coordinator.

torch gathers every rank's ``list[WriteResult]`` to the coordinator for ``finish`` as a pickle of
per-item objects (``WriteResult``, ``MetadataIndex``, ``torch.Size``, the storage entry): ~420
bytes and ~6 us of unpickling per item, serially on the coordinator. At 16,384 ranks of a
Llama-70B FSDP job that is 11.8 million items, ~5 GB and over a minute, on every save.

:class:`PackedResults` holds the same results as a table of the rank's tensor names (one
string, with a digest, so the coordinator decodes each distinct table once), a table of its
object names and transform descriptors, and integer arrays (one row per item). It pickles as
those, and is a read-only sequence of the very ``WriteResult`` objects it was made from (built
on first access on another process), so code that walks the results sees ordinary ones; the
compact metadata encoder reads the arrays directly (:mod:`dcp_s3._metadata.compact_write`). Results that
do not fit (byte items, another writer's entries) ride along as objects.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from dcp_s3._codec.frame_table import Framed, FrameTable
from dcp_s3._layout import ItemLocation
from dcp_s3._packed.plans import PackedSequence

__all__ = ["PackedResults", "FIELDS"]

#: Integer fields of a row, in ``PackedResults.fields`` order (-1 stands for None).
FIELDS = ("object", "offset", "length", "size", "transform", "payload", "crc", "hint", "block", "nblocks")
_LIMIT = 1 << 63


class PackedResults(PackedSequence[WriteResult]):
    """One rank's ``WriteResult`` list as arrays (see the module doc); equal, as a sequence, to the list."""

    def __init__(self, state: tuple[Any, ...]) -> None:
        # names (b"\0"-joined tensor names) and their digest; ndim per name; objects; transforms;
        # per row: ids (into names), offsets (padded with -1), fields (rows x FIELDS); frames: None or
        # (the compressed rows, their frame indexes as a FrameTable); extras: (position, WriteResult);
        # blocks: every row's ``block_crc32c`` (``nblocks`` of them, in row order) as one uint32 array.
        (
            self.names,
            self.digest,
            self.ndim,
            self.objects,
            self.transforms,
            self.ids,
            self.offsets,
            self.fields,
            self.frames,
            self.extras,
            self.blocks,
        ) = state
        self._results: list[WriteResult] | None = None

    def _state(self) -> tuple[Any, ...]:
        return (
            self.names,
            self.digest,
            self.ndim,
            self.objects,
            self.transforms,
            self.ids,
            self.offsets,
            self.fields,
            self.frames,
            self.extras,
            self.blocks,
        )

    @classmethod
    def pack(cls, results: list[WriteResult]) -> PackedResults | list[WriteResult]:
        """``results`` packed, or the list itself when fewer than half of them fit the arrays."""
        names: dict[str, int] = {}
        ndim: list[int] = []
        objects: dict[str, int] = {}
        transforms: list[Any] = []
        ids: list[int] = []
        offsets: list[torch.Size] = []
        fields: list[tuple[int, ...]] = []
        framed_rows: list[int] = []
        framed: list[Framed] = []
        extras: list[tuple[int, WriteResult]] = []
        blocks: list[int] = []
        for pos, result in enumerate(results):
            row = _row(result, objects, transforms)
            offset = result.index.offset
            if row is None or offset is None:
                extras.append((pos, result))
                continue
            fid = names.setdefault(result.index.fqn, len(names))
            if fid == len(ndim):
                ndim.append(len(offset))
            elif ndim[fid] != len(offset):
                extras.append((pos, result))
                continue
            info = result.storage_data
            if info.frames is not None:
                framed_rows.append(len(ids))
                framed.append((info.frames, info.frame_crc32c))
            blocks.extend(info.block_crc32c or ())
            ids.append(fid)
            offsets.append(offset)
            fields.append(row)
        if len(ids) < len(extras) or not ids:
            return results
        width = max(ndim)
        padded = np.full((len(ids), width), -1, np.int64)
        for i, off in enumerate(offsets):
            padded[i, : len(off)] = off
        blob = "\0".join(names).encode()
        packed = cls(
            (
                blob,
                hashlib.blake2b(blob, digest_size=16).digest(),
                np.array(ndim, np.int64),
                list(objects),
                transforms,
                np.array(ids, np.int32),
                padded,
                np.array(fields, np.int64).reshape(-1, len(FIELDS)),
                (np.array(framed_rows, np.int64), FrameTable.of(framed)) if framed else None,
                extras,
                np.array(blocks, np.uint32),
            )
        )
        packed._results = results
        return packed

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedResults, (self._state(),))

    def fqns(self) -> list[str]:
        """The tensor names the rows' ``ids`` point into."""
        return self.names.decode().split("\0")

    def _objects(self) -> list[WriteResult]:
        return self.results()

    def __repr__(self) -> str:
        return f"PackedResults({len(self)} results in {len(self.objects)} objects)"

    def results(self) -> list[WriteResult]:
        """The ``WriteResult`` list, built once."""
        if self._results is not None:
            return self._results
        fqns = self.fqns()
        frames = (
            dict(zip(self.frames[0].tolist(), self.frames[1].framed(), strict=True)) if self.frames is not None else {}
        )
        out: list[WriteResult] = []
        block_crcs = self.blocks.tolist()
        at = 0
        for row, (fid, off, values) in enumerate(
            zip(self.ids.tolist(), self.offsets.tolist(), self.fields.tolist(), strict=True)
        ):
            obj, offset, length, size, t, payload, crc, hint, block, nblocks = values
            index, crcs = frames.get(row, (None, None))
            info = ItemLocation(
                self.objects[obj],
                offset,
                length,
                None if t < 0 else self.transforms[t],
                payload_offset=None if payload < 0 else payload,
                crc32c=None if crc < 0 else crc,
                frames=index,
                frame_crc32c=crcs,
                block_size=None if block < 0 else block,
                block_crc32c=tuple(block_crcs[at : at + nblocks]) if nblocks else None,
            )
            at += nblocks
            key = MetadataIndex(fqns[fid], off[: self.ndim[fid]], None if hint < 0 else hint)
            out.append(WriteResult(index=key, size_in_bytes=size, storage_data=info))
        for pos, extra in self.extras:
            out.insert(pos, extra)
        self._results = out
        return out


def _row(result: WriteResult, objects: dict[str, int], transforms: list[Any]) -> tuple[int, ...] | None:
    """``result``'s integer fields (``FIELDS``), or None when it does not fit a row."""
    index, info = result.index, result.storage_data
    if (
        type(result) is not WriteResult
        or type(index) is not MetadataIndex
        or type(index.fqn) is not str
        or "\0" in index.fqn
        or index.offset is None
        or type(info) is not ItemLocation
        or type(info.relative_path) is not str
    ):
        return None
    td = info.transform_descriptors
    t = -1
    if td is not None:
        if type(td) not in (list, tuple) or any(type(x) is not str for x in td):
            return None
        t = next((i for i, known in enumerate(transforms) if type(known) is type(td) and known == td), -1)
        if t < 0:
            t = len(transforms)
            transforms.append(td)
    if (info.frame_crc32c is not None or info.frames is not None) and not FrameTable.fits(
        info.frames, info.frame_crc32c
    ):
        return None
    block_crcs = info.block_crc32c
    if block_crcs is not None and (
        type(block_crcs) is not tuple or not all(type(c) is int and 0 <= c < 1 << 32 for c in block_crcs)
    ):
        return None
    values = (
        objects.setdefault(info.relative_path, len(objects)),
        info.offset,
        info.length,
        result.size_in_bytes,
        t,
        _opt(info.payload_offset),
        _opt(info.crc32c),
        _opt(index.index),
        _opt(info.block_size),
        len(block_crcs or ()),
    )
    if any(type(v) is not int or not -1 <= v < _LIMIT for v in values) or any(
        type(o) is not int or not 0 <= o < _LIMIT for o in index.offset
    ):
        return None
    return values


def _opt(value: int | None) -> int:
    return -1 if value is None else value
