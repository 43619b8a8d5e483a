"""The coordinator's save step in time linear in the items: deduplication and the global plan.

torch 2.13 does both with per-item Python objects built through ``dataclasses.replace`` (two
per item), a ``TensorStorageMetadata`` built and thrown away per item, a set of indices per
plan and a set of plans per index. At 16,384 ranks that is minutes. The functions here give
the same results, built with fewer and cheaper objects:

* :func:`dedup_save_plans` — torch's ``dedup_save_plans``: an item planned by several ranks
  (a replicated tensor, HSDP's replicas, FSDP's empty trailing shards, which share an index)
  stays in exactly one rank's plan, the rank with the fewest planned bytes so far (items in
  order of first appearance, sizes counted as torch counts them: the *global* tensor's bytes,
  1 for a non-tensor), or the lowest rank with ``save_to_lowest_rank``. Ranks whose plans list
  the same indices (the replicas of HSDP) are handled as one group with a heap of their planned
  bytes, so the cost is O(items of all plans) for the pass that groups them plus O(distinct
  items x log ranks) for the choice. torch breaks ties between equally loaded ranks by a set's
  iteration order (ascending for the small rank numbers of one host); here always the lowest
  rank.
* :func:`global_save_plan` — torch's ``create_default_global_save_plan``: the index hint of
  every tensor item rewritten to its chunk's position in the metadata, one
  ``TensorStorageMetadata`` per tensor.

``ScalableSavePlanner`` uses these when :mod:`dcp_s3._planners.vector` cannot (some plan not packed, or
holding tensor items outside its table); packed plans are read through their arrays here too.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Callable
from operator import attrgetter
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcp_s3._packed.plans import PackedItems, PackedMapping, storage_size
from dcp_s3.errors import CheckpointFormatError

__all__ = ["as_items", "dedup_save_plans", "global_save_plan", "kept_positions", "merged_planner_data"]

_KEY = attrgetter("index.fqn", "index.offset")
_TYPE_CODES = {t: i for i, t in enumerate(WriteItemType)}
_new = object.__new__
Key = tuple[str, Any]


def dedup_save_plans(all_plans: list[SavePlan], save_to_lowest_rank: bool = False) -> list[SavePlan]:
    """Each index in exactly one plan (see the module doc); plans that lose nothing are returned as they are."""
    keys = [tuple(p.items.keys() if isinstance(p.items, PackedItems) else map(_KEY, p.items)) for p in all_plans]

    def size_of(rank: int, pos: int) -> int:
        items = all_plans[rank].items
        return items.storage_size(pos) if isinstance(items, PackedItems) else storage_size(items[pos])

    kept = kept_positions(keys, size_of, save_to_lowest_rank)
    out = []
    for plan, mine in zip(all_plans, kept, strict=True):
        if mine is not None:
            items = plan.items
            plan = dataclasses.replace(
                plan, items=as_items(items.subset(mine)) if isinstance(items, PackedItems) else [items[p] for p in mine]
            )
        out.append(plan)
    return out


def kept_positions(
    keys: list[tuple[Key, ...]], size_of: Callable[[int, int], int], save_to_lowest_rank: bool
) -> list[list[int] | None]:
    """The deduplication on each rank's ``(fqn, offset)`` list: per rank, the positions it keeps
    (ascending), or None when it keeps all. ``size_of(rank, position)``: torch's size of that item."""
    # Group the ranks whose plans list the same indices in the same order: one entry per group.
    groups: dict[tuple[Key, ...], list[int]] = {}
    for rank, listed in enumerate(keys):
        groups.setdefault(listed, []).append(rank)
    if len(groups) == len(keys) and _all_distinct(groups):
        return [None] * len(keys)  # no index planned twice: FSDP without empty shards
    group_keys = list(groups)
    group_ranks = list(groups.values())
    holders, fqn_bytes, doubled = _holders(group_keys, group_ranks, size_of)
    kept = _assign(holders, group_ranks, fqn_bytes, save_to_lowest_rank)
    out: list[list[int] | None] = [None] * len(keys)
    for g, listed in enumerate(group_keys):
        for rank in group_ranks[g]:
            mine = kept.get(rank, [])
            if g in doubled:  # rare: keep every copy of a kept index, as torch does
                names = {listed[p] for p in mine}
                out[rank] = [p for p, k in enumerate(listed) if k in names]
            elif len(mine) != len(listed):
                out[rank] = sorted(mine)
    return out


