"""What the checkpoint manager saves besides DCP parts: argument checks, ``state_dict()`` capture
and restore of schedulers/scaler/callbacks, and the checks on models it loads into."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from dcp_s3.errors import CheckpointFormatError, ConfigError, InvalidTypeError

__all__ = ["check_dicts", "state_of", "restore", "on_meta", "sharded", "warn"]

log = logging.getLogger(__name__)


def warn(message: str) -> None:
    """Log ``message`` and ``warnings.warn`` it (the dcp_s3 logger has only a NullHandler by default)."""
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def check_dicts(model_dict: Mapping[str, Any], optimizer_dict: Mapping[str, Any] | None) -> None:
    """``model_dict`` maps part names (no ``.`` or ``/``) to modules; ``optimizer_dict`` uses the same names."""
    if not isinstance(model_dict, Mapping) or not model_dict:
        raise InvalidTypeError(f"model_dict must be a non-empty dict of name -> nn.Module, got {_what(model_dict)}")
    for key, model in model_dict.items():
        if not isinstance(key, str) or not key or "." in key or "/" in key:
            raise ConfigError(f"model_dict key {key!r} must be a non-empty string without '.' or '/'")
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(f"model_dict[{key!r}] is a {type(model).__name__}, not an nn.Module")
    extra = sorted(set(optimizer_dict or {}) - set(model_dict))
    if extra:
        raise ConfigError(f"optimizer_dict keys {extra} are not in model_dict (it maps the same names)")


def on_meta(model: nn.Module) -> bool:
    """Whether every tensor of ``model`` is on the meta device (the rank loads nothing)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def state_of(obj: Any, what: str) -> Any:
    """``state_dict()`` of an object, or of each value of a dict / item of a list (``what`` names it in errors)."""
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return {k: state_of(v, f"{what}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [state_of(v, f"{what}[{i}]") for i, v in enumerate(obj)]
    raise InvalidTypeError(f"{what}: cannot save a {type(obj).__name__}: it has no state_dict()")


def restore(obj: Any, state: Any, what: str) -> None:
    """``load_state_dict`` ``state`` into ``obj`` (a dict or list of such objects); a missing entry warns."""
    if obj is None:
        return
    if state is None:
        warn(f"the checkpoint has no {what} state; {what} keeps its current state")
        return
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if isinstance(state, Mapping) and key in state:
                restore(value, state[key], f"{what}[{key!r}]")
            else:
                warn(f"the checkpoint has no {what}[{key!r}] state; it keeps its current state")
    elif isinstance(obj, (list, tuple)):
        if not isinstance(state, (list, tuple)) or len(state) != len(obj):
            raise CheckpointFormatError(f"the checkpoint's {what} state does not match: expected {len(obj)} entries")
        for i, (value, sub) in enumerate(zip(obj, state, strict=True)):
            restore(value, sub, f"{what}[{i}]")
    else:
        raise InvalidTypeError(f"{what}: cannot restore a {type(obj).__name__}: it has no load_state_dict()")


def _what(obj: Any) -> str:
    return f"an empty {type(obj).__name__}" if isinstance(obj, Mapping) else f"a {type(obj).__name__}"
