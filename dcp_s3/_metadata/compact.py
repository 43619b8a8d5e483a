"""The compact ``.metadata`` format: written by ``dcp_s3._metadata.compact_write``, read by ``dcp_s3._metadata.compact_read``.

A stock ``.metadata`` is a pickle holding one ``ChunkStorageMetadata`` and one storage entry
object per chunk: at 16,384 FSDP ranks (Llama-70B-like) that is ~5.4 GB and minutes of
unpickling on every rank. The compact format describes the same ``Metadata``:

    MAGIC (8 bytes) | header length (u64 LE) | header (JSON, UTF-8) | packed little-endian arrays

* state-dict entries in a JSON list; a tensor's chunks by a **rule** when they are
  ``torch.chunk``'s split along one dimension (FSDP's sharding: ``n`` chunks of
  ``ceil(d / n)`` rows, trailing ones possibly empty, every other dimension whole), else
  explicit offset/size arrays;
* object names and transform descriptors in tables;
* storage entries sorted by (state-dict entry, chunk): which chunks have one (all of them,
  or an explicit chunk list), then one *column* per field (object index, offset, length,
  payload offset, CRC32C, frame index, the ``MetadataIndex.index`` hint, the entry's
  class, and since format ``dcp_s3/2`` the block size and block count of a raw item's
  ``block_crc32c``, whose checksums are concatenated in one array).  A column is a constant, an arithmetic sequence, a repeated arithmetic period
  (optionally followed by a tail column: FSDP's rank-periodic object numbers), runs, or an
  explicit array of the narrowest integer type that holds it;
* codec frame indexes (``codec.FrameIndex``) as columns plus concatenated frame ends,
  frame CRCs and raw-frame bit masks;
* ``planner_data``, ``storage_meta`` and transform descriptors as tagged JSON values
  (containers, str, int, float, bool, None, ``torch.Size``, posix paths).

Metadata holding anything else (another ``_StorageInfo`` subclass, a planner_data object)
cannot be written compactly: ``dump_compact`` raises ``ConfigError`` and the writer's
``metadata_format="auto"`` falls back to the stock pickle.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3._codec.frame_table import FIELDS as FRAME_FIELDS
from dcp_s3.errors import ConfigError

__all__ = ["MAGIC", "FORMAT_VERSION", "chunk_count", "DTYPES", "LAYOUTS", "MEMORY_FORMATS", "ArraysBuilder"]

#: First bytes of a compact ``.metadata`` (a pickle starts with ``\x80``).
MAGIC = b"\x89DCPS3M\n"
FORMAT_VERSION = 1
#: Storage columns, in the order they are written.
STORAGE_COLUMNS = (
    "kind",
    "object",
    "offset",
    "length",
    "transform",
    "payload",
    "crc",
    "frame",
    "hint",
    "block",
    "nblocks",
)
#: Columns that files written before block checksums lack, and the value each entry then has (readers of
#: those releases ignore them: such a file still loads there, its reads checked as they always were).
OPTIONAL_COLUMNS = {"block": -1, "nblocks": 0}
FRAME_COLUMNS = FRAME_FIELDS
#: ``kind`` column values.
KIND_STORAGE_INFO, KIND_ITEM_LOCATION = 0, 1

DTYPES: dict[str, torch.dtype] = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
LAYOUTS: dict[str, torch.layout] = {n: v for n, v in vars(torch).items() if isinstance(v, torch.layout)}
MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_INT_TYPES = ("<u1", "<u2", "<u4", "<u8", "<i1", "<i2", "<i4", "<i8")


def chunk_count(metadata: Metadata) -> int:
    """Stored chunks of ``metadata``'s tensors: what a stock ``.metadata``'s size grows with."""
    return sum(len(md.chunks) for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))


def _unsupported(what: str) -> ConfigError:
    return ConfigError(f"metadata cannot be written in the compact format: {what}")


def tag(value: Any) -> Any:
    """``value`` as JSON with containers tagged so that list/tuple/dict/Size round-trip."""
    if value is None or type(value) in (bool, int, str, float):
        return value
    if type(value) is torch.Size:
        return {"S": list(value)}
    if type(value) is list:
        return {"L": [tag(v) for v in value]}
    if type(value) is tuple:
        return {"T": [tag(v) for v in value]}
    if type(value) is dict:
        return {"D": [[tag(k), tag(v)] for k, v in value.items()]}
    if type(value) in (pathlib.PosixPath, pathlib.PurePosixPath):
        return {"P" if type(value) is pathlib.PosixPath else "PP": str(value)}
    raise _unsupported(f"a {type(value).__name__} value")


class ArraysBuilder:
    """The packed array section, built while the header is."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.table: dict[str, list[Any]] = {}

    def add(self, name: str, values: np.ndarray) -> str:
        dtype = f"<{values.dtype.kind}{values.dtype.itemsize}"
        assert dtype in _INT_TYPES, dtype
        raw = values.astype(dtype, copy=False).tobytes()
        self.table[name] = [dtype, self.size, len(values)]
        pad = -len(raw) % 8
        self.parts.append(raw + b"\0" * pad)
        self.size += len(raw) + pad
        return name

    def column(self, name: str, values: np.ndarray, *, split: bool = True) -> dict[str, Any]:
        """The smallest description of an int64 column (see the module doc)."""
        n = len(values)
        if n == 0:
            return {"c": 0}
        first = int(values[0])
        if n == 1 or bool((values == first).all()):
            return {"c": first}
        diff = np.diff(values)
        step = int(diff[0])
        if bool((diff == step).all()):
            return {"a": [first, step]}
        period = int(np.flatnonzero(diff != step)[0]) + 1
        if period > 1:
            base = first + step * np.arange(period, dtype=np.int64)
            rows = values[: n - n % period].reshape(-1, period) == base
            whole = int(np.argmin(rows.all(axis=1))) if not rows.all() else len(rows)  # leading periods that match
            if whole * period == n:
                return {"m": [period, first, step]}
            if split and whole >= 2 and whole * period * 2 >= n:  # a periodic head (FSDP's ranks) and a tail
                head = whole * period
                return {
                    "s": [
                        [{"m": [period, first, step]}, head],
                        [self.column(f"{name}.t", values[head:], split=False), n - head],
                    ]
                }
        starts = np.concatenate(([0], np.flatnonzero(diff != 0) + 1))
        if len(starts) * 4 <= n:
            lengths = np.diff(np.concatenate((starts, [n])))
            return {"r": [self.add(f"{name}.v", _narrow(values[starts])), self.add(f"{name}.n", _narrow(lengths))]}
        return {"x": self.add(name, _narrow(values))}


