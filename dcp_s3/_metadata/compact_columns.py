"""The column decoding of compact metadata: tagged values, the arrays table and ``Column``.

Every storage field of a compact ``.metadata`` is a ``Column`` (see ``dcp_s3._metadata.compact``); column-wide
bounds (table indices, value ranges) are checked at decode without expanding a column. Input is untrusted: every
malformed value is a ``CheckpointFormatError``.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import torch

from dcp_s3._untrusted.metadata_check import MAX_OFFSET
from dcp_s3._untrusted.metadata_pickle import MAX_INT_KEY, MAX_NDIM, describe
from dcp_s3.errors import CheckpointFormatError

__all__ = ["ArraysReader", "Column", "untag"]

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
