"""What differs between the supported torch releases (2.7-2.15) behaves the same for users.

Part of the subset that CI runs on the lowest and highest supported torch
(marked ``torch_range``).
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcp_s3
from dcp_s3 import (
    Checkpointer,
    CheckpointNotFoundError,
    ConfigError,
    S3AccessDeniedError,
    S3StorageReader,
    S3StorageWriter,
    ScalableSavePlanner,
)
from dcp_s3 import _torch_compat as compat
from dcp_s3._local_server import LocalS3Server
from dcp_s3.errors import TorchCompatibilityError

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank errors inside DCP's ``CheckpointException``."""
    assert type(exc).__name__ == "CheckpointException", repr(exc)
    return [error for error, _trace in exc.failures.values()]  # type: ignore[attr-defined]


def test_missing_checkpoint_names_the_path_and_the_reader_recovers(bucket: str) -> None:
    """torch 2.9-2.11 drop read_metadata's error ("metadata is None"); the reader gets it through."""
    uri = f"s3://{bucket}/not-yet"
    reader = S3StorageReader(uri)
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(3)}, storage_reader=reader)
    assert f"no checkpoint at {uri}" in str(info.value)
    assert [type(e) for e in _failures(info.value)] == [CheckpointNotFoundError]

    # The same reader, once the checkpoint exists, loads it: no stale error is left behind.
    dcp.save({"w": torch.arange(3.0)}, storage_writer=S3StorageWriter(uri))
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], torch.arange(3.0))
    assert reader.read_metadata().state_dict_metadata.keys() == {"w"}


def test_other_metadata_errors_get_through_too(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=S3StorageWriter(f"s3://{bucket}/ck"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(2)}, storage_reader=S3StorageReader(f"s3://{bucket}/ck"))
    assert "access denied" in str(info.value) and bucket in str(info.value)
    assert [type(e) for e in _failures(info.value)] == [S3AccessDeniedError]
    assert "wrong-secret-value" not in str(info.value)


def _load_missing(rank: int, world: int, env: dict[str, str], uri: str) -> list[str]:
    os.environ.update(env)
    try:
        dcp.load({"w": torch.zeros(4)}, storage_reader=S3StorageReader(uri))
    except BaseException as exc:  # CheckpointException derives from BaseException
        return [f"{type(e).__name__}: {e}" for e in _failures(exc)] + [str(exc)]
    return []


@pytest.mark.multiproc
def test_missing_checkpoint_on_2_ranks(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/nothing"
    for rank, seen in enumerate(run_ranks(_load_missing, 2, s3_env.env(), uri)):
        assert seen, f"rank {rank} loaded a checkpoint that does not exist"
        failures, message = seen[:-1], seen[-1]
        assert len(failures) == 2, (rank, failures)  # every rank's error reached every rank
        assert all(f.startswith(f"CheckpointNotFoundError: no checkpoint at {uri}") for f in failures), failures
        assert f"no checkpoint at {uri}" in message


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_async_checkpointer_in_one_process(bucket: str) -> None:
    """``async_save`` without a process group (torch < 2.9 has no ``no_dist=`` for it)."""
    root = f"s3://{bucket}/run"
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    optim.step()
    ckpt = Checkpointer(root, async_save=True)
    handle = ckpt.save({"m": model}, {"m": optim}, iteration=4)
    assert isinstance(handle, dcp_s3.AsyncSave)
    assert handle.result() == f"{root}/0000004"
    ckpt.close()

    model2 = Net()
    optim2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    assert Checkpointer(root).load({"m": model2}, {"m": optim2}) == 4
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, model2.state_dict()[name]), name
    momentum = [s["momentum_buffer"] for s in optim.state_dict()["state"].values()]
    momentum2 = [s["momentum_buffer"] for s in optim2.state_dict()["state"].values()]
    assert len(momentum) == 2 and all(torch.equal(a, b) for a, b in zip(momentum, momentum2, strict=True))


