"""A resharded load from the local tier: every saving rank's copy, read through one merged global metadata.

The local tier keeps each rank's state in its own directory, ``<local_root>/rank<NNNNN>/``
(:mod:`dcp_s3._checkpointer.tiers`). A job of another world size cannot load its own copy, but when the
copies of *all* the saving ranks of a step are readable from this process (all rank directories under
one local root, e.g. on a node's shared disk) it can still load the step without S3:

1. :func:`shared_copies`: every ``rank<NNNNN>/`` directory under the local root is listed (one that is a
   link is not read: :mod:`dcp_s3._checkpointer.local_root`) and the committed copies of each step collected. A step counts when its markers name ranks ``0..W-1`` of one
   world size ``W``, each in its own directory, and the same save (the ``save`` token rank 0 drew for it:
   copies of two saves of one step — a rerun that did not complete on every rank — are never combined).
2. :func:`merged_metadata`: for each part, every saving rank's local ``.metadata`` is moved into global
   coordinates by its marker's layout (:func:`~dcp_s3._checkpointer.local_layout.globalize`, which
   checks the layout: stored bytes) and the ranks' metadata merged as promotion merges them
   (:func:`~dcp_s3._checkpointer.promotion.merge_metadata`); each item's object is named by its rank
   directory. It is checked before use: every tensor's chunks cover it exactly once, every object the
   items need is there and long enough.
3. :func:`load_merged`: the ordinary collective DCP load (the step I/O's part loaders,
   :mod:`dcp_s3._checkpointer.step_io`), through a reader (:class:`MergedReader`) that serves the merged
   metadata from memory and reads the items from the rank directories, checking every item's checksum.
   DCP reshards: each loading rank reads only the byte ranges its own shards need.

Which step is loaded, and the fallback to S3, are decided in :mod:`dcp_s3._checkpointer.tier_load`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._checkpointer.local_layout import globalize
from dcp_s3._checkpointer.local_root import rank_dir, rank_dirs
from dcp_s3._checkpointer.markers import LAYOUT, LOCAL_ENTRY
from dcp_s3._checkpointer.promotion import merge_metadata
from dcp_s3._checkpointer.step_io import load_model, load_optim
from dcp_s3._checkpointer.tiers import local_copy, save_of
from dcp_s3._dcp import Store
from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._layout import METADATA_KEY
from dcp_s3._metadata.formats import dump_metadata, load_metadata
from dcp_s3._untrusted.metadata_check import tiling_problem
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError, DcpS3Error

__all__ = [
    "Copy",
    "Shared",
    "rank_dir",
    "rank_dirs",
    "scan_copies",
    "copies_problem",
    "shared_copies",
    "merged_metadata",
    "MergedReader",
    "check_shared",
    "load_merged",
]


class Copy(NamedTuple):
    """One saving rank's committed local copy of a step."""

    rank: int
    store: Store  # the rank's directory
    marker: dict[str, Any]
    dirs: dict[str, str]  # part directory by part
    committed_at: float  # the marker's modification time (epoch s)


class Shared(NamedTuple):
    """A step whose copies of every saving rank are under the local root, all of one save."""

    save: str
    world_size: int
    copies: list[Copy]  # by saving rank


def scan_copies(local_root: str) -> tuple[dict[str, dict[int, Copy | str]], dict[int, str]]:
    """(every committed local copy under ``local_root``, by step and by the rank directory holding it; why each
    entry named like a rank directory is not one of ours, by rank: nothing below it is read,
    :func:`~dcp_s3._checkpointer.local_root.rank_dirs`). A copy whose marker cannot be read or is hostile
    (stored bytes) is the reason instead, never an exception."""
    found: dict[str, dict[int, Copy | str]] = {}
    ours, refused = rank_dirs(local_root)
    for r, store in ours.items():
        unreadable: dict[str, str] = {}
        try:
            steps = find_complete(store, None, unreadable)
        except (DcpS3Error, OSError) as exc:
            found.setdefault("", {})[r] = f"{store.url()}: {type(exc).__name__}: {exc}"
            continue
        for name, why in unreadable.items():
            found.setdefault(name, {})[r] = why
        for step in steps:
            try:
                got = local_copy(store, step.name)
            except (DcpS3Error, OSError) as exc:
                found.setdefault(step.name, {})[r] = f"{type(exc).__name__}: {exc}"
                continue
            if got is not None:
                at = step.marker.mtime if step.marker is not None else 0.0
                found.setdefault(step.name, {})[r] = Copy(r, store, got[0], got[1], at)
    found.pop("", None)
    return found, refused


