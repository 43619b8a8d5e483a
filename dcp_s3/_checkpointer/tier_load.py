"""``Checkpointer.load()`` with a local tier: pick the step, check each rank's local copy, load.

The rule (also in :mod:`dcp_s3._checkpointer.tiers`): the newest step that is committed on S3, or whose
local copy is committed on every rank (same rank, same world size, same save), or whose copies of all
its saving ranks are under the local root of every rank (a job of another world size on a shared disk:
loaded collectively through their merged metadata, :mod:`dcp_s3._checkpointer.tier_reshard`; if that
fails, from S3 if the step is there). Steps are tried newest first; S3 is listed once and a step of it is
read (marker, each part's ``.metadata``) only when the load comes to it, so a restart costs the same
requests whatever the number of steps kept. Each rank loads its local copy of the step if that copy
holds every chunk its load needs, in objects that are all there and long enough (and the load checks
every item's checksum); ranks whose copy fails load that step from S3 alone (these checks and loads of
one rank: :mod:`~dcp_s3._checkpointer.rank_load`). All ranks agree at each decision (all-gathers over
the manager's CPU group).

One save per load (:mod:`dcp_s3._checkpointer.saves`): local copies count for a step only when every
rank's records the same save token. Parts of S3 and of local copies are combined only when S3's step is
of that same save: rank 0 reads the S3 marker once, every rank loads the directories it names, and a
rank whose local copy is of another save (a re-save kept local, a rerun) reads S3 too — all ranks then,
in the ordinary collective load, if none can stay local. A step neither tier can serve is skipped for
the next newest, with a warning. ``last_load`` keeps the reasons short (the real rank and the real cause,
not torch's whole ``CheckpointException`` text) and says why every newer step was skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from dcp_s3._checkpointer.generations import load_marker_bytes
from dcp_s3._checkpointer.markers import check_marker
from dcp_s3._checkpointer.names import CHECKPOINTER_STEPS
from dcp_s3._checkpointer.rank_load import check_copy, load_alone, short_reason
from dcp_s3._checkpointer.ranks import distributed, rank, world_size
from dcp_s3._checkpointer.saves import StoredSave, stored_save
from dcp_s3._checkpointer.steps import MARKER_SUFFIX, root_steps
from dcp_s3._checkpointer.tier_reshard import Shared, check_shared, load_merged, shared_copies
from dcp_s3._checkpointer.tiers import Tiers, save_of
from dcp_s3._checkpointer.training_state import warn
from dcp_s3._dcp import Store
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError, DcpS3Error

__all__ = ["tiered_load"]

log = logging.getLogger(__name__)


def _gather(tiers: Tiers, value: Any) -> list[Any]:
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=tiers.ranks.control_group())
    return out


def _attempt(store: Store, dirs: Mapping[str, str], model_dict: Any, optimizer_dict: Any, local: bool) -> str | None:
    try:
        load_alone(store, dirs, model_dict, optimizer_dict, local)
    except (Exception, CheckpointException) as exc:  # a corrupt or vanished object: decided on by all ranks
        return short_reason(exc)
    return None


def _order(step: str) -> tuple[int, str]:
    return len(step), step


class _S3Steps:
    """The S3 side of a tiered load, newest first: one delimiter listing of the root (rank 0) names the
    steps with a marker; a step is read (its marker, each part's ``.metadata``: :func:`stored_save`) only
    when the load comes to it, so a restart costs the same whatever the number of steps kept."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.named: set[str] = set(
            tiers.ranks.run_on_rank0(
                lambda: sorted(
                    s.name
                    for s in root_steps(tiers.s3)
                    if s.marker is not None and CHECKPOINTER_STEPS.fullmatch(s.name)
                )
            )
        )
        self._seen: dict[str, tuple[StoredSave | None, str]] = {}

    def save(self, step: str) -> tuple[StoredSave | None, str]:
        """Every rank (a collective unless the step has no marker on S3): (the committed save S3 holds of
        ``step``, as rank 0 read it once; or None and why not)."""
        if step not in self.named:
            return None, "it is not on S3"
        if step not in self._seen:

            def probe() -> tuple[StoredSave | None, str]:
                try:
                    return stored_save(self.tiers.s3, step), ""
                except (CheckpointFormatError, CheckpointNotFoundError) as exc:  # proof; any other error raises
                    return None, f"on S3 {short_reason(exc)}"

            self._seen[step] = self.tiers.ranks.run_on_rank0(probe)
        return self._seen[step]


