"""ScalableSavePlanner: torch's global-plan checks in linear time, plan caching with dcp_s3's writer."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import dcp_s3._planners.scale as ps
from dcp_s3 import CheckpointFormatError, CheckpointNotFoundError, S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._packed.plans import PackedItems
from dcp_s3._planners.scale import ScalableSavePlanner, validate_global_plan

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def plans_of(size: tuple[int, ...], boxes_per_rank: list[list[Box]]) -> list[SavePlan]:
    props = TensorProperties(dtype=torch.float32)
    plans = []
    for boxes in boxes_per_rank:
        items = []
        for offsets, sizes in boxes:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.append(
                WriteItem(
                    index=MetadataIndex("t", torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(size)),
                )
            )
        plans.append(SavePlan(items))
    return plans


def rows(n: int, ranks: int, cols: int) -> list[list[Box]]:
    """FSDP's dim-0 chunks (torch.chunk rule, trailing ranks empty)."""
    c = -(-n // ranks)
    return [[((min(r * c, n), 0), (min(r * c + c, n) - min(r * c, n), cols))] for r in range(ranks)]


def grid(n: int, m: int, a: int, b: int) -> list[list[Box]]:
    return [[((i * n // a, j * m // b), (n // a, m // b))] for i in range(a) for j in range(b)]


CASES = {
    "slabs, wide tensor": ((16, 4000), rows(16, 24, 4000)),
    "slabs, narrow tensor": ((4000, 3), rows(4000, 7, 3)),
    "grid (TP x FSDP)": ((12, 20), grid(12, 20, 3, 4)),
    "overlap": ((10, 50), [[((0, 0), (6, 50))], [((5, 0), (5, 50))]]),
    "gap": ((10, 50), [[((0, 0), (4, 50))], [((5, 0), (5, 50))]]),
    "out of bounds": ((10, 50), [[((0, 0), (5, 50))], [((5, 0), (6, 50))]]),
    "overlap inside a grid": ((12, 20), grid(12, 20, 3, 4) + [[((3, 4), (2, 2))]]),
    "overlap on the other axis": ((4, 40), [[((0, 0), (4, 25))], [((0, 20), (4, 20))]]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_verdict_as_torch(name: str) -> None:
    size, per_rank = CASES[name]
    global_plan, metadata = create_default_global_save_plan(plans_of(size, per_rank))
    ours = validate_global_plan(metadata, ranks=len(global_plan))
    theirs = _validate_global_plan(global_plan, metadata)
    invalid = not theirs if isinstance(theirs, bool) else bool(theirs)  # torch < 2.8: True = valid; then errors
    assert bool(ours) == invalid, (ours, theirs)
    assert bool(ours) == (name.startswith("overlap") or name in ("gap", "out of bounds"))
    if ours:
        with pytest.raises(CheckpointFormatError, match="do not tile"):
            ScalableSavePlanner(flatten_state_dict=False, enable_plan_caching=False).create_global_plan(
                plans_of(size, per_rank)
            )


def test_linear_sweep_on_wide_slabs() -> None:
    """The case torch compares pairwise: every chunk of a dim-0 sharding of a wide tensor."""
    size, per_rank = (2048, 100_000), rows(2048, 2048, 100_000)
    _, metadata = create_default_global_save_plan(plans_of(size, per_rank))
    compared: list[int] = []
    real = ps._share_element
    try:
        ps._share_element = lambda a, b: compared.append(1) or real(a, b)  # type: ignore[assignment]
        assert validate_global_plan(metadata, ranks=2048) == []
    finally:
        ps._share_element = real
    assert len(compared) == 0  # slabs never overlap in the sweep: no pair is compared


class Recording(ScalableSavePlanner):
    usable: list[list[bool]] = []
    packed: list[bool] = []

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        Recording.usable.append([p.usable for p in all_plans])
        Recording.packed.append(all(isinstance(p.items, PackedItems) for p in all_plans if p.usable))
        return super().create_global_plan(all_plans)


def save_thrice_job(rank: int, world: int, env: dict[str, str], uri: str) -> list[list[bool]]:
    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    for step in range(3):
        sd = {
            "w": DTensor.from_local(torch.full((4, 6), float(10 * step + rank)), mesh, [Shard(0)], run_check=False),
            "step": step,
        }
        dcp.save(sd, storage_writer=S3StorageWriter(f"{uri}/step-{step}"), planner=Recording())
    for step in range(3):
        out = {"w": DTensor.from_local(torch.zeros(4, 6), mesh, [Shard(0)], run_check=False), "step": -1}
        dcp.load(out, storage_reader=S3StorageReader(f"{uri}/step-{step}"))
        assert torch.equal(out["w"].to_local(), torch.full((4, 6), float(10 * step + rank))), step
        assert out["step"] == step
    return Recording.usable


@pytest.mark.multiproc
def test_plan_caching_with_the_s3_writer(bucket: str, s3_env: LocalS3Server) -> None:
    results = run_ranks(save_thrice_job, 2, s3_env.env(), f"s3://{bucket}/cached", timeout=300)
    usable = results[0]  # recorded on the coordinator
    # The first save sends full plans; later saves of the same structure (only values change)
    # send empty ones and reuse the cached global plan, yet write and load every new value.
    assert usable == [[True, True], [False, False], [False, False]]


# --- real processes: FSDP-like and HSDP-like saves, equal to DefaultSavePlanner's, loaded bit-exact ---------

SHAPES = {"w": (10, 3), "e": (3, 4), "b": (6,)}  # with 4 shards: e and b have an empty trailing shard


def global_tensor(name: str, salt: int) -> torch.Tensor:
    shape = SHAPES[name]
    return (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1000 * salt + len(name)) / 7


def state(
    mesh: Any, placements: list[Any], shard_rank: int, shards: int, salt: int, zeros: bool = False
) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for name in SHAPES:
        g = global_tensor(name, salt)
        pieces = list(torch.chunk(g, shards))
        local = pieces[shard_rank] if shard_rank < len(pieces) else g[g.shape[0] :]
        local = torch.zeros_like(local) if zeros else local.clone()
        sd[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=g.shape, stride=g.stride())
    sd["replicated"] = torch.zeros(5) if zeros else torch.full((5,), 3.5 + salt)  # every rank plans it
    sd["step"] = -1 if zeros else 100 + salt  # a byte item on every rank
    return sd


def save_both_job(rank: int, world: int, env: dict[str, str], uri: str, hsdp: bool) -> None:
    os.environ.update(env)
    if hsdp:  # 2 replicas x 2 shards: rank = replica * 2 + shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        placements, shard_rank, shards = [Replicate(), Shard(0)], rank % (world // 2), world // 2
    else:
        mesh = init_device_mesh("cpu", (world,))
        placements, shard_rank, shards = [Shard(0)], rank, world
    for name, planner in (("ours", ScalableSavePlanner()), ("torch", DefaultSavePlanner())):
        dcp.save(
            state(mesh, placements, shard_rank, shards, salt=1),
            storage_writer=S3StorageWriter(f"{uri}/{name}"),
            planner=planner,
        )
    for name in ("ours", "torch"):
        out = state(mesh, placements, shard_rank, shards, salt=1, zeros=True)
        dcp.load(out, storage_reader=S3StorageReader(f"{uri}/{name}"))  # torch's DefaultLoadPlanner
        want = state(mesh, placements, shard_rank, shards, salt=1)
        for key in SHAPES:
            assert torch.equal(out[key].to_local(), want[key].to_local()), (name, key)
        assert torch.equal(out["replicated"], want["replicated"]) and out["step"] == want["step"], name


def writer_rank(relative_path: str) -> int:
    match = re.search(r"__(\d+)_\d+\.[0-9a-f]{16}\.distcp$", relative_path)
    assert match, relative_path
    return int(match.group(1))


@pytest.mark.multiproc
@pytest.mark.parametrize("hsdp", [False, True], ids=["FSDP 4 ranks", "HSDP 2x2"])
def test_same_checkpoint_as_default_planner(bucket: str, s3_env: LocalS3Server, hsdp: bool) -> None:
    uri = f"s3://{bucket}/both"
    run_ranks(save_both_job, 4, s3_env.env(), uri, hsdp, timeout=300)
    ours = S3StorageReader(f"{uri}/ours").read_metadata()
    theirs = S3StorageReader(f"{uri}/torch").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    who = {k: writer_rank(v.relative_path) for k, v in ours.storage_data.items()}
    assert who == {k: writer_rank(v.relative_path) for k, v in theirs.storage_data.items()}
    # every chunk written once; the replicated tensor and the byte item by one rank, not four
    assert len(who) == sum(len(m.chunks) for m in ours.state_dict_metadata.values() if hasattr(m, "chunks")) + 1
    if hsdp:  # the replicas' chunks are spread over both replicas (balanced by bytes), not all on replica 0
        assert {r // 2 for k, r in who.items() if k.fqn in SHAPES} == {0, 1}


def overlapping(plan: SavePlan) -> SavePlan:
    """Rank 1 claims w's chunk one row early: it overlaps rank 0's last row."""
    if dist.get_rank() != 1:
        return plan
    items = []
    for item in plan.items:
        if item.index.fqn == "w" and item.tensor_data is not None:
            chunk = item.tensor_data.chunk
            offsets = torch.Size([chunk.offsets[0] - 1, *chunk.offsets[1:]])
            item = dataclasses.replace(
                item,
                index=MetadataIndex("w", offsets),
                tensor_data=dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets, chunk.sizes)),
            )
        items.append(item)
    return dataclasses.replace(plan, items=items)


class Overlapping(ScalableSavePlanner):
    def create_local_plan(self) -> SavePlan:
        return overlapping(super().create_local_plan())


class OverlappingTorch(DefaultSavePlanner):
    def create_local_plan(self) -> SavePlan:
        return overlapping(super().create_local_plan())


def overlap_job(rank: int, world: int, env: dict[str, str], uri: str) -> list[tuple[str, bool, str]]:
    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for name, planner in (("ours", Overlapping()), ("torch", OverlappingTorch())):
        try:
            dcp.save(
                state(mesh, [Shard(0)], rank, world, salt=0),
                storage_writer=S3StorageWriter(f"{uri}/{name}"),
                planner=planner,
            )
        except CheckpointException as exc:
            (failure,) = exc.failures.values()  # the coordinator's; torch 2.13 pairs it with its traceback
            failure = failure[0] if isinstance(failure, tuple) else failure
            out.append((name, isinstance(failure, ValueError), str(failure)))
    return out


@pytest.mark.multiproc
def test_overlapping_plans_fail_as_with_torch(bucket: str, s3_env: LocalS3Server) -> None:
    for per_rank in run_ranks(overlap_job, 4, s3_env.env(), f"s3://{bucket}/overlap", timeout=300):
        assert [(name, is_value_error) for name, is_value_error, _ in per_rank] == [("ours", True), ("torch", True)], (
            per_rank
        )
        (_, _, ours), (_, _, theirs) = per_rank
        assert "key:w has overlapping chunks" in ours, ours
        assert theirs.startswith("Failed to validate global plan"), theirs
        assert theirs == "Failed to validate global plan" or "key:w has overlapping chunks" in theirs  # 2.7: no detail
    for name in ("ours", "torch"):  # nothing committed: a failed plan never reaches finish
        with pytest.raises(CheckpointNotFoundError):
            S3StorageReader(f"s3://{bucket}/overlap/{name}").read_metadata()


def caching_job(rank: int, world: int, env: dict[str, str], uri: str) -> list[list[bool]]:
    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    Recording.usable = []
    saved = []
    for step, extra in enumerate((False, False, True, True)):  # the structure changes before save 2
        sd = state(mesh, [Shard(0)], rank, world, salt=step)
        if extra:
            sd["added"] = torch.full((3,), float(step))
        dcp.save(sd, storage_writer=S3StorageWriter(f"{uri}/{step}"), planner=Recording())
        saved.append(sd)
    for step, sd in enumerate(saved):
        out = state(mesh, [Shard(0)], rank, world, salt=step, zeros=True) | (
            {"added": torch.zeros(3)} if "added" in sd else {}
        )
        dcp.load(out, storage_reader=S3StorageReader(f"{uri}/{step}"))
        for key in SHAPES:
            assert torch.equal(out[key].to_local(), sd[key].to_local()), (step, key)
        assert out["step"] == sd["step"] and ("added" not in sd or torch.equal(out["added"], sd["added"])), step
    assert Recording.packed == ([True] * 4 if rank == 0 else [])  # the plans reached the coordinator as arrays
    return Recording.usable


@pytest.mark.multiproc
def test_plan_cache_reused_then_invalidated(bucket: str, s3_env: LocalS3Server) -> None:
    usable = run_ranks(caching_job, 4, s3_env.env(), f"s3://{bucket}/cache", timeout=300)[0]
    # save 1 reuses save 0's plans; save 2 adds a tensor: every rank sends its new plan; save 3 reuses again
    assert usable == [[True] * 4, [False] * 4, [True] * 4, [False] * 4]
    assert "added" in S3StorageReader(f"s3://{bucket}/cache/2").read_metadata().state_dict_metadata
