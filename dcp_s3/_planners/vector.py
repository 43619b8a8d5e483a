"""The coordinator's save step on packed plans, with arrays: deduplication, index hints, metadata, checks.

Used by ``ScalableSavePlanner`` when every rank sent ``PackedItems`` whose only object items
are byte items (the usual case); otherwise :mod:`dcp_s3._planners.save` does the same per item. Same
results as torch's ``dedup_save_plans`` + ``create_default_global_save_plan`` +
``_validate_global_plan``:

* every item gets a key (tensor, linear index of its chunk's first element) — byte items a key
  of their own — and one stable sort over all items finds the indices planned more than once;
* those are given, in torch's order (the first rank planning them, then its position), to the
  holder with the fewest planned bytes: a holder's planned bytes at that point are the
  duplicates it already won, plus, for the first holder only, its unique items before that
  position (every other holder's unique items come later in torch's order) — so the loop runs
  once per duplicated index, over an array of its holders;
* hints are each kept chunk's rank among its tensor's chunks in (rank, position) order;
* a tensor whose kept chunks, in that order, are ``torch.chunk``'s split along one dimension
  (FSDP's sharding, HSDP's once its replicas are deduplicated) gets them as a
  ``RuleChunks(size, dim, n)``: equal to the list, pickled as three values, and built with no
  per-chunk object; it tiles the tensor by construction. Other tensors get the list of
  ``ChunkStorageMetadata``, the only per-item objects built, and the tiling checks on the same
  arrays (:func:`dcp_s3._planners.scale.tiles_as_slabs`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcp_s3._metadata.compact_chunks import RuleChunks
from dcp_s3._packed.plans import PackedItems
from dcp_s3._planners.save import as_items
from dcp_s3._torch_compat import element_size
from dcp_s3.errors import CheckpointFormatError

__all__ = ["rule_dim", "vector_global_plan"]

_SHARD = list(WriteItemType).index(WriteItemType.SHARD)
_LINEAR_LIMIT = 1 << 40  # elements per tensor for which (tensor id, linear offset) fits one int64


def vector_global_plan(
    all_plans: list[SavePlan], save_to_lowest_rank: bool
) -> tuple[list[SavePlan], Metadata, list[tuple[str, np.ndarray, np.ndarray]]] | None:
    """(global plans, metadata, per tensor with a chunk list (fqn, offsets, sizes) of its chunks) or
    None when some plan is not packed, holds object items other than byte items, or a tensor is too large to key."""
    packs = _packs(all_plans)
    items = None if packs is None else _Items.of(packs)
    if packs is None or items is None:
        return None
    kept = _dedup(items.key, items.rank_of, items.starts, items.size_of, save_to_lowest_rank)
    md, hints, tiles = _metadata(items, kept)
    new_plans = []
    for rank, (plan, pk) in enumerate(zip(all_plans, packs, strict=True)):
        if pk is None:
            new_plans.append(plan)
            continue
        lo, hi = int(items.starts[rank]), int(items.starts[rank + 1])
        mine, row = kept[lo:hi], items.row_of[lo:hi]
        rows = row[mine & (row >= 0)]
        extras = [(pos, item) for pos, item in pk.extras if mine[pos]]
        new_plans.append(
            dataclasses.replace(plan, items=as_items(pk.select(rows, extras, hints[lo:hi][mine & (row >= 0)])))
        )
    return new_plans, Metadata(md), tiles


def _packs(all_plans: list[SavePlan]) -> list[PackedItems | None] | None:
    """Each plan's packed items (None for an empty plan), or None if a plan is not packed or holds object items
    other than byte items."""
    packs: list[PackedItems | None] = []
    for plan in all_plans:
        items = plan.items
        if isinstance(items, PackedItems):
            if any(item.type != WriteItemType.BYTE_IO for _, item in items.extras):
                return None
            packs.append(items)
        elif len(items) == 0:
            packs.append(None)
        else:
            return None
    return packs


@dataclasses.dataclass
class _Items:
    """Every rank's items as arrays, rank after rank (rank r's at ``starts[r]:starts[r + 1]``): per item its key
    (global tensor id and linear offset; byte items below every tensor's), rank, torch's byte size, global tensor
    id (-1: a byte item), row in its plan's arrays (-1: a byte item), write type, offsets and lengths (padded);
    and the global tables: tensor ids by fqn with their properties and sizes, byte items' keys by fqn."""

    key: np.ndarray
    rank_of: np.ndarray
    size_of: np.ndarray
    g_of: np.ndarray
    row_of: np.ndarray
    type_of: np.ndarray
    off_all: np.ndarray
    len_all: np.ndarray
    starts: np.ndarray
    gid: dict[str, int]
    props: list[Any]
    sizes: list[torch.Size]
    byte_keys: dict[str, int]

    @classmethod
    def of(cls, packs: list[PackedItems | None]) -> _Items | None:
        """None when there are no items, or a tensor is too large to key."""
        # Global tensor ids: one dict lookup per distinct table (ranks with the same tensors share it).
        gid: dict[str, int] = {}
        props: list[Any] = []
        sizes: list[torch.Size] = []
        tables: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # digest -> (gid, bytes, strides)
        byte_keys: dict[str, int] = {}
        width = max((pk.offsets.shape[1] for pk in packs if pk is not None), default=0)
        names = ("key", "rank", "size", "gid", "row", "type", "off", "len")
        parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
        starts = np.zeros(len(packs) + 1, np.int64)
        for rank, pk in enumerate(packs):
            starts[rank + 1] = starts[rank] + (0 if pk is None else len(pk))
            if pk is None:
                continue
            table = tables.get(pk.digest)
            if table is None:
                made = _table(pk, gid, props, sizes)
                if made is None:
                    return None
                table = tables[pk.digest] = made
            for name, value in _rank_items(pk, rank, table, width, byte_keys).items():
                parts[name].append(value)
        if not parts["key"]:
            return None
        key, rank_of, size_of, g_of, row_of, type_of, off_all, len_all = (np.concatenate(parts[k]) for k in names)
        return cls(key, rank_of, size_of, g_of, row_of, type_of, off_all, len_all, starts, gid, props, sizes, byte_keys)


def _rank_items(
    pk: PackedItems, rank: int, table: tuple[np.ndarray, np.ndarray, np.ndarray], width: int, byte_keys: dict[str, int]
) -> dict[str, np.ndarray]:
    """One rank's part of each of ``_Items``' arrays."""
    to_global, row_bytes, strides = table
    n, where = len(pk), pk.row_positions()
    key, size = np.empty(n, np.int64), np.ones(n, np.int64)
    g_rows = to_global[pk.ids]
    key[where] = g_rows * _LINEAR_LIMIT + (pk.offsets * strides[pk.ids]).sum(axis=1)
    size[where] = row_bytes[pk.ids]
    g, row, kind = np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.full(n, _SHARD, np.int64)
    g[where], row[where], kind[where] = g_rows, np.arange(len(where)), pk.types
    off, length = np.zeros((n, width), np.int64), np.zeros((n, width), np.int64)
    off[where, : pk.offsets.shape[1]] = pk.offsets
    length[where, : pk.sizes.shape[1]] = pk.sizes
    for pos, item in pk.extras:  # byte items: keys below every tensor's
        key[pos] = -1 - byte_keys.setdefault(item.index.fqn, len(byte_keys))
    rank_of = np.full(n, rank, np.int64)
    return {"key": key, "rank": rank_of, "size": size, "gid": g, "row": row, "type": kind, "off": off, "len": length}


def _metadata(
    items: _Items, kept: np.ndarray
) -> tuple[dict[str, Any], np.ndarray, list[tuple[str, np.ndarray, np.ndarray]]]:
    """The metadata of the kept items (fqn -> storage metadata, in torch's order), each item's hint (the rank of
    its chunk among its tensor's kept chunks in (rank, position) order), and (fqn, offsets, sizes) of each
    tensor given a chunk list."""
    g_of, key = items.g_of, items.key
    fqn_of = list(items.gid)
    for fqn in items.byte_keys:
        if fqn in items.gid:
            raise CheckpointFormatError(f"the save plans write {fqn!r} both as bytes and as a tensor")
    tensor_rows = np.flatnonzero(kept & (g_of >= 0))
    order = tensor_rows[np.argsort(g_of[tensor_rows], kind="stable")]
    g_sorted = g_of[order]
    bounds = np.searchsorted(g_sorted, np.arange(len(fqn_of) + 1))
    several = np.diff(bounds)[g_of] > 1
    bad = np.flatnonzero(kept & (g_of >= 0) & (items.type_of != _SHARD) & several)
    if len(bad):
        raise CheckpointFormatError(
            f"the save plans write {fqn_of[int(g_of[bad[0]])]!r} more than once (not as a shard)"
        )
    hints = np.empty(len(key), np.int64)
    hints[order] = np.arange(len(order)) - bounds[g_sorted]
    entries: list[tuple[int, str, Any]] = []  # (first kept item, fqn, storage metadata): torch's order
    tiles: list[tuple[str, np.ndarray, np.ndarray]] = []
    known: dict[tuple[int, ...], torch.Size] = {}
    for t, fqn in enumerate(fqn_of):
        shape = items.sizes[t]
        rows = order[int(bounds[t]) : int(bounds[t + 1])]
        offs, lens = items.off_all[rows, : len(shape)], items.len_all[rows, : len(shape)]
        dim = rule_dim(shape, offs, lens)
        if dim is not None:  # torch.chunk's split: a valid tiling, nothing to build or check per chunk
            chunks: Sequence[ChunkStorageMetadata] = RuleChunks(shape, dim, len(rows))
        else:
            chunks = _chunk_list(offs, lens, known)
            tiles.append((fqn, offs, lens))
        tensor_md = TensorStorageMetadata(properties=items.props[t], size=shape, chunks=chunks)  # type: ignore[arg-type]
        entries.append((int(rows[0]), fqn, tensor_md))
    byte_rows = np.flatnonzero(kept & (key < 0))
    byte_ids, first = np.unique(-1 - key[byte_rows], return_index=True)
    names = list(items.byte_keys)
    for b, i in zip(byte_ids.tolist(), first.tolist(), strict=True):
        entries.append((int(byte_rows[i]), names[b], BytesStorageMetadata()))
    return {fqn: value for _, fqn, value in sorted(entries, key=lambda e: e[0])}, hints, tiles


def _chunk_list(
    offs: np.ndarray, lens: np.ndarray, known: dict[tuple[int, ...], torch.Size]
) -> list[ChunkStorageMetadata]:
    """``ChunkStorageMetadata`` of each row of ``offs`` and ``lens``.

    A dataclass's __init__ costs more than the object: fill __dict__ (the same object, compared and pickled
    alike). torch.Size(...) costs ~1 us; equal offsets and sizes repeat across tensors (every tensor with the
    same rows has the same chunk offsets on a rank), so equal ones share one immutable torch.Size (``known``)."""
    chunk_type, size_type, new = ChunkStorageMetadata, torch.Size, object.__new__
    listed = []
    for o, s in zip(map(tuple, offs.tolist()), map(tuple, lens.tolist()), strict=True):
        offsets, sizes_ = known.get(o), known.get(s)
        if offsets is None:
            offsets = known[o] = size_type(o)
        if sizes_ is None:
            sizes_ = known[s] = size_type(s)
        chunk = new(chunk_type)
        chunk.__dict__ = {"offsets": offsets, "sizes": sizes_}
        listed.append(chunk)
    return listed


def rule_dim(size: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> int | None:
    """The dimension along which the chunks (rows of ``offsets`` and ``sizes``, in order) are exactly
    ``torch.chunk``'s split of ``size`` into as many chunks (``RuleChunks``: every chunk ``ceil(d / n)``
    rows, the trailing ones short or empty, every other dimension whole), ``-1`` for a scalar's one
    chunk, or None. The first such dimension, as the compact encoder picks it (:func:`dcp_s3._metadata.compact._rule`)."""
    n, dims = offsets.shape
    if n == 0:
        return None
    if dims == 0:
        return -1 if n == 1 else None
    # The split's chunk 0 is whole along every dim but its own: a dim where it is not is the only candidate.
    first = sizes[0].tolist()
    partial = [d for d in range(dims) if first[d] != size[d]]
    if len(partial) > 1:
        return None
    for dim in partial or range(dims):
        d = int(size[dim])
        step = -(-d // n)
        lo = np.minimum(np.arange(n, dtype=np.int64) * step, d)
        if not (np.array_equal(offsets[:, dim], lo) and np.array_equal(sizes[:, dim], np.minimum(lo + step, d) - lo)):
            continue
        if dims == 1:
            return dim
        others = [e for e in range(dims) if e != dim]
        if not offsets[:, others].any() and (sizes[:, others] == [size[e] for e in others]).all():
            return dim
    return None


def _table(
    pk: PackedItems, gid: dict[str, int], props: list[Any], sizes: list[torch.Size]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A rank's tensor table against the global one: global ids, torch's byte size of each tensor
    (global size x element size), row-major strides (0 past its dimensions); None if too large."""
    ids, row_bytes = [], []
    strides = np.zeros(pk.size_of.shape, np.int64)
    for f, (fqn, shape, dims) in enumerate(zip(pk.fqns, pk.size_of.tolist(), pk.ndim.tolist(), strict=True)):
        g = gid.get(fqn)
        if g is None:
            g = gid[fqn] = len(sizes)
            props.append(pk.props[int(pk.prop_of[f])])
            sizes.append(torch.Size(shape[:dims]))
        ids.append(g)
        numel = math.prod(shape[:dims])
        if numel >= _LINEAR_LIMIT:
            return None
        row_bytes.append(numel * element_size(pk.props[int(pk.prop_of[f])].dtype) or 1)
        step = 1
        for d in range(dims - 1, -1, -1):
            strides[f, d] = step
            step *= shape[d]
    return np.array(ids, np.int64), np.array(row_bytes, np.int64), strides


def _dedup(key: np.ndarray, rank: np.ndarray, starts: np.ndarray, size: np.ndarray, lowest: bool) -> np.ndarray:
    """Which items stay (see the module doc): a mask over the items of all ranks, concatenated in
    (rank, position) order; ``starts[r]``: where rank r's items begin."""
    order = np.argsort(key, kind="stable")  # equal keys stay in (rank, position) order
    sorted_keys = key[order]
    run_starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    counts = np.diff(np.r_[run_starts, len(key)])
    kept = np.ones(len(key), bool)
    dup_runs = np.flatnonzero(counts > 1)
    if len(dup_runs) == 0:
        return kept
    unique = np.empty(len(key), bool)
    unique[order] = np.repeat(counts == 1, counts)
    first = order[run_starts[dup_runs]]  # each duplicated index's first appearance, in torch's order below
    won = np.zeros(int(rank.max()) + 1, np.int64)
    prefix: dict[int, np.ndarray] = {}  # rank -> cumulative bytes of its unique items, by position
    for r in dup_runs[np.argsort(first, kind="stable")]:
        members = order[run_starts[r] : run_starts[r] + counts[r]]
        holders = rank[members]
        f = int(holders[0])
        if lowest:
            winner = f
        else:
            load = won[holders]
            if f not in prefix:
                lo, hi = int(starts[f]), int(starts[f + 1])
                prefix[f] = np.r_[0, np.cumsum(size[lo:hi] * unique[lo:hi])]
            load[holders == f] += prefix[f][int(members[0]) - int(starts[f])]
            winner = int(holders[np.argmin(load)])  # the first minimum: the lowest such rank
            won[winner] += size[members[0]]
        kept[members[holders != winner]] = False
    return kept
