"""Loading single-file (Megatron-style) checkpoints: ``torch.save`` of
``{"model": ..., "optimizer": ..., "iteration": ...}``, and telling them apart from step markers."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from dcp_s3._checkpointer.training_state import on_meta, sharded, warn
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = ["ALLOW_MISSING_OPTIM_ENV", "is_foreign_step_marker", "load_legacy"]

log = logging.getLogger(__name__)

ALLOW_MISSING_OPTIM_ENV = "DCP_S3_ALLOW_MISSING_OPTIM"


def is_foreign_step_marker(marker: dict[str, Any]) -> bool:
    """A step marker written by another checkpointer with this layout: ``torch.save`` of
    ``{"iteration", "scheduler", "grad_scaler", "callbacks"}``, no ``format``, no model state.
    Whether its ``<step>.<key>_model`` parts exist is checked like for dcp_s3's own markers."""
    return "format" not in marker and "model" not in marker and isinstance(marker.get("iteration"), int)


def load_legacy(
    marker: dict[str, Any],
    where: str,
    model_dict: Mapping[str, nn.Module],
    optimizer_dict: Mapping[str, torch.optim.Optimizer] | None,
    allow_missing_optim: bool,
) -> int:
    """Load a single-file checkpoint already read from ``where`` (every rank reads it); returns its iteration."""
    models, optims = marker["model"], marker.get("optimizer")
    single = len(model_dict) == 1
    for key, model in model_dict.items():
        msd = models if single else models.get(key)
        if msd is None:
            raise CheckpointFormatError(f"legacy checkpoint {where} has no model state for {key!r}")
        if not on_meta(model):
            result = set_model_state_dict(model, msd, options=StateDictOptions(full_state_dict=True, strict=False))
            if result is not None and (result.missing_keys or result.unexpected_keys):
                log.warning(
                    "legacy checkpoint %s: %d missing, %d unexpected model keys (loaded non-strict)",
                    where,
                    len(result.missing_keys),
                    len(result.unexpected_keys),
                )
        optim = (optimizer_dict or {}).get(key)
        if optim is None or on_meta(model):
            continue
        osd = optims if single or optims is None else optims.get(key)
        if osd is None:
            if not allow_missing_optim:
                raise CheckpointNotFoundError(
                    f"legacy checkpoint {where} has no optimizer state; pass allow_missing_optim=True "
                    f"(or set {ALLOW_MISSING_OPTIM_ENV}=1) to continue with fresh optimizer state"
                )
            warn(f"legacy checkpoint {where} has no optimizer state; {key!r} continues with fresh state")
            continue
        try:
            if all(isinstance(k, int) for k in osd.get("state", {})) and not sharded(model):
                optim.load_state_dict(osd)
            else:
                set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(full_state_dict=True))
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            warn(
                f"legacy checkpoint {where}: optimizer state does not match ({exc}); "
                "continuing with fresh optimizer state"
            )
    iteration = marker.get("iteration", 0)
    if not isinstance(iteration, int) or isinstance(iteration, bool):  # stored bytes: never int() on them
        raise CheckpointFormatError(f"legacy checkpoint {where}: 'iteration' = {iteration!r:.80} is not a whole number")
    return iteration