def shared_copies(local_root: str) -> tuple[dict[str, Shared], dict[str, str]]:
    """(the steps under ``local_root`` complete across rank directories, by step; why each other step seen
    there is not, by step). Unreadable or hostile markers make their step unusable, never raise."""
    shared: dict[str, Shared] = {}
    why: dict[str, str] = {}
    found, refused = scan_copies(local_root)
    for step, by_rank in found.items():
        problem = copies_problem(by_rank, refused)
        if problem:
            why[step] = problem
            continue
        copies = [c for _, c in sorted(by_rank.items()) if isinstance(c, Copy)]
        save = save_of(copies[0].marker)
        assert save is not None  # checked by copies_problem
        shared[step] = Shared(save, len(copies), copies)
    return shared, why


def copies_problem(by_rank: Mapping[int, Copy | str], refused: Mapping[int, str] | None = None) -> str | None:
    """Why the copies of one step (by rank directory, from :func:`scan_copies`) are not one complete save
    of it by every rank of its world size, or None. ``refused``: why rank directories were not read (by rank,
    from :func:`scan_copies`), named when their copies are missing. The world size is a stored number: only the
    copies present are counted and listed, never a range of it."""
    bad = {r: c for r, c in by_rank.items() if isinstance(c, str)}
    if bad:
        return "; ".join(f"rank {r}: {c}" for r, c in sorted(bad.items()))
    copies = [c for _, c in sorted(by_rank.items()) if isinstance(c, Copy)]
    entries = [c.marker[LOCAL_ENTRY] for c in copies]
    misplaced = [c.rank for c, e in zip(copies, entries, strict=True) if e["rank"] != c.rank]
    if misplaced:
        return f"the copies in the directories of ranks {misplaced} were saved by other ranks"
    worlds = {e["world_size"] for e in entries}
    if len(worlds) != 1:
        return f"its copies were saved by jobs of different world sizes {sorted(worlds)}"
    (world,) = worlds
    if len(copies) < world:  # each copy is of a distinct rank below ``world`` (checked above and by its marker)
        return f"saved by {world} ranks, " + _missing(world, {c.rank for c in copies}, refused or {})
    saves = {save_of(c.marker) for c in copies}
    if None in saves:
        return "its markers record no save token (saved by an older dcp_s3)"
    if len(saves) != 1:
        held = {s: [c.rank for c in copies if save_of(c.marker) == s] for s in saves}
        return (
            "its copies are of different saves of the step (ranks "
            + "; ".join(map(str, held.values()))
            + "): a rerun that did not complete on every rank"
        )
    parts = {tuple(sorted(c.dirs)) for c in copies}
    if len(parts) != 1:
        return f"its copies hold different parts {sorted(parts)}"
    return None


def _missing(world: int, present: set[int], refused: Mapping[int, str]) -> str:
    """Which ranks below ``world`` have no copy in ``present``: the first few, the count of the rest (at most
    ``len(present) + _SHOWN`` ranks are looked at, whatever ``world`` says), and why a refused directory was
    not read."""
    shown: list[int] = []
    r = 0
    while len(shown) < _SHOWN and r < world:
        if r not in present:
            shown.append(r)
        r += 1
    more = world - len(present) - len(shown)
    text = f"the copies of ranks {shown}" + (f" and {more} more" if more else "") + " are not there"
    why = [refused[r] for r in shown if r in refused]
    return text + (f" ({'; '.join(why)})" if why else "")


#: How many missing ranks a reason names.
_SHOWN = 8


def merged_metadata(shared: Shared, part: str, where: str) -> Metadata:
    """The global metadata of ``part`` over every saving rank's copy, each item named by its rank directory
    (``rank<NNNNN>/<part dir>/<object>``), checked (module docstring). ``CheckpointFormatError`` or
    ``CheckpointNotFoundError`` (naming the object) when it cannot serve a load."""
    per_rank = []
    for c in shared.copies:
        name = c.dirs.get(part)
        if name is None:
            raise CheckpointNotFoundError(f"{c.store.url()}: the step has no part {part!r}")
        meta_where = c.store.url(f"{name}/{METADATA_KEY}")
        layouts = c.marker.get(LAYOUT)
        layout = layouts.get(part) if isinstance(layouts, dict) else None
        md = globalize(load_metadata(c.store.read(f"{name}/{METADATA_KEY}"), meta_where), layout, meta_where)
        need: dict[str, int] = {}
        storage = {}
        for index, info in md.storage_data.items():
            rel = info.relative_path  # a path inside the part directory: load_metadata checked it
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
            storage[index] = dataclasses.replace(info, relative_path=f"{rank_dir(c.rank)}/{name}/{rel}")
        for rel, n in sorted(need.items()):
            size = c.store.size(f"{name}/{rel}")
            if size is None:
                raise CheckpointNotFoundError(f"{c.store.url(f'{name}/{rel}')} is missing")
            if size < n:
                raise CheckpointFormatError(f"{c.store.url(f'{name}/{rel}')} holds {size} bytes, its items need {n}")
        md.storage_data = storage
        per_rank.append(md)
    merged = merge_metadata(per_rank)
    for fqn, entry in merged.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_cover(fqn, entry, where)
    # Through the same restricted reading as any stored metadata, so the load sees what an S3 load sees.
    return load_metadata(dump_metadata(merged, "dcp"), where)


