"""A save planner for jobs of thousands of ranks: ``ScalableSavePlanner``.

The coordinator of a ``dcp.save`` gathers every rank's plan, deduplicates it, builds the
metadata and validates that every tensor's chunks tile it exactly. torch 2.13's
validation sweeps the chunks along each tensor's *largest* dimension; when a tensor is
sharded on another dimension (FSDP shards dim 0 of Llama's 8192 x 28672 ``down_proj``)
every chunk starts at 0 along the sweep, they all stay "active" and are compared
pairwise: O(ranks^2) per tensor, minutes at 4,096 ranks (``benchmarks/scale.py``).

``ScalableSavePlanner`` is ``DefaultSavePlanner`` with

* packed plans (``dcp_s3._packed.plans``): each rank sends its items as arrays against a table
  of its tensors, and its flatten mapping pickled once with a digest; the coordinator
  unpickles them in ~0.2 ms a rank instead of ~7 us an item, and scatters the global plans
  back packed (each rank builds its ``WriteItem`` objects on first access);
* the coordinator's step on those arrays (``dcp_s3._planners.vector``): torch's deduplication
  (replicated tensors, HSDP's replicas, FSDP's empty trailing shards) with torch's
  balance by bytes, the index hints, and the metadata: a ``RuleChunks`` for a tensor stored
  as torch.chunk's split along one dimension (FSDP, HSDP), no object per chunk, otherwise the
  list of its chunks; plans that are not packed go item by item (``dcp_s3._planners.save``), still linear;
* the same checks as torch (bounds, no overlap, chunk volumes add up to the tensor), decided
  on arrays for slab shardings and otherwise swept along the dimension on which the chunks'
  offsets differ most, which for grid shardings keeps the active set at one row of the
  grid: linear in ranks for FSDP;
* torch's plan caching on by default (``enable_plan_caching=True``): when no rank's
  local plan changed since the previous save, ranks send empty plans and the
  coordinator reuses the previous global plan and metadata.

It changes nothing in the checkpoint's format.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from bisect import bisect_right, insort
from itertools import chain
from operator import attrgetter
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    STATE_DICT_TYPE,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from dcp_s3._packed.plans import PackedItems, PackedMapping
from dcp_s3._planners.save import as_items, dedup_save_plans, global_save_plan, merged_planner_data
from dcp_s3._planners.sharing import group_ranks, running_dcp_group
from dcp_s3._planners.vector import vector_global_plan
from dcp_s3._torch_compat import OverridableSavePlanner
from dcp_s3.errors import CheckpointFormatError

__all__ = ["ScalableSavePlanner", "packed_plan", "validate_global_plan"]

log = logging.getLogger(__name__)
_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")


class ScalableSavePlanner(OverridableSavePlanner):
    """``DefaultSavePlanner`` whose global step stays linear in ranks (see the module doc)."""

    def __init__(self, *, packed_plans: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("enable_plan_caching", True)
        super().__init__(**kwargs)
        self.packed_plans = packed_plans

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """torch's set-up, and a plan-cache key naming the group this save runs on.

        The parameters are torch's, by name: torch's save passes ``storage_meta`` and
        ``is_coordinator`` by keyword only to a planner whose ``set_up_planner`` declares
        ``storage_meta``; to any other it warns and passes ``(state_dict, is_coordinator)``
        positionally (torch 2.7-2.15), and the coordinator's flag lands in ``storage_meta``.

        torch keys its plan cache by the planner's class name alone, process-wide: a save on
        another group (a sub-group, a different world) would have its plans merged with the
        cached plans of a save with other ranks (torch 2.7 then fails; later releases build the
        global plan from a mix). Every rank of one save computes the same key.
        """
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        running = running_dcp_group()
        scope = "local" if running is None else ",".join(map(str, group_ranks(running.group)))
        self.set_plans_cache_key(f"{type(self).__name__}@{scope}")

    def create_local_plan(self) -> SavePlan:
        """torch's local plan, its items and flatten mapping packed for the trip to the coordinator
        (``dcp_s3._packed.plans``; with ``packed_plans=False``, as torch sends them)."""
        plan = super().create_local_plan()
        return packed_plan(plan) if self.packed_plans and plan.usable else plan

    def dedup_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """torch's deduplication of the ranks' plans, in linear time (:func:`dcp_s3._planners.save.dedup_save_plans`)."""
        return dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)

    # torch's DefaultSavePlanner._create_global_plan (2.13): on packed plans with arrays
    # (dcp_s3._planners.vector, which deduplicates itself: dedup_plans serves the item-by-item path
    # only), otherwise item by item; the checks without torch's quadratic sweep. Plan caching and
    # create_global_plan call it as they call torch's (through OverridableSavePlanner).
    def build_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        vector = vector_global_plan(all_plans, self.dedup_save_to_lowest_rank)
        if vector is None:  # some plan is not packed: item by item
            global_plan, metadata = global_save_plan(self.dedup_plans(all_plans))
            errors = validate_global_plan(metadata, ranks=len(global_plan))
        else:
            global_plan, metadata, tiles = vector
            errors = []
            for fqn, offsets, sizes in tiles:
                value = cast(TensorStorageMetadata, metadata.state_dict_metadata[fqn])
                if len(value.size) and not tiles_as_slabs(value.size, offsets, sizes, len(global_plan)):
                    errors.extend(_problems(fqn, tuple(value.size), value.chunks, len(global_plan)))
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=merged_planner_data(global_plan))
        if errors:
            summary = "; ".join(errors)
            raise CheckpointFormatError(
                f"the ranks' save plans do not tile their tensors ({len(errors)} problems): "
                + (summary[:500] + "... (truncated)" if len(summary) > 500 else summary)
            )
        return global_plan, metadata


def packed_plan(plan: SavePlan) -> SavePlan:
    """``plan`` with its items as ``PackedItems`` and its flatten mapping as ``PackedMapping`` (where they pack)."""
    packed = PackedItems.pack(plan.items)
    data = plan.planner_data
    return dataclasses.replace(
        plan,
        items=plan.items if packed is None else as_items(packed),
        planner_data=PackedMapping.pack(data) if isinstance(data, dict) and data else data,
    )


def validate_global_plan(metadata: Metadata, ranks: int) -> list[str]:
    """What torch's ``_validate_global_plan`` checks, in time linear in the chunks of slab shardings.

    Every chunk within its tensor's bounds; no two chunks sharing an element; and (with more
    than one rank) the chunks' volumes adding up to the tensor's. Returns the problems found.
    """
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        dims, n = len(value.size), len(value.chunks)
        try:
            offsets = np.fromiter(chain.from_iterable(map(_OFFSETS, value.chunks)), np.int64, n * dims)
            sizes = np.fromiter(chain.from_iterable(map(_SIZES, value.chunks)), np.int64, n * dims)
            slabs = tiles_as_slabs(value.size, offsets.reshape(n, dims), sizes.reshape(n, dims), ranks)
        except ValueError:  # a chunk of another rank than the tensor
            slabs = False
        if not slabs:
            errors.extend(_problems(key, tuple(value.size), value.chunks, ranks))
    return errors


def tiles_as_slabs(size: Any, offsets: np.ndarray, sizes: np.ndarray, ranks: int) -> bool:
    """True when the chunks (rows of ``offsets`` and ``sizes``) are in bounds, cover the tensor once
    (with several ranks) and are slabs along one dimension (every other dimension whole) that do not
    overlap: FSDP's case, decided with arrays. False means "look closer" (``_problems``), not "invalid"."""
    dims = len(size)
    bound = np.array(size, dtype=np.int64)
    if (offsets < 0).any() or (sizes < 0).any() or (offsets + sizes > bound).any():
        return False
    if ranks > 1 and int(sizes.prod(axis=1, dtype=np.int64).sum()) != math.prod(size):
        return False
    nonempty = (sizes > 0).all(axis=1)
    offsets, sizes = offsets[nonempty], sizes[nonempty]
    whole = (offsets == 0) & (sizes == bound)
    for d in range(dims):
        if whole[:, [e for e in range(dims) if e != d]].all():
            order = np.argsort(offsets[:, d], kind="stable")
            starts, ends = offsets[order, d], offsets[order, d] + sizes[order, d]
            return bool((starts[1:] >= ends[:-1]).all())
    return False


