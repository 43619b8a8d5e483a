"""``ScalableLoadPlanner``: the same read items as torch's ``DefaultLoadPlanner``, from only the
overlapping chunks; resharding loads on real gloo ranks, bit-exact."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.compact_chunks import ExplicitChunks, RuleChunks
from dcp_s3._planners.load import ScalableLoadPlanner, read_items_for_chunks
from tests.objects import object_keys

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

S = torch.Size


def key(item: ReadItem) -> tuple[Any, ...]:
    return (
        item.type,
        item.dest_index.fqn,
        item.dest_index.offset,
        item.dest_index.index,
        item.dest_offsets,
        item.storage_index.offset,
        item.storage_index.index,
        item.storage_offsets,
        item.lengths,
    )


def keys(plan: LoadPlan | list[ReadItem]) -> list[tuple[Any, ...]]:
    return sorted(map(key, plan.items if isinstance(plan, LoadPlan) else plan), key=repr)


def random_box(rng: random.Random, size: tuple[int, ...]) -> ChunkStorageMetadata:
    offsets, sizes = [], []
    for d in size:
        lo = rng.randint(0, d)
        offsets.append(lo)
        sizes.append(rng.randint(0, d - lo))
    return ChunkStorageMetadata(S(offsets), S(sizes))


def test_items_match_torch_on_rule_and_explicit_chunks() -> None:
    rng = random.Random(14)
    cases: list[Any] = [
        RuleChunks(S(size), dim, n)
        for size, dim, n in [
            ((10, 4), 0, 4),
            ((2, 5), 0, 4),
            ((9, 7, 3), 1, 5),
            ((16,), 0, 16),
            ((5, 3), 1, 1),
            ((0, 4), 0, 3),
        ]
    ]
    cases.append(RuleChunks(S([]), -1, 1))
    grid = [(r, c, h, w) for r, h in ((0, 3), (3, 5)) for c, w in ((0, 2), (2, 4), (6, 1))]
    import numpy as np

    cases.append(
        ExplicitChunks(S([8, 7]), np.array([[r, c] for r, c, _, _ in grid]), np.array([[h, w] for _, _, h, w in grid]))
    )
    for chunks in cases:
        size = tuple(chunks.size)
        md = TensorStorageMetadata(TensorProperties(), S(size), list(chunks))
        for trial in range(60):
            local = [random_box(rng, size) for _ in range(rng.randint(1, 3))]
            if trial == 0:
                local = [ChunkStorageMetadata(S([0] * len(size)), S(size))]  # the whole tensor
            want = keys(create_read_items_for_chunk_list("t", md, local))
            got = read_items_for_chunks("t", chunks, local)
            assert keys(got) == want, (chunks, local)
            order = [(i.dest_index.index, i.storage_index.index) for i in got]
            assert order == sorted(order)  # by local chunk, then stored chunk


def fsdp_state(rank: int, world: int) -> dict[str, Any]:
    """DTensors sharded like FSDP2 (dim 0, torch.chunk rule; uneven and empty shards) and a 2-D grid."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    full = {"a": torch.randn(10, 6), "b": torch.randn(3, 5).to(torch.bfloat16), "c": torch.randn(7)}
    out: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    out["s"] = torch.tensor(5.0)  # replicated plain tensor
    out["extra"] = {"epoch": 2}
    if world == 4:  # 2 x 2 grid: chunks on both dims (explicit arrays in the compact format)
        mesh2 = init_device_mesh("cpu", (2, 2))
        out["g"] = distribute_tensor(torch.arange(48.0).reshape(6, 8), mesh2, [Shard(0), Shard(1)])
    else:
        out["g"] = distribute_tensor(torch.arange(48.0).reshape(6, 8), mesh, [Shard(1)])
    return out


class Recording(ScalableLoadPlanner):
    plans: list[LoadPlan] = []

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        Recording.plans.append(plan)
        return plan


class RecordingDefault(DefaultLoadPlanner):
    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        Recording.plans.append(plan)
        return plan


def save_job(rank: int, world: int, env: dict[str, str], uri: str) -> None:
    os.environ.update(env)
    dcp.save(fsdp_state(rank, world), storage_writer=S3StorageWriter(uri, metadata_format="compact"))


