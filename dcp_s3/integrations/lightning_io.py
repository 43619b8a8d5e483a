"""What both Lightning strategies do with an ``s3://`` checkpoint: one DCP checkpoint holding everything.

Lightning's ``ModelParallelStrategy`` writes the tensors with ``dcp.save(checkpoint_id=path)`` and
then, on rank 0 only, ``torch.save(metadata, path / "meta.pt")``: the non-tensor state (step,
hyper-parameters, loops, callbacks, schedulers) is a second object that only rank 0 writes and
every rank must read. Here the metadata travels inside the same DCP checkpoint, as the bytes
Lightning would have written to ``meta.pt`` held in one ``uint8`` tensor (rank 0's item,
:data:`META_KEY`), so the checkpoint's ``.metadata`` commits tensors and metadata at once, and every
rank reads the metadata from the bucket. Loading unpickles those bytes as Lightning loads
``meta.pt`` — with ``weights_only`` unless the caller passes ``weights_only=False`` (or the storage
options say ``allow_unsafe_byte_items=True``) — after dcp_s3's own check of the archive
(:func:`dcp_s3._untrusted.torch_files.torch_load`), so a crafted checkpoint is a
``CheckpointFormatError``, never code that runs.

Nothing here imports Lightning; the strategies in :mod:`~dcp_s3.integrations.lightning_fabric` and
:mod:`~dcp_s3.integrations.lightning_trainer` call it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn import Module
from torch.optim import Optimizer

from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._layout import METADATA_KEY
from dcp_s3._untrusted.foreign_items import BYTE_ITEM_FLOOR, BYTE_ITEM_RATIO, byte_item_limit
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes
from dcp_s3.admin._cleanup import remove_checkpoint
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError, ConfigError

__all__ = [
    "META_KEY",
    "save_sharded",
    "load_sharded",
    "checkpoint_exists",
    "list_checkpoints",
    "delete_checkpoint",
]

logger = logging.getLogger(__name__)

#: The largest stored metadata read (its buffer is allocated before the read; a crafted ``.metadata``
#: could declare any size). Lightning's is kilobytes.
MAX_META_BYTES = 1 << 30

#: The state-dict key of Lightning's metadata (the bytes of its ``meta.pt``) inside the DCP checkpoint.
META_KEY = "lightning.meta.pt"


def _meta_tensor(metadata: Mapping[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(torch_save_bytes(dict(metadata))), dtype=torch.uint8)


def save_sharded(
    tensor_state: dict[str, Any], metadata: Mapping[str, Any], location: str, options: StorageOptions, *, rank: int
) -> None:
    """Save ``tensor_state`` (model and optimizer state dicts) and rank 0's ``metadata`` as one DCP
    checkpoint at ``location``; every rank calls it (a collective)."""
    if META_KEY in tensor_state:
        raise ConfigError(f"state key {META_KEY!r} is reserved for Lightning's metadata in {location}")
    state = dict(tensor_state)
    if rank == 0:
        state[META_KEY] = _meta_tensor(metadata)
    dcp.save(state, storage_writer=options.writer(location))
    logger.debug("saved Lightning checkpoint %s (metadata inside)", location)


def _trusted(options: StorageOptions, weights_only: bool | None) -> bool:
    return weights_only is False or bool(options.as_dict().get("allow_unsafe_byte_items"))


def _meta_size(metadata: Metadata, location: str) -> int | None:
    """The byte length of the stored metadata, or None when the checkpoint holds none. It is Lightning's
    ``meta.pt``, a byte item in all but name: the rule of byte items bounds it
    (:func:`~dcp_s3._untrusted.foreign_items.byte_item_limit`: at most 64 times its stored bytes, or 64 MiB),
    before its buffer is allocated, so a few stored kilobytes that decompress to a gigabyte are refused on
    every rank at no cost."""
    entry = metadata.state_dict_metadata.get(META_KEY)
    if entry is None:
        return None
    if not isinstance(entry, TensorStorageMetadata) or len(entry.size) != 1:
        raise CheckpointFormatError(f"{location}: {META_KEY} is not a 1-D byte tensor")
    size = int(entry.size[0])
    if entry.properties.dtype != torch.uint8 or not 0 <= size <= MAX_META_BYTES:
        raise CheckpointFormatError(
            f"{location}: {META_KEY} is not a uint8 tensor of at most {MAX_META_BYTES} bytes (size {size})"
        )
    stored = sum(int(info.length) for index, info in metadata.storage_data.items() if index.fqn == META_KEY)
    if size > byte_item_limit(stored):
        raise CheckpointFormatError(
            f"{location}: {META_KEY} declares {size} bytes stored in {stored}: more than {byte_item_limit(stored)} "
            f"(a byte item decodes to at most {BYTE_ITEM_RATIO} times its stored bytes, or {BYTE_ITEM_FLOOR >> 20} MiB)"
        )
    return size


class _MetaLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner that also loads the stored metadata, sized from the ``.metadata`` the
    load has read (once, on its coordinator, shared): no read of ``.metadata`` before the load, on any rank."""

    def __init__(self, location: str) -> None:
        super().__init__()
        self.location = location
        self.meta: torch.Tensor | None = None

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        size = None if metadata is None else _meta_size(metadata, self.location)
        if size is not None:
            self.meta = state_dict[META_KEY] = torch.empty(size, dtype=torch.uint8)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _decode_meta(data: torch.Tensor, location: str, options: StorageOptions, weights_only: bool | None) -> dict:
    meta = torch_load(
        data.numpy().tobytes(), f"{location} ({META_KEY})", weights_only=not _trusted(options, weights_only)
    )
    if not isinstance(meta, dict):
        raise CheckpointFormatError(f"{location} ({META_KEY}): expected a dict, found {type(meta).__name__}")
    return meta