def tiered_load(
    tiers: Tiers, model_dict: Mapping[str, nn.Module], optimizer_dict: Mapping[str, torch.optim.Optimizer] | None
) -> dict[str, Any] | None:
    """Load the newest step of either tier (module docstring). Returns ``{"step", "marker", "source"}``
    once loaded here; ``{"s3_step"}`` when every rank is to load it from S3 (the caller runs the
    ordinary S3 load); None when no step is complete anywhere. ``tiers.last_load`` says where from and
    why, and why each newer step was skipped; ``last_load["unusable_local"]``: this rank's local steps
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


def _tiered_load(
    tiers: Tiers, model_dict: Mapping[str, nn.Module], optimizer_dict: Mapping[str, torch.optim.Optimizer] | None
) -> dict[str, Any] | None:
    s3 = _S3Steps(tiers)
    mine = tiers.local_steps()
    shared, refused = shared_copies(tiers.local_root)
    views = _gather(tiers, ({s: save_of(m) for s, (m, _) in mine.items()}, {s: c.save for s, c in shared.items()}))
    every = [own for own, _ in views]
    # A step counts in a tier view only if every rank sees it, as a copy of one and the same save.
    common = _agreed(every)
    merged_ok = _agreed([seen for _, seen in views]) - common
    candidates = sorted(common | s3.named | merged_ok, key=_order)
    # Steps some ranks hold locally, others not (or of another save), and S3 not: never loadable; a newer
    # one is warned about.
    partial = sorted(set().union(*(set(x) for x in every)) - common - s3.named - merged_ok, key=_order)
    skipped: dict[str, str] = {}
    while candidates:
        step = candidates.pop()
        if step in merged_ok:
            got = _load_merged(tiers, s3, step, shared[step], model_dict, optimizer_dict, skipped)
        else:
            got = _load_step(tiers, s3, step, mine, every, common, model_dict, optimizer_dict, skipped)
        if got is None:
            continue
        newer = _newer(step, partial, every, refused)
        if newer:
            warn(f"loading step {step}, not the newer " + ", ".join(f"{p} ({why})" for p, why in newer.items()))
        tiers.last_load["skipped"] = {**newer, **skipped}
        return got
    tiers.last_load = {
        "step": None,
        "source": None,
        "s3_ranks": [],
        "reasons": {},
        "skipped": {**_newer("", partial, every, refused), **skipped},
    }
    return None


def _load_step(
    tiers: Tiers,
    s3: _S3Steps,
    step: str,
    mine: Mapping[str, tuple[Any, dict[str, str]]],
    every: list[dict[str, str | None]],
    common: set[str],
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
    skipped: dict[str, str],
) -> dict[str, Any] | None:
    """Every rank: load ``step`` from this rank's local copy, or from S3 when that copy cannot serve or is
    not proven to be of the save S3 holds (module docstring of :mod:`dcp_s3._checkpointer.saves`). None
    (the reason in ``skipped``, warned) when neither tier can serve it."""
    problem = (
        check_copy(tiers.local, *mine[step], model_dict, optimizer_dict)
        if step in mine
        else tiers.unusable.get(step, tiers.refused or "no local copy")
    )
    bad = {r: p for r, p in enumerate(_gather(tiers, problem)) if p}
    save: StoredSave | None = None
    if bad or step not in common:
        save, why = s3.save(step)
        if save is None:
            skipped[step] = _skip(step, _describe(bad) or "the ranks' local copies are of different saves of it", why)
            return None
        bad.update(_other_save(step, every, bad, save))
    if len(bad) == len(every):
        log.info("loading step %s from S3: no rank has a usable local copy (%s)", step, _describe(bad))
        tiers.last_load = {"step": step, "source": "s3", "s3_ranks": sorted(bad), "reasons": bad}
        return {"s3_step": step}
    me = rank()
    if me in bad:
        assert save is not None  # bad ranks exist: S3's save was read
        marker, dirs = load_marker_bytes(save.marker_data, tiers.s3.url(step + MARKER_SUFFIX)), save.dirs
    else:
        marker, dirs = mine[step]
    error = _attempt(tiers.s3 if me in bad else tiers.local, dirs, model_dict, optimizer_dict, me not in bad)
    failed = {r: e for r, e in enumerate(_gather(tiers, (error, me not in bad))) if e[0]}
    if any(not was_local for _, was_local in failed.values()):
        raise DcpS3Error(
            f"loading step {step} from S3 failed: "
            + "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(failed.items()))
        )
    if failed:
        lost = {r: f"its local copy failed to load: {e}" for r, (e, _) in failed.items()}
        if save is None:
            save, why = s3.save(step)
            if save is None:
                skipped[step] = _skip(step, _describe(lost), why)
                return None
        other = _other_save(step, every, {**bad, **lost}, save)
        bad.update(lost)
        if other:  # ranks loaded a local save that S3 does not hold: every rank reads S3's
            bad.update(other)
            warn(
                f"step {step}: local copies failed to load, and S3 holds another save of it: every rank "
                f"reads S3 ({_describe(bad)})"
            )
            tiers.last_load = {"step": step, "source": "s3", "s3_ranks": sorted(bad), "reasons": bad}
            return {"s3_step": step}
        warn(f"step {step}: local copies failed to load, those ranks read S3 (the same save): {_describe(lost)}")
        error = None
        if me in lost:
            marker = load_marker_bytes(save.marker_data, tiers.s3.url(step + MARKER_SUFFIX))
            error = _attempt(tiers.s3, save.dirs, model_dict, optimizer_dict, False)
        again = {r: e for r, e in enumerate(_gather(tiers, error)) if e}
        if again:
            raise DcpS3Error(f"loading step {step} from S3 failed: {_describe(again)}")
    source = "local" if not bad else "mixed"
    if bad:
        log.info(
            "loaded step %s: ranks %s from S3 (%s), the others from the local tier (save %s)",
            step,
            sorted(bad),
            _describe(bad),
            save.token if save else None,
        )
    tiers.last_load = {"step": step, "source": source, "s3_ranks": sorted(bad), "reasons": bad}
    return {"step": step, "marker": marker, "source": source}


def _other_save(
    step: str, every: list[dict[str, str | None]], bad: Mapping[int, str], save: StoredSave
) -> dict[int, str]:
    """The ranks not in ``bad`` whose local copy of ``step`` is not proven to be of ``save``: they must not
    be combined with parts read from it."""
    out = {}
    for r, view in enumerate(every):
        token = view.get(step)
        if r not in bad and (token is None or token != save.token):
            out[r] = (
                f"its local copy is of save {token}, S3 holds save {save.token}: not combined"
                if token
                else "its local copy records no save token: not combined with S3's parts"
            )
    return out


def _skip(step: str, local: str, why: str) -> str:
    """Warn that ``step`` is skipped, and say why (for ``last_load["skipped"]``): ``local``, why the local
    tier cannot serve it, ``why`` S3 cannot."""
    reason = f"{local}; and {why}"
    warn(f"step {step} is not loaded: {reason}")
    return reason


def _agreed(views: list[dict[str, str | None]]) -> set[str]:
    """The steps every rank's view holds, with one save token."""
    return {s for s, save in views[0].items() if all(s in v and v[s] == save for v in views)}


