"""dcp_s3's save planners take torch's ``set_up_planner(state_dict, storage_meta, is_coordinator)``.

torch's save (``state_dict_saver._save_state_dict``, torch 2.7-2.15) passes ``storage_meta`` and
``is_coordinator`` by keyword only to a planner whose ``set_up_planner`` declares a parameter named
``storage_meta``; to any other it warns (a ``UserWarning`` on every save, on every rank) and calls
``set_up_planner(state_dict, is_coordinator)`` positionally, so the coordinator's flag lands in
``storage_meta`` and ``is_coordinator`` is False on every rank.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

import dcp_s3._planners  # noqa: F401  (registers dcp_s3's planners as subclasses)
from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._planners.scale import ScalableSavePlanner


class Observed(ScalableSavePlanner):
    """Records what torch's set-up left on the planner (it does not override ``set_up_planner``)."""

    def create_local_plan(self) -> SavePlan:
        self.seen_coordinator = self.is_coordinator
        return super().create_local_plan()


def coordinator_job(rank: int, world: int, env: dict[str, str], uri: str) -> dict[str, Any]:
    os.environ.update(env)
    planner = Observed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"w": torch.full((3,), float(rank)), "step": 7}, storage_writer=S3StorageWriter(uri), planner=planner)
    out = {"w": torch.zeros(3), "step": -1}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    return {
        "is_coordinator": planner.seen_coordinator,
        "warnings": [str(w.message) for w in caught if "set_up_planner" in str(w.message)],
        "step": out["step"],
    }


@pytest.mark.multiproc
def test_rank_0_is_the_coordinator_and_torch_does_not_warn(bucket: str, s3_env: LocalS3Server) -> None:
    results = run_ranks(coordinator_job, 2, s3_env.env(), f"s3://{bucket}/coord", timeout=300)
    assert [r["warnings"] for r in results] == [[], []]
    assert [r["is_coordinator"] for r in results] == [True, False]
    assert [r["step"] for r in results] == [7, 7]


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_dcp_s3_save_planner_declares_torchs_parameters() -> None:
    """Every save planner of dcp_s3 (those importable here) names its parameters as torch's does."""
    want = list(inspect.signature(DefaultSavePlanner.set_up_planner).parameters)
    assert want == ["self", "state_dict", "storage_meta", "is_coordinator"]  # torch 2.7-2.15
    ours = sorted((c for c in _subclasses(SavePlanner) if c.__module__.startswith("dcp_s3.")), key=str)
    assert ScalableSavePlanner in ours
    wrong = {c.__qualname__: list(inspect.signature(c.set_up_planner).parameters) for c in ours}
    assert {name: params for name, params in wrong.items() if params != want} == {}
