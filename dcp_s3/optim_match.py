"""Whether an optimizer's state fits a stored optimizer checkpoint, before loading into it."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ._torch_compat import flatten_state_dict

__all__ = ["optim_mismatch"]


def optim_mismatch(state: dict[str, Any], metadata: Metadata) -> str | None:
    """Why the optimizer's ``state.*`` entries do not fit the checkpoint's, or None if they do.

    Hyper-parameter entries (``param_groups.*``) are not compared: a torch release that adds
    an option must not make old checkpoints unloadable; missing ones keep their current values.
    """
    flat, _ = flatten_state_dict(state)
    stored = metadata.state_dict_metadata
    mine = {k for k in flat if k.startswith("state.")}
    theirs = {k for k in stored if k.startswith("state.")}
    if mine - theirs:
        return f"{len(mine - theirs)} entries missing from the checkpoint, e.g. {min(mine - theirs)!r}"
    if theirs - mine:
        return f"{len(theirs - mine)} unexpected entries in the checkpoint, e.g. {min(theirs - mine)!r}"
    for key in sorted(mine):
        value, md = flat[key], stored[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                return f"{key!r} is a tensor but the checkpoint stores an object"
            if tuple(value.shape) != tuple(md.size):
                return f"{key!r} has shape {tuple(value.shape)}, the checkpoint {tuple(md.size)}"
        elif not isinstance(md, BytesStorageMetadata):
            return f"{key!r} is an object but the checkpoint stores a tensor"
    return None