def test_compression_on_a_torch_without_transform_descriptors(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    S3StorageWriter(f"s3://{bucket}/c", compression="zstd")  # every supported torch has them
    monkeypatch.setattr(compat, "HAS_TRANSFORM_DESCRIPTORS", False)
    with pytest.raises(
        ConfigError, match=rf"compression='zstd' needs torch>=2\.7 .*torch {re.escape(torch.__version__)}"
    ):
        S3StorageWriter(f"s3://{bucket}/c", compression="zstd")
    S3StorageWriter(f"s3://{bucket}/c")  # uncompressed checkpoints need nothing more


def _async_no_dist_in_a_group(rank: int, world: int, env: dict[str, str], uri: str) -> str:
    os.environ.update(env)
    compat.ASYNC_SAVE_HAS_NO_DIST = False  # as on torch < 2.9 (this process only)
    try:
        compat.async_save({"w": torch.ones(1)}, no_dist=True, storage_writer=S3StorageWriter(uri))
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiproc
def test_async_save_no_dist_inside_a_group_needs_torch_2_9(bucket: str, s3_env: LocalS3Server) -> None:
    [message] = run_ranks(_async_no_dist_in_a_group, 1, s3_env.env(), f"s3://{bucket}/a")
    assert "needs torch>=2.9" in message and torch.__version__ in message, message


def test_a_renamed_save_planner_override_point_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch renaming ``_create_global_plan`` would silently stop calling ScalableSavePlanner's: loud instead."""
    ScalableSavePlanner()
    monkeypatch.delattr(DefaultSavePlanner, "_create_global_plan")
    with pytest.raises(
        TorchCompatibilityError,
        match=rf"private torch\.distributed\.checkpoint\.default_planner\.DefaultSavePlanner\._create_global_plan, "
        rf"which torch {re.escape(torch.__version__)} does not have",
    ):
        ScalableSavePlanner()


def test_a_renamed_plan_cache_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch no longer setting ``_cached_plans_key`` would silently drop the per-group key: loud instead."""
    init = DefaultSavePlanner.__init__

    def renamed(self: DefaultSavePlanner, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self._plans_cache_key = self.__dict__.pop("_cached_plans_key")

    monkeypatch.setattr(DefaultSavePlanner, "__init__", renamed)
    with pytest.raises(TorchCompatibilityError, match=r"DefaultSavePlanner\(\)\._cached_plans_key"):
        ScalableSavePlanner()


def test_the_override_points_are_the_ones_torch_calls() -> None:
    """torch's create_global_plan reaches ScalableSavePlanner's build_global_plan and dedup_plans."""
    calls: list[str] = []

    class Recording(ScalableSavePlanner):
        def dedup_plans(self, all_plans: list[Any]) -> list[Any]:
            calls.append("dedup")
            return super().dedup_plans(all_plans)

        def build_global_plan(self, all_plans: list[Any]) -> Any:
            calls.append("global")
            return super().build_global_plan(all_plans)

    planner = Recording(packed_plans=False, enable_plan_caching=False)
    planner.set_up_planner({"w": torch.ones(2)}, is_coordinator=True)
    global_plan, metadata = planner.create_global_plan([planner.create_local_plan()])
    assert calls == ["global", "dedup"]
    assert metadata.state_dict_metadata.keys() == {"w"} and len(global_plan) == 1


def test_a_renamed_derived_version_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys of torch <= 2.3 checkpoints: a rename of ``_version._derived_version`` would give the current keys."""
    state_dict = {"w": torch.ones(1), "groups": [{"lr": 1}]}
    assert compat.flatten_state_dict_as_before_2_4(state_dict)[0].keys() == {"w", "groups"}  # lists kept whole
    assert compat.flatten_state_dict(state_dict)[0].keys() == {"w", "groups.0.lr"}  # the current keys again
    monkeypatch.delattr(compat.dcp_version, "_derived_version")
    with pytest.raises(TorchCompatibilityError, match=r"torch\.distributed\.checkpoint\._version\._derived_version"):
        compat.flatten_state_dict_as_before_2_4(state_dict)