def _narrow(values: np.ndarray) -> np.ndarray:
    lo, hi = int(values.min()), int(values.max())
    kinds = ("<u1", "<u2", "<u4", "<u8") if lo >= 0 else ("<i1", "<i2", "<i4", "<i8")
    for kind in kinds:
        info = np.iinfo(np.dtype(kind))
        if info.min <= lo and hi <= info.max:
            return values.astype(kind)
    raise _unsupported("an integer beyond 64 bits")  # pragma: no cover  # int64 input


def _properties(props: TensorProperties) -> dict[str, Any]:
    if type(props) is not TensorProperties:
        raise _unsupported(f"tensor properties of type {type(props).__name__}")
    names = {
        "dtype": next((n for n, v in DTYPES.items() if v == props.dtype), None),
        "layout": next((n for n, v in LAYOUTS.items() if v == props.layout), None),
        "memory_format": next((n for n, v in MEMORY_FORMATS.items() if v == props.memory_format), None),
    }
    if None in names.values() or type(props.requires_grad) is not bool or type(props.pin_memory) is not bool:
        raise _unsupported(f"tensor properties {props}")
    out: dict[str, Any] = {**names, "requires_grad": props.requires_grad, "pin_memory": props.pin_memory}
    for field in dataclasses.fields(props):  # fields newer torch releases add (2.15: strides)
        value = getattr(props, field.name)
        if field.name in out or value is None:
            continue
        if field.name != "strides" or type(value) not in (tuple, list) or any(type(x) is not int for x in value):
            raise _unsupported(f"tensor property {field.name}={value!r}")
        out["strides"] = list(value)
    return out