def _newer(
    step: str, partial: list[str], every: list[dict[str, str | None]], refused: Mapping[str, str]
) -> dict[str, str]:
    """Why each step newer than ``step`` that was never a candidate cannot be loaded (by step)."""
    out = {}
    for p in (p for p in partial if _order(p) > _order(step)):
        held = [r for r, x in enumerate(every) if p in x]
        out[p] = (
            f"committed locally on ranks {held} only, and not on S3"
            if len(held) < len(every)
            else "the ranks' local copies are of different saves of it, and it is not on S3"
        )
    for p in sorted(refused):
        if _order(p) > _order(step) and p not in out:
            out[p] = f"its copies under the local root cannot be combined: {refused[p]}"
    return out


def _load_merged(
    tiers: Tiers,
    s3: _S3Steps,
    step: str,
    shared: Shared,
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
    skipped: dict[str, str],
) -> dict[str, Any] | None:
    """Every rank: load ``step`` from the copies of all its saving ranks, of one save
    (:mod:`dcp_s3._checkpointer.tier_reshard`); if they cannot serve it, every rank loads it from S3.
    Returns what :func:`tiered_load` returns, or None when the step cannot be had (warned): the next is tried."""
    merged, problem = check_shared(tiers.local_root, shared, model_dict, optimizer_dict)
    bad = {r: p for r, p in enumerate(_gather(tiers, problem)) if p}
    if not bad:
        try:
            load_merged(tiers.local_root, merged, model_dict, optimizer_dict)
            error = None
        except (Exception, CheckpointException) as exc:  # a corrupt or vanished object: decided on by all ranks
            error = short_reason(exc)
        bad = {r: e for r, e in enumerate(_gather(tiers, error)) if e}
    if not bad:
        log.info(
            "loaded step %s from the local tier: the copies of its %d saving ranks under %s, resharded",
            step,
            shared.world_size,
            tiers.local_root,
        )
        tiers.last_load = {
            "step": step,
            "source": "local",
            "s3_ranks": [],
            "reasons": {},
            "resharded_from": shared.world_size,
        }
        return {"step": step, "marker": shared.copies[0].marker, "source": "local"}
    save, why = s3.save(step)
    if save is None:
        skipped[step] = _skip(step, _describe(bad), why)
        return None
    warn(
        f"step {step}: the copies of its {shared.world_size} saving ranks under {tiers.local_root} cannot serve "
        f"this load, it is read from S3: {_describe(bad)}"
    )
    tiers.last_load = {"step": step, "source": "s3", "s3_ranks": list(range(world_size())), "reasons": bad}
    return {"s3_step": step}


def _describe(bad: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
