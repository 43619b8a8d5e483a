"""Do a tensor's chunks, as untrusted metadata describes them, cover it exactly once?

A reader that allocates what the metadata describes (``convert``, torch's ``_EmptyStateDictLoadPlanner``) would
otherwise hand on memory it never read into. :func:`pairwise_problem` answers for a few chunks,
:func:`tiling_problem` for many (numpy, bounded work).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

__all__ = ["PAIRWISE", "MAX_SWEEP_PAIRS", "pairwise_problem", "tiling_problem"]


#: Up to this many chunks, a tensor's are compared pair by pair in Python (cheaper than numpy's set-up).
PAIRWISE = 8


def pairwise_problem(size: torch.Size, chunks: Sequence[ChunkStorageMetadata]) -> str | None:
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
