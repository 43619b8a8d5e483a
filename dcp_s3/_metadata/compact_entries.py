"""The state-dict entries of a compact ``.metadata`` being written, and how a storage entry's
offsets find its chunk number: one at a time (``RuleChunks.find`` or a dict) or for many rows
at once with array steps (``dcp_s3._metadata.compact_write``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Entries", "Finder", "listed", "no_chunk"]

Finder = Callable[[Sequence[int]], "int | None"]


class Entries:
    """The state-dict entries in order, and how a storage key's offsets find its chunk: per entry
    a finder (``RuleChunks.find`` or a dict; None for bytes) and, for finding many at once,
    (kind 0 bytes / 1 rule / 2 explicit, ndim, dim, n, step, length along dim)."""

    def __init__(self) -> None:
        self.fqns: list[str] = []
        self.number: dict[str, int] = {}
        self.headers: list[dict[str, Any]] = []
        self.spec: list[tuple[int, ...]] = []
        self.finders: list[Finder | None] = []
        self._array: np.ndarray | None = None

    def add(self, fqn: str, header: dict[str, Any], spec: tuple[int, ...], find: Finder | None) -> None:
        self.number[fqn] = len(self.fqns)
        self.fqns.append(fqn)
        self.headers.append(header)
        self.spec.append(spec)
        self.finders.append(find)
        self._array = None

    def chunk(self, e: int, offset: Sequence[int] | None) -> int | None:
        """The chunk number of entry ``e`` stored at ``offset`` (None: a byte entry's key), or None."""
        find = self.finders[e]
        if find is None or offset is None:
            return 0 if find is None and offset is None else None
        return find(offset)

    def array(self) -> np.ndarray:
        """``spec`` as an (entries, 6) array (built once: every batch of rows looks into it)."""
        if self._array is None:
            self._array = np.array(self.spec, np.int64).reshape(-1, 6)
        return self._array

    def keys(self, entry: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        """Each (entry, chunk)'s place among all chunks of all entries (a byte entry has one)."""
        spec = self.array()
        count = np.where(spec[:, 0] == 0, 1, spec[:, 3])
        return np.concatenate(([0], np.cumsum(count)[:-1]))[entry] + chunk

    def ordered(self, key: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """The rows sorted by ``key`` (``keys``), the latest (``seq``) of each chunk only: without a
        sort when no chunk is written twice (the rule), each chunk's place being known."""
        spec = self.array()
        slots = int(np.where(spec[:, 0] == 0, 1, spec[:, 3]).sum())
        if not len(key) or int(np.bincount(key, minlength=slots).max()) <= 1:
            slot = np.full(slots, -1, np.int64)
            slot[key] = np.arange(len(key))
            return slot[slot >= 0]
        order = np.lexsort((seq, key))
        k = key[order]
        return order[np.r_[k[1:] != k[:-1], True]]

    def numbers(
        self, entries: np.ndarray, offsets: np.ndarray, ndims: np.ndarray, spec: np.ndarray | None = None
    ) -> np.ndarray:
        """Chunk numbers (-1: none) of rows of ``entries`` at ``offsets`` (padded) of ``ndims`` dimensions
        (``spec``: ``array()[entries]``, if the caller has it)."""
        spec = self.array()[entries] if spec is None else spec
        out = _rule_numbers(offsets, ndims, spec)
        for i in np.flatnonzero(spec[:, 0] == 2).tolist():
            find = self.finders[int(entries[i])]
            found = find(offsets[i, : ndims[i]].tolist()) if find is not None else None
            out[i] = -1 if found is None else found
        return out


def _rule_numbers(offsets: np.ndarray, ndims: np.ndarray, spec: np.ndarray) -> np.ndarray:
    """``RuleChunks.find`` on rows at once: -1 where the entry is no rule or no chunk starts there."""
    out = np.full(len(ndims), -1, np.int64)
    kind, ndim, dim, n, step, length = spec.T
    rule = (kind == 1) & (ndims == ndim)
    out[rule & (dim < 0)] = 0  # a scalar's one chunk
    rows = np.flatnonzero(rule & (dim >= 0))
    if not len(rows):
        return out
    d, lo = dim[rows], offsets[rows, dim[rows]]
    width = np.arange(offsets.shape[1])
    others = (width < ndims[rows, None]) & (width != d[:, None])
    whole = ~((offsets[rows] != 0) & others).any(axis=1)
    st, ln = step[rows], length[rows]
    safe = np.maximum(st, 1)
    c = np.where(lo == ln, -(-ln // safe), np.where(lo % safe == 0, lo // safe, -1))
    c = np.where(st == 0, np.where(lo == 0, 0, -1), c)
    ok = whole & (lo >= 0) & (lo <= ln) & (c >= 0) & (c < n[rows])
    out[rows[ok]] = c[ok]
    return out


def no_chunk(fqn: str, offsets: Sequence[int] | None) -> str:
    return f"storage entry {fqn!r} at {None if offsets is None else list(offsets)} matches no chunk of its entry"


def listed(first: dict[tuple[int, ...], int]) -> Finder:
    """The finder of explicitly listed chunks: the first chunk at those offsets."""
    return lambda offsets: first.get(tuple(offsets))
