"""What ``test_bombs``' child process runs: load a checkpoint into a blank state, then use what it got."""

from __future__ import annotations

from typing import Any

import torch
from hostile import load_direct


def _blank(spec: Any) -> Any:
    """Lists of ints become zero tensors of that shape, dicts recurse, anything else is a byte item's slot."""
    if isinstance(spec, dict):
        return {k: _blank(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return torch.zeros(spec)
    return spec


def _use(value: Any) -> None:
    """Touch every tensor loaded (a sparse one is coalesced and densified, as a consumer would)."""
    if isinstance(value, dict):
        for v in value.values():
            _use(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _use(v)
    elif isinstance(value, torch.Tensor):
        (value.coalesce().to_dense() if value.layout == torch.sparse_coo else value).sum()


def blank_load(path: str, spec: dict[str, Any]) -> None:
    state = _blank(spec)
    load_direct(path, state)
    _use(state)