def load_job(rank: int, world: int, env: dict[str, str], uri: str) -> list[str]:
    os.environ.update(env)
    results = []
    for planner in (RecordingDefault(), Recording()):
        state = fsdp_state(rank, world)
        for v in state.values():
            if isinstance(v, DTensor):
                v.to_local().zero_()
        state["s"].zero_()
        state["extra"] = {"epoch": 0}
        dcp.load(state, storage_reader=S3StorageReader(uri), planner=planner)
        ref = fsdp_state(rank, world)
        for k in ("a", "b", "c", "g"):
            assert torch.equal(state[k].to_local(), ref[k].to_local()), (rank, k)
        assert torch.equal(state["s"], ref["s"]) and state["extra"] == {"epoch": 2}
        results.append(type(planner).__name__)
    default, scalable = Recording.plans
    assert keys(default) == keys(scalable), rank
    dist.barrier()
    return results


@pytest.mark.multiproc
def test_resharding_load_is_bit_exact_and_plans_match(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/fsdp"
    run_ranks(save_job, 4, s3_env.env(), uri)
    body = s3_env.client().get_object(Bucket=bucket, Key="fsdp/.metadata")["Body"].read()
    from dcp_s3._metadata.compact import MAGIC
    from dcp_s3._metadata.formats import load_metadata

    assert body.startswith(MAGIC)
    md = load_metadata(body, uri)
    assert isinstance(md.state_dict_metadata["a"].chunks, RuleChunks)  # type: ignore[union-attr]
    assert isinstance(md.state_dict_metadata["g"].chunks, ExplicitChunks)  # type: ignore[union-attr]
    assert len(object_keys(s3_env.client(), bucket, "fsdp/")) == 5
    for world in (3, 1):
        assert run_ranks(load_job, world, s3_env.env(), uri) == [["RecordingDefault", "Recording"]] * world


def test_local_plan_on_compact_metadata_equals_torchs_and_keeps_its_errors() -> None:
    import io

    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from dcp_s3._metadata.formats import dump_metadata, load_metadata
    from dcp_s3._planners.load import local_load_plan
    from tests.metadata.test_metadata_compact import hand_built

    stock = hand_built()
    compact = load_metadata(dump_metadata(stock, "compact"), "x")
    state = {
        "w": torch.zeros(10, 4),
        "grid": torch.nn.Parameter(torch.zeros(4, 6)),
        "scalar": torch.zeros(()),
        "bytes": io.BytesIO(),
        "cols": torch.zeros(3, 8, 2, 2, dtype=torch.float16),
    }
    assert keys(local_load_plan(state, compact)) == keys(create_default_local_load_plan(state, stock))
    with pytest.raises(RuntimeError, match="Missing key"):  # torch's own error, as DefaultLoadPlanner
        local_load_plan({"absent": torch.zeros(1)}, compact)
    assert local_load_plan({"absent": torch.zeros(1)}, compact, strict=False).items == []
    with pytest.raises(ValueError, match="Size mismatch"):
        local_load_plan({"w": torch.zeros(3, 4)}, compact)


def test_checkpointer_loads_compact_metadata_through_the_scalable_planner(tmp_path: Path) -> None:
    """The Checkpointer's load planners are ScalableLoadPlanners: a step saved with compact
    metadata (model with a frozen layer, AdamW state) resumes bit-exact, frozen weights untouched."""
    from dcp_s3 import Checkpointer, TrainableOnlyLoadPlanner
    from dcp_s3._metadata.compact import MAGIC
    from dcp_s3._planners.optim_match import OptimizerLoadPlanner

    assert issubclass(TrainableOnlyLoadPlanner, ScalableLoadPlanner)
    assert issubclass(OptimizerLoadPlanner, ScalableLoadPlanner)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        model[0].weight.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)

    torch.manual_seed(0)
    model, optim = build()
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    Checkpointer(tmp_path, metadata_format="compact").save({"m": model}, {"m": optim}, iteration=3)
    metadata_files = sorted(tmp_path.rglob(".metadata"))
    assert len(metadata_files) == 2 and all(p.read_bytes().startswith(MAGIC) for p in metadata_files)

    torch.manual_seed(1)
    fresh, fresh_optim = build()
    frozen = fresh[0].weight.detach().clone()
    assert Checkpointer(tmp_path).load({"m": fresh}, {"m": fresh_optim}) == 3
    assert torch.equal(fresh[0].weight, frozen)  # frozen: neither saved nor overwritten
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(fresh.state_dict()[name], model.state_dict()[name]), name
    for mine, theirs in zip(fresh_optim.state.values(), optim.state.values(), strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))