def _all_distinct(groups: dict[tuple[Key, ...], list[int]]) -> bool:
    """Whether no index is listed twice, in one group's list or in two."""
    seen: set[Key] = set()
    total = 0
    for listed in groups:
        seen.update(listed)
        total += len(listed)
    return len(seen) == total


def _holders(
    group_keys: list[tuple[Key, ...]], group_ranks: list[list[int]], size_of: Callable[[int, int], int]
) -> tuple[dict[Key, list[int]], dict[str, int], set[int]]:
    """holders: index -> [group, its position there, group, position, ...] in order of first appearance
    (groups are in order of their first rank, so this is torch's order: by rank, then by position); each
    fqn's item size (its first item's); the groups whose plans list an index twice (kept or dropped together)."""
    holders: dict[Key, list[int]] = {}
    fqn_bytes: dict[str, int] = {}
    doubled: set[int] = set()
    for g, listed in enumerate(group_keys):
        for pos, key in enumerate(listed):
            found = holders.get(key)
            if found is None:
                holders[key] = [g, pos]
                if key[0] not in fqn_bytes:
                    fqn_bytes[key[0]] = size_of(group_ranks[g][0], pos)
            elif found[-2] != g:
                found += (g, pos)
            else:
                doubled.add(g)
    return holders, fqn_bytes, doubled


def _assign(
    holders: dict[Key, list[int]], group_ranks: list[list[int]], fqn_bytes: dict[str, int], save_to_lowest_rank: bool
) -> dict[int, list[int]]:
    """rank -> the positions in its plan it keeps: each index to its lowest rank, or to the holding rank with
    the fewest bytes planned so far (torch's greedy balance)."""
    heaps = [[(0, r) for r in ranks] for ranks in group_ranks]  # (planned bytes, rank): already heaps
    kept: dict[int, list[int]] = defaultdict(list)  # rank -> positions in its plan
    for key, found in holders.items():
        if save_to_lowest_rank:
            g = min(found[::2], key=lambda g: group_ranks[g][0])
            kept[group_ranks[g][0]].append(found[found.index(g) + 1])
            continue
        if len(found) == 2:
            g, pos = found
        else:
            i = min(range(0, len(found), 2), key=lambda i: heaps[found[i]][0])
            g, pos = found[i], found[i + 1]
        heap = heaps[g]
        planned, rank = heap[0]
        if len(heap) == 1:
            heap[0] = (planned + fqn_bytes[key[0]], rank)
        else:
            heapq.heapreplace(heap, (planned + fqn_bytes[key[0]], rank))
        kept[rank].append(pos)
    return kept


