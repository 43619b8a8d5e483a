"""The integrations' one way to carry a framework's side state inside the DCP commit.

Frameworks write their non-tensor state apart from the shards: Megatron's ``common.pt`` and ``metadata.json``,
Lightning's ``meta.pt``, each by rank 0 to a local file next to the DCP checkpoint. On S3 that would be a second
object with no commit of its own (a save that dies between the two leaves shards of one save beside state of
another). Here the side state travels *inside* the same DCP checkpoint: rank 0 adds each side object to its
state dict as one more item under a reserved key (:func:`carry`), so the checkpoint's ``.metadata`` commits
tensors and side state at once, and every rank reads it back from the one save it loads (:func:`as_dict`
checks what came back). Each side object is a ``torch.save`` archive, read with dcp_s3's checks of untrusted
archives (:mod:`dcp_s3._untrusted`): as a byte item (``io.BytesIO``: Megatron), or as one ``uint8`` tensor
(Lightning's stored format, sized before it is allocated by the rule of byte items).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes
from dcp_s3.errors import CheckpointFormatError, ConfigError

__all__ = ["carry", "as_dict"]


def carry(
    state: dict[str, Any],
    side: Mapping[str, Any],
    location: str,
    *,
    rank: int,
    reserved: Iterable[str] = (),
    as_tensor: bool = False,
) -> dict[str, Any]:
    """``state`` with rank 0's ``side`` objects added (``torch.save`` archives: byte items, or ``uint8`` tensors
    with ``as_tensor``); every rank calls it. ``ConfigError`` when ``state`` already holds one of the side keys
    or of ``reserved`` (keys the side state takes on rank 0 only)."""
    clash = sorted(set(state) & (set(side) | set(reserved)))
    if clash:
        raise ConfigError(f"state keys {clash} are reserved for the framework's side state in {location}")
    if rank != 0:
        return state
    for key, obj in side.items():
        data = torch_save_bytes(obj)
        state[key] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if as_tensor else io.BytesIO(data)
    return state


def as_dict(obj: Any, location: str, key: str) -> dict[str, Any]:
    """``obj``, the side object ``key`` read back from ``location``, if it is a dict; else ``CheckpointFormatError``.
    A byte item loaded into an ``io.BytesIO`` (torch's default load planner) is decoded first, weights-only, with
    dcp_s3's checks of untrusted archives."""
    if isinstance(obj, io.BytesIO):
        obj = torch_load(obj.getvalue(), f"{location} ({key})", weights_only=True)
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{location} ({key}): expected a dict, found {type(obj).__name__}")
    return obj
