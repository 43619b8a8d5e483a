"""``Checkpointer.load()`` with a local tier: pick the step, check each rank's local copy, load.

The rule (also in :mod:`dcp_s3.checkpointer.tiers`): the newest step that is committed on S3, or whose
local copy is committed on every rank (same rank, same world size, same save), or whose copies of all
its saving ranks are under the local root of every rank (a job of another world size on a shared disk:
loaded collectively through their merged metadata, :mod:`dcp_s3.checkpointer.tier_reshard`; if that
fails, from S3 if the step is there). Each rank loads its local copy of
it if that copy holds every chunk its load needs, in objects that are all there and long enough (and
the load checks every item's checksum); ranks whose copy fails load that step from S3 alone; a step
that some rank cannot load locally and that is not on S3 is skipped, with a warning. All ranks
agree at each decision (all-gathers over the manager's CPU group).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcp_s3.checkpointer.generations import find_complete, part_dirs_of, read_marker
from dcp_s3.checkpointer.local_layout import from_view, layout_mismatch, layout_of, local_view
from dcp_s3.checkpointer.markers import check_marker
from dcp_s3.checkpointer.ranks import distributed, rank, world_size
from dcp_s3.checkpointer.tier_reshard import Shared, check_shared, load_merged, shared_copies
from dcp_s3.checkpointer.tiers import LAYOUT, Tiers, save_of
from dcp_s3.checkpointer.training_state import on_meta, warn
from dcp_s3.errors import CheckpointNotFoundError, DcpS3Error
from dcp_s3.layout import METADATA_KEY
from dcp_s3.metadata.formats import load_metadata
from dcp_s3.planners.optim_match import OptimizerLoadPlanner
from dcp_s3.planners.trainable import TrainableOnlyLoadPlanner, TrainableOnlySavePlanner
from dcp_s3.store import Store

__all__ = ["tiered_load", "check_copy", "load_alone"]

log = logging.getLogger("dcp_s3")


def _gather(tiers: Tiers, value: Any) -> list[Any]:
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=tiers.ranks.control_group())
    return out


def _covers(store: Store, name: str | None, saved: Any, state: dict[str, Any], planner: Any) -> str | None:
    """Why the local checkpoint ``name`` (saved with layout ``saved``) cannot serve a load of ``state``, or None."""
    if name is None:
        return "the step has no such part"
    where = store.url(f"{name}/{METADATA_KEY}")
    why = layout_mismatch(saved, layout_of(state, planner))
    if why:
        return f"{where}: {why}"
    md = load_metadata(store.read(f"{name}/{METADATA_KEY}"), where)
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for obj, n in sorted(need.items()):
        size = store.size(f"{name}/{obj}")
        if size is None:
            return f"{store.url(f'{name}/{obj}')} is missing"
        if size < n:
            return f"{store.url(f'{name}/{obj}')} holds {size} bytes, its items need {n} (truncated)"
    return None


def check_copy(store: Store, marker: Any, dirs: Mapping[str, str], model_dict: Mapping[str, nn.Module],
               optimizer_dict: Mapping[str, torch.optim.Optimizer] | None) -> str | None:
    """Why this rank's local copy (``marker``, part directories ``dirs`` in ``store``) cannot serve its load,
    or None."""
    layouts = marker.get(LAYOUT) if isinstance(marker, dict) else None
    layouts = layouts if isinstance(layouts, dict) else {}
    try:
        for key, model in model_dict.items():
            if on_meta(model):
                return "the model is on the meta device"
            why = _covers(store, dirs.get(f"{key}_model"), layouts.get(f"{key}_model"), get_model_state_dict(model),
                          TrainableOnlySavePlanner(model))
            if why:
                return why
        for key, optim in sorted((optimizer_dict or {}).items()):
            state = get_optimizer_state_dict(model_dict[key], optim)
            why = _covers(store, dirs.get(f"{key}_optim"), layouts.get(f"{key}_optim"), state, DefaultSavePlanner())
            if why:
                return why
    except (DcpS3Error, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def load_alone(store: Store, dirs: Mapping[str, str], model_dict: Mapping[str, nn.Module],
               optimizer_dict: Mapping[str, torch.optim.Optimizer] | None, local: bool) -> None:
    """Load every part from ``store`` on this rank alone (``no_dist``: no collective): a local copy
    (``local``: local tensors, :mod:`dcp_s3.checkpointer.local_layout`) or a global checkpoint on S3."""
    view = local_view if local else (lambda state: state)
    for key, model in model_dict.items():
        reader = store.reader(dirs[f"{key}_model"])
        if on_meta(model):
            dcp.load(model.state_dict(), storage_reader=reader, planner=TrainableOnlyLoadPlanner(model), no_dist=True)
            continue
        state = get_model_state_dict(model)
        into = view(state)
        dcp.load(into, storage_reader=reader, planner=TrainableOnlyLoadPlanner(model), no_dist=True)
        set_model_state_dict(model, from_view(state, into) if local else state)
    for key, optim in sorted((optimizer_dict or {}).items()):
        model = model_dict[key]
        if f"{key}_optim" not in dirs:
            raise CheckpointNotFoundError(f"no optimizer checkpoint for {key!r} in {store.url()}")
        osd: Any = {} if on_meta(model) else get_optimizer_state_dict(model, optim)
        planner = OptimizerLoadPlanner(check=bool(osd))
        into = view(osd)
        dcp.load(into, storage_reader=store.reader(dirs[f"{key}_optim"]), planner=planner, no_dist=True)
        osd = from_view(osd, into) if local else osd
        if planner.problem is not None:
            warn(f"optimizer checkpoint {store.url(dirs[f'{key}_optim'])} does not match the optimizer "
                 f"({planner.problem}); continuing with fresh optimizer state")
        elif osd:
            set_optimizer_state_dict(model, optim, osd)


def _s3_copy(tiers: Tiers, step: str) -> tuple[Any, dict[str, str]]:
    found = read_marker(tiers.s3, step)
    if found is None:
        raise CheckpointNotFoundError(f"{tiers.s3.url(step)}: its marker is gone")
    marker = found[1]
    dirs = part_dirs_of(marker, step, tiers.s3.url(step)) or {p: f"{step}.{p}" for p in marker["parts"]}
    return marker, dirs


def _attempt(store: Store, dirs: Mapping[str, str], model_dict: Any, optimizer_dict: Any, local: bool) -> str | None:
    try:
        load_alone(store, dirs, model_dict, optimizer_dict, local)
    except (Exception, CheckpointException) as exc:  # a corrupt or vanished object: decided on by all ranks
        return f"{type(exc).__name__}: {exc}"
    return None


def tiered_load(tiers: Tiers, model_dict: Mapping[str, nn.Module],
                optimizer_dict: Mapping[str, torch.optim.Optimizer] | None) -> dict[str, Any] | None:
    """Load the newest step of either tier (module docstring). Returns ``{"step", "marker", "source"}``
    once loaded here; ``{"s3_step"}`` when no rank has it locally (the caller runs the ordinary S3
    load); None when no step is complete anywhere. ``last_load["unusable_local"]``: this rank's local steps
    that could not be used at all (an unreadable or hostile marker), and why; ``last_load["local_refused"]``:
    why this rank's local directory was not read at all (a symbolic link), if it was not."""
    got = _tiered_load(tiers, model_dict, optimizer_dict)
    tiers.last_load["unusable_local"] = dict(tiers.unusable)
    if tiers.refused is not None:
        tiers.last_load["local_refused"] = tiers.refused
    if got is not None and "marker" in got:  # a local marker was checked when read; one from S3 is checked here,
        # after every collective of the load (so no rank is left waiting), before the caller reads its fields
        check_marker(got["marker"], f"the marker of step {got['step']} ({got['source']})")
    return got


