"""Whether an optimizer's state fits a stored optimizer checkpoint, decided inside the load.

:class:`OptimizerLoadPlanner` compares the optimizer's entries with the ``.metadata`` that
``dcp.load`` hands to ``set_up_planner`` (read once and shared by the reader, see
:mod:`dcp_s3._planners.sharing`), so checking costs no extra GET. A rank that finds a mismatch plans no
reads and sends its reason to the coordinator in its local plan; the coordinator then gives
every rank an empty plan carrying that reason, so either all ranks load or none does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from dcp_s3._planners.load import ScalableLoadPlanner
from dcp_s3._torch_compat import flatten_state_dict

__all__ = ["optim_mismatch", "OptimizerLoadPlanner"]


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


class OptimizerLoadPlanner(ScalableLoadPlanner):
    """``ScalableLoadPlanner(allow_partial_load=True)`` that loads nothing on any rank if, on some
    rank, the optimizer's state does not fit the checkpoint (:func:`optim_mismatch`).

    ``check=False`` (a rank whose model is on the meta device) plans no reads and never objects.
    After ``dcp.load`` returns, ``problem`` is the reason (the same on every rank) or None.
    """

    def __init__(self, check: bool = True) -> None:
        super().__init__(allow_partial_load=True)
        self.check = check
        self.problem: str | None = None
        self._mine: str | None = None

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # docstring inherited
        self.problem = None
        self._mine = optim_mismatch(state_dict, metadata) if self.check and metadata is not None else None
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        # docstring inherited; a mismatching state is not planned (the default planner would
        # raise on the first shape that differs)
        if self._mine is not None:
            return LoadPlan([], planner_data=self._mine)
        return super().create_local_plan()

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        # docstring inherited
        problems = [p.planner_data for p in global_plan if isinstance(p.planner_data, str)]
        if problems:
            return [replace(p, items=[], planner_data=problems[0]) for p in global_plan]
        return super().create_global_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        # docstring inherited
        if isinstance(central_plan.planner_data, str):
            self.problem = central_plan.planner_data
        return super().finish_plan(central_plan)