def load_sharded(
    location: str,
    module_key: str,
    module: Module,
    optimizers: Mapping[str, Optimizer],
    options: StorageOptions,
    *,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any] | None:
    """Load ``module`` and ``optimizers`` in place from the checkpoint at ``location`` (resharding as
    DCP does) in one ``dcp.load``; returns the stored metadata, or None when it holds none."""
    request: dict[str, Any] = {module_key: get_model_state_dict(module)}
    for key, optimizer in optimizers.items():
        request[key] = get_optimizer_state_dict(module, optimizer)
    planner = _MetaLoadPlanner(location)
    dcp.load(request, storage_reader=options.reader(location), planner=planner)
    module.load_state_dict(request[module_key], strict=strict)
    for key, optimizer in optimizers.items():
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=request[key], options=StateDictOptions(cpu_offload=True)
        )
    return None if planner.meta is None else _decode_meta(planner.meta, location, options, weights_only)


def checkpoint_exists(location: str, options: StorageOptions) -> bool:
    """Whether a committed checkpoint is at ``location`` (its ``.metadata`` is there)."""
    return options.store(location).size(METADATA_KEY) is not None


def list_checkpoints(directory: str, options: StorageOptions) -> list[str]:
    """The committed checkpoints directly under ``directory``, as locations, sorted."""
    store = options.store(directory)
    _, subdirs = store.list_dir("")
    names = (d.rstrip("/") for d in subdirs)
    return sorted(f"{directory}/{n}" for n in names if store.size(f"{n}/{METADATA_KEY}") is not None)


def delete_checkpoint(location: str, options: StorageOptions) -> None:
    """Delete the checkpoint at ``location`` (its ``.metadata`` first, so it is never half there);
    one that is not there is no error (as Lightning's own removal)."""
    try:
        removal = remove_checkpoint(location, **options.as_dict())
    except CheckpointNotFoundError:
        logger.debug("no checkpoint to remove at %s", location)
        return
    logger.debug("removed checkpoint %s (%d objects)", location, len(removal.objects))