def _tiered_load(tiers: Tiers, model_dict: Mapping[str, nn.Module],
                 optimizer_dict: Mapping[str, torch.optim.Optimizer] | None) -> dict[str, Any] | None:
    s3_steps = set(tiers.ranks.run_on_rank0(lambda: [s.name for s in find_complete(tiers.s3, None)]))
    mine = tiers.local_steps()
    shared, refused = shared_copies(tiers.local_root)
    views = _gather(tiers, ({s: save_of(m) for s, (m, _) in mine.items()}, {s: c.save for s, c in shared.items()}))
    every = [own for own, _ in views]
    # A step counts in a tier view only if every rank sees it, as a copy of one and the same save.
    common = _agreed(every)
    merged_ok = _agreed([seen for _, seen in views]) - common
    candidates = sorted(common | s3_steps | merged_ok, key=lambda n: (len(n), n))
    # Steps some ranks hold locally, others not (or of another save), and S3 not: never loadable; a newer
    # one is warned about.
    partial = sorted(set().union(*(set(x) for x in every)) - common - s3_steps - merged_ok, key=lambda n: (len(n), n))
    reasons: dict[str, dict[int, str]] = {}
    me = rank()
    while candidates:
        step = candidates.pop()
        if step in merged_ok:
            got = _load_merged(tiers, step, shared[step], step in s3_steps, model_dict, optimizer_dict, reasons)
            if got is None:
                continue
            _warn_newer(step, partial, every, refused)
            return got
        problem = check_copy(tiers.local, *mine[step], model_dict, optimizer_dict) if step in mine \
            else tiers.unusable.get(step, tiers.refused or "no local copy")
        bad = {r: p for r, p in enumerate(_gather(tiers, problem)) if p}
        if bad:
            reasons[step] = bad
        if bad and step not in s3_steps:
            warn(f"step {step} is not loaded from the local tier, and is not on S3: {_describe(bad)}")
            continue
        _warn_newer(step, partial, every, refused)
        if len(bad) == len(every):
            log.info("loading step %s from S3: no rank has a usable local copy (%s)", step, _describe(bad))
            tiers.last_load = {"step": step, "source": "s3", "s3_ranks": sorted(bad), "reasons": bad}
            return {"s3_step": step}
        marker, dirs = mine[step] if problem is None else _s3_copy(tiers, step)
        error = _attempt(tiers.local if problem is None else tiers.s3, dirs, model_dict, optimizer_dict,
                         problem is None)
        failed = {r: e for r, e in enumerate(_gather(tiers, (error, problem is None))) if e[0]}
        if any(not was_local for _, was_local in failed.values()):
            raise DcpS3Error(f"loading step {step} from S3 failed: "
                             + "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(failed.items())))
        if failed and step not in s3_steps:
            warn(f"step {step}: the local copy failed to load, and the step is not on S3: "
                 + "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(failed.items())))
            reasons[step] = {**bad, **{r: e for r, (e, _) in failed.items()}}
            continue
        if failed:
            warn(f"step {step}: local copies failed to load, those ranks read S3: "
                 + "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(failed.items())))
            bad.update({r: e for r, (e, _) in failed.items()})
            if me in failed:
                marker, dirs = _s3_copy(tiers, step)
                error = _attempt(tiers.s3, dirs, model_dict, optimizer_dict, False)
            again = {r: e for r, e in enumerate(_gather(tiers, error if me in failed else None)) if e}
            if again:
                raise DcpS3Error(f"loading step {step} from S3 failed: "
                                 + "; ".join(f"rank {r}: {e}" for r, e in sorted(again.items())))
        source = "local" if not bad else "mixed"
        if bad:
            log.info("loaded step %s: ranks %s from S3 (%s), the others from the local tier", step, sorted(bad),
                     _describe(bad))
        tiers.last_load = {"step": step, "source": source, "s3_ranks": sorted(bad), "reasons": bad}
        return {"step": step, "marker": marker, "source": source}
    tiers.last_load = {"step": None, "source": None, "s3_ranks": [], "reasons": reasons}
    return None


def _agreed(views: list[dict[str, str | None]]) -> set[str]:
    """The steps every rank's view holds, with one save token."""
    return {s for s, save in views[0].items() if all(s in v and v[s] == save for v in views)}


def _warn_newer(step: str, partial: list[str], every: list[dict[str, str | None]], refused: Mapping[str, str]) -> None:
    newer = [p for p in partial if (len(p), p) > (len(step), step)]
    if newer:
        held = {p: [r for r, x in enumerate(every) if p in x] for p in newer}
        warn(f"loading step {step}, not the newer " + ", ".join(
            f"{p} (committed locally on ranks {held[p]} only, and not on S3)" if len(held[p]) < len(every)
            else f"{p} (the ranks' local copies are of different saves of it, and it is not on S3)" for p in newer))
    seen = [p for p in sorted(refused) if (len(p), p) > (len(step), step) and p not in partial]
    if seen:
        warn(f"loading step {step}, not the newer " + ", ".join(
            f"{p} (its copies under the local root cannot be combined: {refused[p]})" for p in seen))


def _load_merged(tiers: Tiers, step: str, shared: Shared, on_s3: bool, model_dict: Mapping[str, nn.Module],
                 optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
                 reasons: dict[str, dict[int, str]]) -> dict[str, Any] | None:
    """Every rank: load ``step`` from the copies of all its saving ranks (:mod:`dcp_s3.checkpointer.tier_reshard`).
    Returns what :func:`tiered_load` returns, or None when the step cannot be had (warned): the next is tried."""
    merged, problem = check_shared(tiers.local_root, shared, model_dict, optimizer_dict)
    bad = {r: p for r, p in enumerate(_gather(tiers, problem)) if p}
    if not bad:
        try:
            load_merged(tiers.local_root, merged, model_dict, optimizer_dict)
            error = None
        except (Exception, CheckpointException) as exc:  # a corrupt or vanished object: decided on by all ranks
            error = f"{type(exc).__name__}: {exc}"
        bad = {r: e for r, e in enumerate(_gather(tiers, error)) if e}
    if not bad:
        log.info("loaded step %s from the local tier: the copies of its %d saving ranks under %s, resharded",
                 step, shared.world_size, tiers.local_root)
        tiers.last_load = {"step": step, "source": "local", "s3_ranks": [], "reasons": {},
                           "resharded_from": shared.world_size}
        return {"step": step, "marker": shared.copies[0].marker, "source": "local"}
    reasons[step] = bad
    if not on_s3:
        warn(f"step {step} is not loaded from the copies of its {shared.world_size} saving ranks under "
             f"{tiers.local_root}, and is not on S3: {_describe(bad)}")
        return None
    warn(f"step {step}: the copies of its {shared.world_size} saving ranks under {tiers.local_root} cannot serve "
         f"this load, it is read from S3: {_describe(bad)}")
    tiers.last_load = {"step": step, "source": "s3", "s3_ranks": list(range(world_size())),
                       "reasons": bad}
    return {"s3_step": step}


def _describe(bad: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
