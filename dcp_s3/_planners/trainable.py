"""DCP planners that save/load only trainable state, and skip loading on meta ranks.

Fine-tuning (LoRA, adapters, partial unfreezing) leaves most weights frozen;
re-saving them every checkpoint wastes time and storage. The trainable-only
planners leave out the state-dict entries of parameters with
``requires_grad=False`` and keep everything else (trainable parameters,
buffers, optimizer state, extra objects).

When a model is built on the meta device on every rank but one, those ranks
must still take part in ``dcp.load``'s collectives, but must neither allocate
nor read anything. ``DefaultLoadPlanner`` would replace their meta tensors with
real ``empty_like`` tensors and read into them; ``MetaRankLoadPlanner`` gives
such a rank an empty plan instead.

The planners work with any storage writer/reader. They keep no module
references, only the set of frozen parameter names, so they stay picklable
(``dcp.async_save`` may pickle the planner into another process).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.distributed.tensor import DTensor

from dcp_s3._planners.load import ScalableLoadPlanner
from dcp_s3._torch_compat import flatten_state_dict
from dcp_s3.errors import CheckpointFormatError, ConfigError, InvalidTypeError

__all__ = [
    "TrainableOnlySavePlanner",
    "TrainableOnlyLoadPlanner",
    "MetaRankLoadPlanner",
    "frozen_parameter_fqns",
]

logger = logging.getLogger(__name__)

ModuleOrModules = nn.Module | Mapping[str, nn.Module]

# Name segments that wrappers (torch.compile, activation checkpointing, FSDP1)
# insert into parameter names but that state-dict helpers may leave out.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# Reserved SavePlan.planner_data key carrying a rank's left-out keys to the coordinator.
_LEFT_OUT_KEY = "__dcp_s3_left_out_frozen__"


def _clean_fqn(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS)


def frozen_parameter_fqns(module_or_modules: ModuleOrModules) -> frozenset[str]:
    """Names of the parameters with ``requires_grad=False``, as state-dict keys.

    Pass a module whose state dict is the whole DCP state dict, or a mapping
    ``{"model": model, ...}`` when the state dict nests each module's state dict
    under that top-level key. Wrapper segments (``_orig_mod`` ...) are removed,
    so keys from ``module.state_dict()`` and from ``get_model_state_dict`` match.
    """
    modules = {"": module_or_modules} if isinstance(module_or_modules, nn.Module) else module_or_modules
    frozen = set()
    for prefix, module in modules.items():
        if not isinstance(module, nn.Module):
            raise InvalidTypeError(
                f"frozen_parameter_fqns: expected an nn.Module for key {prefix!r}, got {type(module).__name__}"
            )
        for name, param in module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                frozen.add(_clean_fqn(f"{prefix}.{name}" if prefix else name))
    return frozenset(frozen)


def _local_nbytes(value: Any) -> int:
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _split_frozen(
    state_dict: dict[str, Any], frozen: frozenset[str], who: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a (flattened) state dict into (kept, left-out frozen) entries."""
    kept: dict[str, Any] = {}
    left_out: dict[str, Any] = {}
    for key, value in state_dict.items():
        (left_out if _clean_fqn(key) in frozen else kept)[key] = value
    if frozen and not left_out:
        logger.warning(
            "%s: none of the %d frozen parameters (e.g. %r) is a key of the state dict; "
            "if the state dict nests the model under a key, pass {key: model}",
            who,
            len(frozen),
            min(frozen),
        )
    return kept, left_out


class TrainableOnlySavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that leaves out parameters with ``requires_grad=False``.

    Every rank must freeze the same parameters; the coordinator checks this and
    raises ``ValueError`` naming a key on which ranks disagree.
    """

    def __init__(self, module_or_modules: ModuleOrModules, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frozen_fqns = frozen_parameter_fqns(module_or_modules)
        self._left_out: tuple[str, ...] = ()

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.state_dict, left_out = _split_frozen(self.state_dict, self.frozen_fqns, type(self).__name__)
        self.mappings = {k: v for k, v in self.mappings.items() if k not in left_out}
        self._left_out = tuple(sorted(left_out))
        logger.info(
            "TrainableOnlySavePlanner: leaving out %d frozen entries (%d bytes on this rank)",
            len(left_out),
            sum(map(_local_nbytes, left_out.values())),
        )

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable:  # plan caching: an unchanged plan is not sent again
            return plan
        return dataclasses.replace(plan, planner_data={**(plan.planner_data or {}), _LEFT_OUT_KEY: self._left_out})

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        left_out_by_rank: dict[int, frozenset[str]] = {}
        stripped = []
        for rank, plan in enumerate(all_plans):
            data = plan.planner_data
            if isinstance(data, dict) and _LEFT_OUT_KEY in data:
                left_out_by_rank[rank] = frozenset(data[_LEFT_OUT_KEY])
                rest = {k: v for k, v in data.items() if k != _LEFT_OUT_KEY}
                plan = dataclasses.replace(plan, planner_data=rest if self.flatten_state_dict else None)
            stripped.append(plan)
        _check_same_left_out(left_out_by_rank)
        return super().create_global_plan(stripped)


def _check_same_left_out(left_out_by_rank: dict[int, frozenset[str]]) -> None:
    """Raise ``ConfigError`` naming a key that some ranks leave out and others save."""
    if len(set(left_out_by_rank.values())) <= 1:
        return
    disputed = set.union(*map(set, left_out_by_rank.values())) - frozenset.intersection(*left_out_by_rank.values())
    key = min(disputed)
    frozen_on = [r for r, keys in left_out_by_rank.items() if key in keys]
    saved_on = [r for r, keys in left_out_by_rank.items() if key not in keys]
    raise ConfigError(
        f"TrainableOnlySavePlanner: ranks disagree on frozen parameters ({len(disputed)} keys): "
        f"{key!r} is frozen (requires_grad=False) on ranks {frozen_on} but saved on ranks {saved_on}; "
        "every rank must freeze the same parameters"
    )


def _is_meta_rank(state_dict: STATE_DICT_TYPE) -> bool:
    """True if every tensor is on the meta device; ``ConfigError`` if only some are."""
    flat, _ = flatten_state_dict(state_dict)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    meta = [k for k, v in tensors.items() if v.is_meta]
    if meta and len(meta) < len(tensors):
        real = next(k for k, v in tensors.items() if not v.is_meta)
        raise ConfigError(
            f"state dict is partly on the meta device: {meta[0]!r} is meta but {real!r} is not "
            f"({len(meta)} of {len(tensors)} tensors are meta); a rank must load all of its tensors "
            "or have all of them on the meta device"
        )
    return bool(meta)


class MetaRankLoadPlanner(ScalableLoadPlanner):
    """``DefaultLoadPlanner`` (as ``ScalableLoadPlanner``: its local plan visits only the chunks a rank
    needs) that gives a rank whose tensors are all meta an empty plan.

    Such a rank takes part in the collectives of ``dcp.load`` (it still reads the
    small ``.metadata``) but allocates and reads nothing: its tensors stay on
    the meta device and its non-tensor entries are left as they are. A rank with
    only some tensors on the meta device gets a ``ValueError`` naming a meta key.
    Other ranks load exactly like ``DefaultLoadPlanner``.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.is_meta_rank = False

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.is_meta_rank = _is_meta_rank(state_dict)
        if not self.is_meta_rank:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        # Skip DefaultLoadPlanner.set_up_planner: it would materialize the meta tensors.
        self.original_state_dict, self.state_dict, self.mappings = state_dict, {}, {}
        self.metadata, self.is_coordinator = metadata, is_coordinator
        logger.info("%s: every tensor is on the meta device; this rank loads nothing", type(self).__name__)

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([]) if self.is_meta_rank else super().create_local_plan()


class TrainableOnlyLoadPlanner(MetaRankLoadPlanner):
    """Load counterpart of ``TrainableOnlySavePlanner``, with ``MetaRankLoadPlanner``'s meta handling.

    Frozen parameters are neither required in the checkpoint nor written to:
    they keep their values even when the checkpoint has them. A trainable entry
    missing from the checkpoint raises ``CheckpointFormatError`` naming the key
    (unless ``allow_partial_load=True``).
    """

    def __init__(self, module_or_modules: ModuleOrModules, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frozen_fqns = frozen_parameter_fqns(module_or_modules)

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.is_meta_rank or self.metadata is None:
            return
        self.state_dict, _ = _split_frozen(self.state_dict, self.frozen_fqns, type(self).__name__)
        # Hide frozen entries of a full checkpoint too, so they are not read.
        stored = self.metadata.state_dict_metadata
        self.metadata = dataclasses.replace(
            self.metadata,
            state_dict_metadata={k: v for k, v in stored.items() if _clean_fqn(k) not in self.frozen_fqns},
        )

    def create_local_plan(self) -> LoadPlan:
        if not self.is_meta_rank and not self.allow_partial_load and self.metadata is not None:
            missing = sorted(k for k in self.state_dict if k not in self.metadata.state_dict_metadata)
            if missing:
                raise CheckpointFormatError(
                    f"trainable entry {missing[0]!r} is not in the checkpoint ({len(missing)} missing in all); "
                    "was it frozen when the checkpoint was saved? Pass allow_partial_load=True to skip missing keys"
                )
        return super().create_local_plan()
