"""Lightning Fabric's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) saving and loading ``s3://`` checkpoints through dcp_s3.

    fabric = Fabric(strategy=S3FabricStrategy(parallelize_fn, options={"endpoint_url": ...}))
    fabric.save("s3://bucket/run/step-100", {"model": model, "optimizer": optimizer, "step": 100})

An ``s3://`` path is one DCP checkpoint: the model and optimizer shards, and the rest of the state
(what Lightning writes to ``meta.pt`` on rank 0's disk) inside it
(:mod:`~dcp_s3.integrations.lightning_io`). Any other path goes to Lightning's own code unchanged.
Differences from Lightning's sharded load, on ``s3://`` paths: model and optimizers are read in one
``dcp.load``; a state value with ``load_state_dict`` (a scheduler, a stateful data loader) is
restored in place, as Fabric's other strategies do, instead of being replaced by its state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3.errors import ConfigError
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations.lightning_io import load_sharded, save_sharded

__all__ = ["S3FabricStrategy", "sharded_module_key", "is_stateful"]


def _is_sharded_module(obj: object) -> bool:
    return isinstance(obj, Module) and any(isinstance(p, DTensor) for p in obj.parameters())


def sharded_module_key(state: Mapping[str, Any], location: str) -> str:
    """The key of the one distributed (DTensor) module in ``state``; ``ConfigError`` if none or several."""
    keys = [k for k, v in state.items() if _is_sharded_module(v)]
    if len(keys) != 1:
        found = "no distributed model" if not keys else f"{len(keys)} distributed models ({', '.join(keys)})"
        raise ConfigError(
            f"checkpoint {location}: the state must hold exactly one model set up by the strategy; found {found}"
        )
    return keys[0]


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` has ``state_dict`` and ``load_state_dict`` (Lightning's ``_Stateful``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class S3FabricStrategy(ModelParallelStrategy):
    """``lightning.fabric.strategies.ModelParallelStrategy`` whose ``s3://`` checkpoints go through dcp_s3.

    ``options``: a :class:`dcp_s3.StorageOptions` or a mapping of its keywords (endpoint, credentials,
    ``part_size``, ``compression``...), used for every save and load; the other arguments are
    ``ModelParallelStrategy``'s. ``save_distributed_checkpoint=False`` (one ``torch.save`` file)
    is refused for ``s3://`` paths.
    """

    def __init__(
        self,
        parallelize_fn: Callable[..., Module],
        *args: Any,
        options: StorageOptions | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(parallelize_fn, *args, **kwargs)
        self.storage_options = StorageOptions.of(options)

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        path = self.broadcast(path)  # rank 0's path, as Lightning does, before anything makes a Path of it
        location = s3_location(path)
        if location is None:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        if storage_options is not None:
            raise ConfigError(
                f"save_checkpoint({location}, storage_options=...): give the storage options to "
                f"{type(self).__name__}(options=...)"
            )
        if filter is not None:
            raise ConfigError(
                f"save_checkpoint({location}, filter=...): filtered sharded checkpoints are not supported"
            )
        if not self._save_distributed_checkpoint:
            raise ConfigError(
                f"{type(self).__name__}(save_distributed_checkpoint=False) writes one torch.save file; "
                f"{location} takes sharded checkpoints only"
            )
        sharded_module_key(state, location)
        module = next(v for v in state.values() if _is_sharded_module(v))
        sd_options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                tensors[key] = get_model_state_dict(obj, options=sd_options)
            elif isinstance(obj, Optimizer):
                tensors[key] = get_optimizer_state_dict(module, obj, options=sd_options)
            else:  # Lightning's rule: everything else is metadata
                metadata[key] = obj.state_dict() if is_stateful(obj) else obj
        save_sharded(tensors, metadata, location, self.storage_options, rank=self.global_rank)

    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = self.broadcast(path)
        location = s3_location(path)
        if location is None:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not state or not isinstance(state, dict):
            raise ConfigError(
                f"load_checkpoint({location}, state={type(state).__name__}): pass a dict holding at least the model, "
                "as in fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        module_key = sharded_module_key(state, location)
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        metadata = load_sharded(
            location,
            module_key,
            state[module_key],
            optimizers,
            self.storage_options,
            strict=strict,
            weights_only=weights_only,
        )
        metadata = {} if metadata is None else metadata
        requested = [k for k in state if k != module_key and k not in optimizers]
        missing = [k for k in requested if k not in metadata]
        if strict and missing:
            raise KeyError(
                f"checkpoint {location} holds no {', '.join(map(repr, missing))} (it has {sorted(metadata)}); "
                "pass strict=False to load it anyway"
            )
        for key in requested:
            if key not in metadata:
                continue
            value = metadata.pop(key)
            if is_stateful(state[key]):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata
