"""The parts of a :class:`~dcp_s3._checkpointer.manager.Checkpointer` save, and the handle of an asynchronous one."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from dcp_s3._planners.trainable import TrainableOnlySavePlanner

__all__ = ["AsyncSave", "Part", "save_parts"]


class AsyncSave:
    """Handle of an asynchronous save: ``result()`` waits for it and returns the step location.

    Returned by ``save`` of a ``Checkpointer(..., async_save=True)``, not made by users.

    Args:
        path: the step's location (``<save_dir>/<step>``), also the ``path`` attribute.
        future: the save running in the background; its result is ``path``.
    """

    def __init__(self, path: str, future: Future[str]) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        """Wait until every part is written and (on rank 0) the marker too; re-raise any failure.

        Args:
            timeout: seconds to wait at most (then ``TimeoutError``); None: until the save ends.

        Returns:
            The step's location.
        """
        return self._future.result(timeout)

    wait = result

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSave({self.path!r}, {state})"


#: One part of a save: (model key, "model" or "optim", its state dict, the planner that saves it).
Part = tuple[str, str, dict[str, Any], Any]


def save_parts(
    model_dict: Mapping[str, nn.Module], optimizer_dict: Mapping[str, torch.optim.Optimizer] | None
) -> list[Part]:
    """The parts of a save: each model's trainable state, then its optimizer's state if it has one."""
    parts: list[Part] = []
    for key, model in model_dict.items():
        parts.append((key, "model", get_model_state_dict(model), TrainableOnlySavePlanner(model)))
        if optimizer_dict is not None and key in optimizer_dict:
            osd = get_optimizer_state_dict(model, optimizer_dict[key])
            parts.append((key, "optim", osd, DefaultSavePlanner()))
    return parts