def _problems(key: str, size: tuple[int, ...], chunks: list[ChunkStorageMetadata], ranks: int) -> list[str]:
    errors = []
    volume = 0
    for chunk in chunks:
        if not len(chunk.offsets) == len(chunk.sizes) == len(size) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size, strict=True)
        ):
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{torch.Size(size)} chunk: {chunk}")
        volume += math.prod(chunk.sizes)
    errors.extend(_overlaps(key, size, chunks))
    if ranks > 1 and volume != math.prod(size):
        errors.append(f"key:{key} invalid fill tensor-volume: {math.prod(size)} chunks-volume: {volume}")
    return errors


def _overlaps(key: str, size: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> list[str]:
    """Pairs of non-empty chunks that share an element, found by a sweep along the dimension
    on which their offsets take the most distinct values."""
    boxes = [c for c in chunks if all(s > 0 for s in c.sizes)]
    if len(boxes) < 2:
        return []
    dims = len(size)
    sweep = max(range(dims), key=lambda d: (len({c.offsets[d] for c in boxes}), size[d]))
    order = sorted(range(len(boxes)), key=lambda i: (boxes[i].offsets[sweep], *boxes[i].offsets))
    errors: list[str] = []
    active: list[tuple[int, int]] = []  # (end along the sweep, box), sorted
    for i in order:
        box = boxes[i]
        start = box.offsets[sweep]
        del active[: bisect_right(active, (start, sys.maxsize))]  # boxes ending at or before this one's start
        for _, j in active:
            if _share_element(box, boxes[j]):
                errors.append(f"key:{key} has overlapping chunks: {box} {boxes[j]}")
        insort(active, (start + box.sizes[sweep], i))
    return errors


def _share_element(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )
