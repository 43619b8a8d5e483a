"""Real multi-process jobs (gloo, CPU): FSDP2 save on 2 ranks, resharded loads on 1 and 3."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import full, run_ranks
from test_storage import assert_same
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from tests.objects import data_key

pytestmark = pytest.mark.multiproc


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 64)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 6)
        self.register_buffer("scale", torch.linspace(0, 1, 6).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x))))) * self.scale.float()


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.inp, model.hidden, model.out):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def use_server(env: dict[str, str]) -> None:
    os.environ.update(env)


def save_job(
    rank: int, world: int, env: dict[str, str], uri: str, ref_path: str, compression: str | None = None
) -> None:
    use_server(env)
    model, optim = build(seed=1)
    for _ in range(3):
        torch.manual_seed(100 + rank)
        model(torch.randn(8, 24)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    sd = state(model, optim)
    sd["extra"] = {"bf16": torch.arange(10, dtype=torch.bfloat16), "step": 3, "tag": "fsdp2"}
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression=compression))
    reference = full(sd)
    if rank == 0:
        torch.save(reference, ref_path)


def load_job(rank: int, world: int, env: dict[str, str], uri: str, ref_path: str) -> None:
    use_server(env)
    model, optim = build(seed=2)  # different weights; optimizer state initialised empty
    sd = state(model, optim)
    sd["extra"] = {"bf16": torch.zeros(10, dtype=torch.bfloat16), "step": 0, "tag": ""}
    dcp.load(sd, storage_reader=S3StorageReader(uri))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = full(state(model, optim))
    got["extra"] = full(sd["extra"])
    expected = torch.load(ref_path, weights_only=True)
    assert_same(expected, got)


@pytest.mark.torch_range
def test_fsdp2_save_on_2_ranks_load_on_1_and_3(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/fsdp/step-3"
    ref = str(tmp_path / "ref.pt")
    run_ranks(save_job, 2, s3_env.env(), uri, ref)
    objects = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert objects == {
        "fsdp/step-3/.metadata",
        data_key(s3_env.client(), bucket, "fsdp/step-3", 0),
        data_key(s3_env.client(), bucket, "fsdp/step-3", 1),
    }
    run_ranks(load_job, 1, s3_env.env(), uri, ref)
    run_ranks(load_job, 3, s3_env.env(), uri, ref)


def replicated_job(rank: int, world: int, env: dict[str, str], uri: str) -> None:
    use_server(env)
    dcp.save({"w": torch.arange(6.0)}, storage_writer=S3StorageWriter(uri))
    out = {"w": torch.zeros(6)}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert torch.equal(out["w"], torch.arange(6.0))


def test_rank_with_empty_plan_writes_no_object(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/repl"
    run_ranks(replicated_job, 2, s3_env.env(), uri)
    data = [
        o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"] if o["Key"].endswith(".distcp")
    ]
    assert len(data) == 1, data  # the deduplicated tensor is written by one rank only


def async_job(rank: int, world: int, env: dict[str, str], uri: str, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    use_server(env)
    sd = {"w": torch.full((1000,), float(rank + 1)), "shared": torch.ones(3), "step": 5}
    fut = dcp.async_save(
        {"own": {f"r{rank}": sd["w"]}, "shared": sd["shared"], "step": 5},
        storage_writer=S3StorageWriter(uri),
        async_checkpointer_type=AsyncCheckpointerType[mode],
    )
    fut.result(timeout=300)
    dist.barrier()
    out = {"own": {f"r{r}": torch.zeros(1000) for r in range(world)}, "shared": torch.zeros(3), "step": 0}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    for r in range(world):
        assert torch.equal(out["own"][f"r{r}"], torch.full((1000,), float(r + 1))), r
    assert torch.equal(out["shared"], torch.ones(3)) and out["step"] == 5


@pytest.mark.torch_range
@pytest.mark.parametrize("mode", ["THREAD", "PROCESS"])
def test_async_save_on_2_ranks(bucket: str, s3_env: LocalS3Server, mode: str) -> None:
    run_ranks(async_job, 2, s3_env.env(), f"s3://{bucket}/async-{mode.lower()}", mode)