def _check_cover(fqn: str, entry: TensorStorageMetadata, where: str) -> None:
    """Every element of the tensor is in exactly one chunk (else DCP would leave the rest unloaded): the chunks'
    volumes add up to the tensor's and no two overlap (each chunk lies inside the tensor: its rank's metadata
    and layout were checked, so then they overlap iff they do not tile it, :func:`_tiles`)."""
    size = list(entry.size)
    boxes = [(list(c.offsets), list(c.sizes)) for c in entry.chunks if math.prod(c.sizes)]
    covered, numel = sum(math.prod(s) for _, s in boxes), math.prod(size)
    overlap = covered > numel or (covered == numel and not _tiles(size, boxes))
    if overlap or covered != numel:
        raise CheckpointFormatError(
            f"{where}: the ranks' shards of {fqn!r} cover {covered} of its {numel} elements"
            + (" and overlap" if overlap else "")
        )


#: Corners :func:`_tiles` may count (chunks times 2 ** split dimensions); past it the bounded check of every
#: stored ``.metadata`` decides.
_MAX_CORNERS = 1 << 22


def _tiles(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether ``boxes`` (offsets, sizes; each inside a tensor of ``size``) cover it exactly once, in time linear
    in their number (shards along any dimension cost the same: no pair is compared).

    A box's indicator is the signed sum of the orthants at its corners (``+`` at a corner with an even number
    of upper coordinates, ``-`` at an odd one), and orthants at distinct points are linearly independent; so
    the boxes' indicators add up to the tensor's iff, at every point, their corners' signs add up to the
    tensor's own corners' signs. Only the dimensions some box splits count (in the others every box spans
    the tensor). Beyond :data:`_MAX_CORNERS`, :func:`~dcp_s3._untrusted.metadata_check.tiling_problem` decides
    (n log n for a grid, a bounded sweep otherwise)."""
    split = [k for k in range(len(size)) if any(o[k] or s[k] != size[k] for o, s in boxes)]
    if len(boxes) << len(split) > _MAX_CORNERS:
        offsets = np.array([o for o, _ in boxes], dtype=np.int64).reshape(len(boxes), len(size))
        sizes = np.array([s for _, s in boxes], dtype=np.int64).reshape(offsets.shape)
        return tiling_problem(size, offsets, sizes) is None
    signs: dict[str, int] = {}

    def add(low: list[int], high: list[int], step: int) -> None:
        for corner in itertools.product(*(((a, 1), (b, -1)) for a, b in zip(low, high, strict=True))):
            key = ",".join(str(c) for c, _ in corner)  # a str: tuples of ints can be chosen to collide in hash
            signs[key] = signs.get(key, 0) + step * math.prod(sign for _, sign in corner)

    for o, s in boxes:
        add([o[k] for k in split], [o[k] + s[k] for k in split], 1)
    add([0] * len(split), [size[k] for k in split], -1)  # the tensor's own corners
    return not any(signs.values())


class MergedReader(S3StorageReader):
    """A reader over the local root that loads with the merged metadata it is given (held in memory, not
    read) and reads each item from the rank directory that metadata names; checksums as any load."""

    def __init__(self, local_root: str, metadata: Metadata) -> None:
        super().__init__(local_root, share_metadata=False)
        self._merged = metadata

    # The parameter must be literally named ``kwargs`` for DCP to pass rank/use_collectives.
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The merged metadata (no read)."""
        md = self._merged
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def check_shared(
    local_root: str,
    shared: Shared,
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
) -> tuple[dict[str, Metadata], str | None]:
    """(merged metadata by part, None) for the parts this load needs, or ({}, why not)."""
    parts = [f"{k}_model" for k in model_dict] + [f"{k}_optim" for k in sorted(optimizer_dict or {})]
    out = {}
    try:
        for part in parts:
            out[part] = merged_metadata(shared, part, f"{local_root} ({part}, merged over {shared.world_size} ranks)")
    except (DcpS3Error, OSError) as exc:
        return {}, f"{type(exc).__name__}: {exc}"
    return out, None


def load_merged(
    local_root: str,
    merged: Mapping[str, Metadata],
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
) -> None:
    """Every rank, collectively: load every part through a :class:`MergedReader` of ``merged``."""
    for key, model in model_dict.items():
        load_model(MergedReader(local_root, merged[f"{key}_model"]), model)
    for key, optim in sorted((optimizer_dict or {}).items()):
        where = f"{local_root} ({key}_optim, merged)"
        load_optim(MergedReader(local_root, merged[f"{key}_optim"]), where, model_dict[key], optim)
