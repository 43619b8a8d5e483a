"""Lazy chunk lists of compact metadata (``dcp_s3._metadata.compact_read``) and the reader's chunk index.

``RuleChunks`` computes chunk ``i`` of a ``torch.chunk``-rule sharding, ``ExplicitChunks``
reads it from offset/size arrays; both find a chunk from its offsets and list the chunks
overlapping a box without walking all of them (``dcp_s3._planners.load``, ``S3StorageReader``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, overload

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from dcp_s3._untrusted.metadata_check import offsets_key

__all__ = ["RuleChunks", "ExplicitChunks", "ChunkLookup", "rule_chunk", "chunk_rule"]


def rule_chunk(size: Sequence[int], dim: int, n: int, i: int) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of chunk ``i`` of ``n`` along ``dim`` under ``torch.chunk``'s rule
    (every chunk ``ceil(d / n)`` rows, the trailing ones short or empty)."""
    d = size[dim]
    step = -(-d // n)
    lo = min(i * step, d)
    offsets = [0] * len(size)
    sizes = list(size)
    offsets[dim], sizes[dim] = lo, min(lo + step, d) - lo
    return offsets, sizes


def chunk_rule(size: torch.Size, chunks: Sequence[ChunkStorageMetadata]) -> dict[str, int] | None:
    """``{"dim", "n"}`` if ``chunks`` is exactly torch.chunk's split of ``size`` along one dim."""
    if type(chunks) is RuleChunks and chunks.size == size:  # the planner found the rule (dcp_s3._planners.vector)
        return {"dim": chunks.dim, "n": chunks.n}
    n = len(chunks)
    if n == 0:
        return None
    if not size:  # a scalar: one whole chunk
        return {"dim": -1, "n": 1} if n == 1 and not chunks[0].offsets and not chunks[0].sizes else None
    for dim in range(len(size)):
        if all(
            list(c.offsets) == off and list(c.sizes) == sz
            for i, c in enumerate(chunks)
            for off, sz in (rule_chunk(size, dim, n, i),)
        ):
            return {"dim": dim, "n": n}
        if n == 1:
            return None
        if chunks[0].sizes[dim] == size[dim]:  # whole along this dim: try the next one
            continue
        return None
    return None


class RuleChunks(Sequence[ChunkStorageMetadata]):
    """The chunks of ``torch.chunk``'s split of ``size`` into ``n`` along ``dim`` (``-1``: a scalar).

    Code that walks every chunk (torch's ``DefaultLoadPlanner`` does, several times per
    tensor) gets them from a list built on the first walk and kept for the last tensor walked
    only, so memory stays one tensor's chunks.
    """

    _last: ClassVar[tuple[RuleChunks, list[ChunkStorageMetadata]] | None] = None

    def __init__(self, size: torch.Size, dim: int, n: int) -> None:
        self.size, self.dim, self.n = size, dim, n
        self._step = -(-size[dim] // n) if dim >= 0 else 0

    def __len__(self) -> int:
        return self.n

    def _listed(self) -> list[ChunkStorageMetadata] | None:
        last = RuleChunks._last
        return last[1] if last is not None and last[0] is self else None

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        listed = self._listed()
        if listed is None:
            listed = [self._chunk(i) for i in range(self.n)]
            RuleChunks._last = (self, listed)
        return iter(listed)

    @overload
    def __getitem__(self, i: int) -> ChunkStorageMetadata: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkStorageMetadata]: ...
    def __getitem__(self, i: int | slice) -> ChunkStorageMetadata | list[ChunkStorageMetadata]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        listed = self._listed()
        return listed[i] if listed is not None else self._chunk(i % self.n)

    def as_list(self, known: dict[tuple[int, ...], torch.Size]) -> list[ChunkStorageMetadata]:
        """The chunks as a new list, equal offsets and sizes sharing one ``torch.Size`` from ``known``
        (which the caller keeps across tensors): a stock pickle then writes each once."""
        if self.dim < 0:
            return [self._chunk(0)]
        size, dim, d = list(self.size), self.dim, self.size[self.dim]
        lo = np.minimum(np.arange(self.n, dtype=np.int64) * self._step, d)
        new, out = object.__new__, []
        for start, rows in zip(lo.tolist(), (np.minimum(lo + self._step, d) - lo).tolist(), strict=True):
            offsets, sizes = (0,) * dim + (start,) + (0,) * (len(size) - dim - 1), (*size[:dim], rows, *size[dim + 1 :])
            a, b = known.get(offsets), known.get(sizes)
            if a is None:
                a = known[offsets] = torch.Size(offsets)
            if b is None:
                b = known[sizes] = torch.Size(sizes)
            chunk = new(ChunkStorageMetadata)
            chunk.__dict__ = {"offsets": a, "sizes": b}  # what the dataclass's __init__ sets, at a fraction of it
            out.append(chunk)
        return out

    def _chunk(self, i: int) -> ChunkStorageMetadata:
        if self.dim < 0:
            return ChunkStorageMetadata(torch.Size([]), torch.Size([]))
        offsets, sizes = rule_chunk(self.size, self.dim, self.n, i)
        return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    def find(self, offsets: Sequence[int]) -> int | None:
        """Index of the first chunk at ``offsets``, or None."""
        if self.dim < 0:
            return 0 if len(offsets) == 0 else None
        if len(offsets) != len(self.size) or any(o != 0 for k, o in enumerate(offsets) if k != self.dim):
            return None
        lo, d = offsets[self.dim], self.size[self.dim]
        if lo > d:
            i = None
        elif self._step == 0:
            i = 0 if lo == 0 else None
        elif lo == d:
            i = -(-d // self._step)
        elif lo % self._step == 0:
            i = lo // self._step
        else:
            i = None
        return i if i is not None and i < self.n else None

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[int]:
        """Ascending indices of a superset of the chunks that overlap the box ``offsets``/``sizes``
        under torch's rule (``_check_shard_metadata_pair_overlap``), which the caller applies."""
        if self.dim < 0:
            yield 0
            return
        if self._step == 0:
            return
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        yield from range(max(0, lo // self._step), min(self.n, -(-hi // self._step)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self.n and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RuleChunks(size={list(self.size)}, dim={self.dim}, n={self.n})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RuleChunks, (self.size, self.dim, self.n))


class ExplicitChunks(Sequence[ChunkStorageMetadata]):
    """Chunks read from (n, ndim) offset and size arrays."""

    def __init__(self, size: torch.Size, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.size, self.offsets, self.sizes = size, offsets, sizes
        self._sorted: tuple[np.ndarray, list[tuple[int, ...]]] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> ChunkStorageMetadata: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkStorageMetadata]: ...
    def __getitem__(self, i: int | slice) -> ChunkStorageMetadata | list[ChunkStorageMetadata]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return ChunkStorageMetadata(torch.Size(self.offsets[i].tolist()), torch.Size(self.sizes[i].tolist()))

    def find(self, offsets: Sequence[int]) -> int | None:
        if len(offsets) != len(self.size):
            return None
        if self._sorted is None:  # lexicographic order, stable: equal offsets keep chunk order
            order = np.lexsort(self.offsets.T[::-1]) if len(self.size) else np.arange(len(self))
            self._sorted = (order, [tuple(row) for row in self.offsets[order].tolist()])
        order, rows = self._sorted
        key = tuple(offsets)
        k = bisect.bisect_left(rows, key)
        return int(order[k]) if k < len(rows) and rows[k] == key else None

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[int]:
        """Ascending indices of the chunks that overlap the box under torch's rule."""
        lo = np.asarray(offsets, dtype=np.int64)
        hi = lo + np.asarray(sizes, dtype=np.int64)
        mask = ((lo < self.offsets + self.sizes) & (self.offsets < hi)).all(axis=1)
        return iter(np.flatnonzero(mask).tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (ExplicitChunks, (self.size, self.offsets, self.sizes))


class ChunkLookup:
    """``(sizes, dtype)`` of the stored chunk of a tensor at given offsets, found when asked.

    The reader's index of chunks: a lazy sequence finds a chunk from its offsets directly;
    a plain list (stock metadata) is indexed per tensor on the tensor's first lookup, so a
    rank pays for the tensors it reads, not for every chunk of the checkpoint.
    """

    def __init__(self, metadata: Metadata) -> None:
        self._state = metadata.state_dict_metadata
        self._tables: dict[str, dict[str, torch.Size]] = {}

    def find(self, fqn: str, offsets: Sequence[int]) -> tuple[torch.Size, torch.dtype] | None:
        """The chunk of tensor ``fqn`` stored at ``offsets``, or None if there is none."""
        md = self._state.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            return None
        find = getattr(md.chunks, "find", None)
        if find is not None:
            c = find(list(offsets))
            return None if c is None else (md.chunks[c].sizes, md.properties.dtype)
        table = self._tables.get(fqn)
        if table is None:
            table = self._tables[fqn] = {offsets_key(chunk.offsets): chunk.sizes for chunk in md.chunks}
        sizes = table.get(offsets_key(offsets))
        return None if sizes is None else (sizes, md.properties.dtype)