def global_save_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """torch's ``create_default_global_save_plan(all_plans, rewrite_index_hints=True)``."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    chunk_lists: dict[str, list[Any]] = {}
    new_plans = []
    for plan in all_plans:
        if isinstance(plan.items, PackedItems):
            new_plans.append(_packed_global_plan(plan, md, chunk_lists))
            continue
        new_items = []
        for item in plan.items:
            new_items.append(_add_item(md, chunk_lists, item))
        new_plans.append(dataclasses.replace(plan, items=new_items))
    return new_plans, Metadata(md)


def _add_item(md: dict[str, Any], chunk_lists: dict[str, list[Any]], item: WriteItem) -> WriteItem:
    """One item into the metadata; the item with its index hint (torch's rules and checks)."""
    index = item.index
    fqn = index.fqn
    if item.type != WriteItemType.SHARD and fqn in md:
        raise CheckpointFormatError(f"the save plans write {fqn!r} more than once (not as a shard)")
    if item.type == WriteItemType.BYTE_IO:
        md[fqn] = BytesStorageMetadata()
        return item
    td = item.tensor_data
    if td is None or td.chunk is None:
        raise CheckpointFormatError(f"the save plan's tensor item {fqn!r} has no chunk bounds")
    chunks = _chunks_of(md, chunk_lists, fqn, td.properties, td.size)
    # A frozen dataclass's __init__ sets each field through object.__setattr__ (~1 us an object);
    # filling __dict__ gives the same objects (compared, hashed, pickled alike) for a fraction.
    new_index = _new(MetadataIndex)
    new_index.__dict__.update(fqn=fqn, offset=index.offset, index=len(chunks))
    new_item = _new(WriteItem)
    fields = new_item.__dict__
    fields.update(item.__dict__)
    fields["index"] = new_index
    chunks.append(td.chunk)
    return new_item


def _chunks_of(
    md: dict[str, Any], chunk_lists: dict[str, list[Any]], fqn: str, properties: Any, size: Any
) -> list[Any]:
    chunks = chunk_lists.get(fqn)
    if chunks is None:
        if isinstance(md.get(fqn), BytesStorageMetadata):
            raise CheckpointFormatError(f"the save plans write {fqn!r} both as bytes and as a tensor")
        chunks = chunk_lists[fqn] = []
        md[fqn] = TensorStorageMetadata(properties=properties, size=size, chunks=chunks)
    return chunks


def _packed_global_plan(plan: SavePlan, md: dict[str, Any], chunk_lists: dict[str, list[Any]]) -> SavePlan:
    """``_add_item`` for every item of a packed plan, reading its arrays: no WriteItem is built, the
    chunks are (the metadata needs them), and the plan goes back packed with its new hints."""
    packed = cast(PackedItems, plan.items)
    extras = dict(packed.extras)
    shard = _TYPE_CODES[WriteItemType.SHARD]
    fqns, ndim = packed.fqns, packed.ndim.tolist()
    props = [packed.props[p] for p in packed.prop_of.tolist()]
    sizes = [torch.Size(row[:d]) for row, d in zip(packed.size_of.tolist(), ndim, strict=True)]
    local: list[list[Any] | None] = [None] * len(fqns)  # this plan's tensor -> its chunk list
    hints: list[int] = []
    new_extras: list[tuple[int, WriteItem]] = []
    row = 0
    ids, types = packed.ids.tolist(), packed.types.tolist()
    offsets, chunk_sizes = packed.offsets.tolist(), packed.sizes.tolist()
    new, size_type, chunk_type = _new, torch.Size, ChunkStorageMetadata
    for pos in range(len(packed)):
        extra = extras.get(pos) if extras else None
        if extra is not None:
            new_extras.append((pos, _add_item(md, chunk_lists, extra)))
            local = [None] * len(fqns)  # an object item may have added a tensor: look names up again
            continue
        fid = ids[row]
        chunks = local[fid]
        if chunks is None or types[row] != shard:
            fqn = fqns[fid]
            if types[row] != shard and fqn in md:
                raise CheckpointFormatError(f"the save plans write {fqn!r} more than once (not as a shard)")
            chunks = local[fid] = _chunks_of(md, chunk_lists, fqn, props[fid], sizes[fid])
        d = ndim[fid]
        chunk = new(chunk_type)
        chunk.__dict__.update(offsets=size_type(offsets[row][:d]), sizes=size_type(chunk_sizes[row][:d]))
        hints.append(len(chunks))
        chunks.append(chunk)
        row += 1
    everything = np.arange(len(ids))
    return dataclasses.replace(plan, items=as_items(packed.select(everything, new_extras, np.array(hints, np.int64))))


def as_items(packed: PackedItems) -> list[WriteItem]:
    """``SavePlan.items`` is typed as a list; every DCP code path reads it as a sequence, as PackedItems is."""
    return cast(list[WriteItem], packed)


def merged_planner_data(plans: list[SavePlan]) -> dict[Any, Any]:
    """``dict(ChainMap(*planner_data))`` (the first plan's entry wins) at C speed; packed mappings
    equal to an earlier plan's (the same digest) add nothing and are not unpacked."""
    distinct: list[Any] = []
    digests: set[bytes] = set()
    previous = None
    for plan in plans:
        data = plan.planner_data
        if data is None or data is previous:
            continue
        previous = data
        if isinstance(data, PackedMapping):
            if data.digest in digests:
                continue
            digests.add(data.digest)
            data = data.mapping()
        distinct.append(data)
    merged: dict[Any, Any] = {}
    for data in reversed(distinct):
        merged.update(data)
    return merged
