"""How a rank's state is stored in the local tier: local tensors, and where they sit in the global ones.

A local step holds one rank's state alone, so it is saved as an ordinary checkpoint of *local*
tensors: every ``DTensor`` is replaced by its local shard (:func:`local_view`, views of the same
storage, so a load writes straight into the shards). Where each shard lies in its global tensor
(:func:`layout_of`: for every flattened key the global size, the shard's offsets and sizes, as
the save planner of the real state sees them) goes into the local marker. It lets a load check that
the shards it needs are the ones stored (same keys, same offsets, same sizes: a different sharding is
refused), and lets promotion rewrite each rank's metadata into global coordinates
(:func:`globalize`), whose union is then an ordinary global checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from dcp_s3.errors import CheckpointFormatError

__all__ = ["local_view", "from_view", "layout_of", "globalize", "layout_mismatch"]

#: flattened key -> (global size, shard offsets, shard sizes); None for a non-tensor item.
Layout = dict[str, tuple[list[int], list[int], list[int]] | None]


def local_view(obj: Any) -> Any:
    """``obj`` (a state dict) with every ``DTensor`` replaced by its local shard, recursively."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: local_view(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_view(v) for v in obj]
    return obj


def from_view(state: Any, view: Any) -> Any:
    """``state`` with what a load put into its :func:`local_view` ``view``: the ``DTensor`` of ``state``
    (its shard was loaded in place), every other value (loaded bytes replace the entry) from ``view``."""
    if isinstance(state, DTensor):
        return state
    if isinstance(state, dict) and isinstance(view, dict):
        return {k: from_view(state[k], v) if k in state else v for k, v in view.items()}
    if isinstance(state, list) and isinstance(view, list) and len(state) == len(view):
        return [from_view(a, b) for a, b in zip(state, view, strict=True)]
    return view


def layout_of(state: dict[str, Any], planner: Any) -> Layout:
    """Where this rank's items lie in the global state, as ``planner`` (a fresh save planner) plans ``state``."""
    planner.set_up_planner(state, None, True)
    out: Layout = {}
    for item in planner.create_local_plan().items:
        if item.type == WriteItemType.BYTE_IO:
            out[item.index.fqn] = None
            continue
        td = item.tensor_data
        out[item.index.fqn] = (list(td.size), list(td.chunk.offsets), list(td.chunk.sizes))
    return out


def layout_mismatch(saved: Any, now: Layout) -> str | None:
    """Why a local copy saved with layout ``saved`` cannot serve a load of the layout ``now``, or None."""
    if not isinstance(saved, dict):
        return "its marker records no layout"
    for fqn, where in now.items():
        if fqn not in saved:
            return f"{fqn!r} is not in it"
        have = saved[fqn]
        if (have is None) != (where is None) or (where is not None and [list(x) for x in have] != list(where)):
            return f"{fqn!r} is stored as {have}, the load needs {where} (saved with another sharding)"
    return None


def globalize(md: Metadata, layout: Any, where: str) -> Metadata:
    """A rank's local-tier metadata in global coordinates: each tensor's chunks moved to its shard's offsets
    within its global size (``layout`` from the rank's marker); the result covers only that rank's shards."""
    if not isinstance(layout, dict):
        raise CheckpointFormatError(f"{where}: no layout for the local step")
    state: dict[str, Any] = {}
    shift: dict[str, list[int]] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            state[fqn] = entry
            continue
        spot = layout.get(fqn)
        if not spot or len(spot) != 3 or list(spot[2]) != list(entry.size):
            raise CheckpointFormatError(
                f"{where}: the layout of {fqn!r} ({spot}) does not match its size {list(entry.size)}"
            )
        size, offsets = _placement(spot, list(entry.size), fqn, where)
        shift[fqn] = offsets
        chunks = [
            ChunkStorageMetadata(torch.Size([o + s for o, s in zip(c.offsets, offsets, strict=True)]), c.sizes)
            for c in entry.chunks
        ]
        state[fqn] = TensorStorageMetadata(entry.properties, size, chunks)
    storage = {}
    for index, info in md.storage_data.items():
        if index.fqn in shift and index.offset is not None:
            index = MetadataIndex(
                index.fqn, torch.Size([o + s for o, s in zip(index.offset, shift[index.fqn], strict=True)])
            )
        storage[index] = info
    out = Metadata(state_dict_metadata=state, planner_data=md.planner_data, storage_data=storage, storage_meta=None)
    out.version = getattr(md, "version", None)
    return out


def _placement(spot: Any, shard: list[int], fqn: str, where: str) -> tuple[torch.Size, list[int]]:
    """(global size, offsets) of a shard of size ``shard`` as a marker records it, checked: whole numbers, one
    per dimension, and the shard inside the global tensor (a marker is stored bytes: never trusted)."""
    size, offsets = spot[0], spot[1]
    ok = (
        isinstance(size, (list, tuple))
        and isinstance(offsets, (list, tuple))
        and len(size) == len(offsets) == len(shard)
        and all(type(x) is int for x in (*size, *offsets))
        and all(o >= 0 and o + n <= g for o, n, g in zip(offsets, shard, size, strict=True))
    )
    if not ok:
        raise CheckpointFormatError(
            f"{where}: the layout of {fqn!r} places a shard of size {shard} at {offsets!r} in {size!r}: not inside it"
        )
    return torch.Size(size), list(offsets)
