"""What one rank does on its own in a tiered load (:mod:`~dcp_s3._checkpointer.tier_load` decides, with
every rank, which step is loaded from which tier).

:func:`check_copy` says why this rank's local copy of a step cannot serve its load: a part missing, a
layout (rank, world size, sharding) other than the load's, an object missing or shorter than its items
need; the load itself then checks every item's checksum. :func:`load_alone` loads every part on this
rank without a collective (``no_dist``): a local copy, whose shards are this rank's local tensors, or
S3's global checkpoint. :func:`short_reason` names in one line why that failed, which the ranks then
exchange: the real cause, not torch's whole ``CheckpointException`` text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcp_s3._checkpointer.local_layout import from_view, layout_mismatch, layout_of, local_view
from dcp_s3._checkpointer.markers import LAYOUT
from dcp_s3._checkpointer.training_state import on_meta, warn
from dcp_s3._dcp import Store
from dcp_s3._layout import METADATA_KEY
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._planners.optim_match import OptimizerLoadPlanner
from dcp_s3._planners.trainable import TrainableOnlyLoadPlanner, TrainableOnlySavePlanner
from dcp_s3._torch_compat import checkpoint_failures
from dcp_s3.errors import CheckpointNotFoundError, DcpS3Error

__all__ = ["check_copy", "load_alone", "short_reason"]


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


def check_copy(
    store: Store,
    marker: Any,
    dirs: Mapping[str, str],
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
) -> str | None:
    """Why this rank's local copy (``marker``, part directories ``dirs`` in ``store``) cannot serve its load,
    or None."""
    layouts = marker.get(LAYOUT) if isinstance(marker, dict) else None
    layouts = layouts if isinstance(layouts, dict) else {}
    try:
        for key, model in model_dict.items():
            if on_meta(model):
                return "the model is on the meta device"
            why = _covers(
                store,
                dirs.get(f"{key}_model"),
                layouts.get(f"{key}_model"),
                get_model_state_dict(model),
                TrainableOnlySavePlanner(model),
            )
            if why:
                return why
        for key, optim in sorted((optimizer_dict or {}).items()):
            state = get_optimizer_state_dict(model_dict[key], optim)
            why = _covers(store, dirs.get(f"{key}_optim"), layouts.get(f"{key}_optim"), state, DefaultSavePlanner())
            if why:
                return why
    except (DcpS3Error, OSError) as exc:
        return short_reason(exc)
    return None


def load_alone(
    store: Store,
    dirs: Mapping[str, str],
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
    local: bool,
) -> None:
    """Load every part from ``store`` on this rank alone (``no_dist``: no collective): a local copy
    (``local``: local tensors, :mod:`dcp_s3._checkpointer.local_layout`) or a global checkpoint on S3."""
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
            warn(
                f"optimizer checkpoint {store.url(dirs[f'{key}_optim'])} does not match the optimizer "
                f"({planner.problem}); continuing with fresh optimizer state"
            )
        elif osd:
            set_optimizer_state_dict(model, optim, osd)


def short_reason(exc: BaseException, limit: int = 400) -> str:
    """One line naming ``exc``'s real cause: for torch's ``CheckpointException`` (whose text is every
    rank's traceback, naming rank 0 for a ``no_dist`` load on any rank) the exception it carries."""
    causes = checkpoint_failures(exc)
    cause = causes[0] if causes else exc
    text = " ".join(f"{type(cause).__name__}: {cause}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
