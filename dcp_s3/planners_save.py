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
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import defaultdict
from operator import attrgetter
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .errors import CheckpointFormatError

__all__ = ["dedup_save_plans", "global_save_plan", "kept_positions", "merged_planner_data"]

_KEY = attrgetter("index.fqn", "index.offset")
Key = tuple[str, Any]


def dedup_save_plans(all_plans: list[SavePlan], save_to_lowest_rank: bool = False) -> list[SavePlan]:
    """Each index in exactly one plan (see the module doc); plans that lose nothing are returned as they are."""
    keys = [tuple(map(_KEY, plan.items)) for plan in all_plans]
    kept = kept_positions(keys, lambda rank, pos: _storage_size(all_plans[rank].items[pos]), save_to_lowest_rank)
    return [plan if mine is None else dataclasses.replace(plan, items=[plan.items[p] for p in mine])
            for plan, mine in zip(all_plans, kept)]


def kept_positions(keys: list[tuple[Key, ...]], size_of: Callable[[int, int], int], save_to_lowest_rank: bool
                   ) -> list[list[int] | None]:
    """The deduplication on each rank's ``(fqn, offset)`` list: per rank, the positions it keeps
    (ascending), or None when it keeps all. ``size_of(rank, position)``: torch's size of that item."""
    # Group the ranks whose plans list the same indices in the same order: one entry per group.
    groups: dict[tuple[Key, ...], list[int]] = {}
    for rank, listed in enumerate(keys):
        groups.setdefault(listed, []).append(rank)
    if len(groups) == len(keys):
        seen: set[Key] = set()
        total = 0
        for listed in groups:
            seen.update(listed)
            total += len(listed)
        if len(seen) == total:
            return [None] * len(keys)  # no index planned twice: FSDP without empty shards
    group_keys = list(groups)
    group_ranks = list(groups.values())
    # holders: index -> [group, its position there, group, position, ...] in order of first appearance
    # (groups are in order of their first rank, so this is torch's order: by rank, then by position)
    holders: dict[Key, list[int]] = {}
    fqn_bytes: dict[str, int] = {}
    doubled: set[int] = set()  # groups whose plans list an index twice (kept or dropped together)
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


def _storage_size(item: WriteItem) -> int:
    """torch's ``WriteItem.tensor_storage_size() or 1``: the global tensor's bytes."""
    td = item.tensor_data
    if td is None:
        return 1
    return math.prod(td.size) * torch._utils._element_size(td.properties.dtype) or 1


def global_save_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """torch's ``create_default_global_save_plan(all_plans, rewrite_index_hints=True)``."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    chunk_lists: dict[str, list[Any]] = {}
    new_plans = []
    shard = WriteItemType.SHARD
    new = object.__new__
    for plan in all_plans:
        new_items = []
        for item in plan.items:
            index = item.index
            fqn = index.fqn
            if item.type != shard and fqn in md:
                raise CheckpointFormatError(f"the save plans write {fqn!r} more than once (not as a shard)")
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                new_items.append(item)
                continue
            td = item.tensor_data
            if td is None or td.chunk is None:
                raise CheckpointFormatError(f"the save plan's tensor item {fqn!r} has no chunk bounds")
            chunks = chunk_lists.get(fqn)
            if chunks is None:
                existing = md.get(fqn)
                if isinstance(existing, BytesStorageMetadata):
                    raise CheckpointFormatError(f"the save plans write {fqn!r} both as bytes and as a tensor")
                chunks = chunk_lists[fqn] = []
                md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=chunks)
            # A frozen dataclass's __init__ sets each field through object.__setattr__ (~1 us an object);
            # filling __dict__ gives the same objects (compared, hashed, pickled alike) for a fraction.
            new_index = new(MetadataIndex)
            new_index.__dict__.update(fqn=fqn, offset=index.offset, index=len(chunks))
            new_item = new(WriteItem)
            fields = new_item.__dict__
            fields.update(item.__dict__)
            fields["index"] = new_index
            new_items.append(new_item)
            chunks.append(td.chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    return new_plans, Metadata(md)


def merged_planner_data(plans: list[SavePlan]) -> dict[Any, Any]:
    """``dict(ChainMap(*planner_data))`` (the first plan's entry wins) at C speed."""
    merged: dict[Any, Any] = {}
    previous = None
    for plan in reversed(plans):
        data = plan.planner_data
        if data is not None and data is not previous:
            merged.update(data)
            previous = data
    return merged
