"""Thousands-of-ranks features on real gloo ranks, counted by a proxy in front of SeaweedFS:

* ``.metadata`` is GET once per ``dcp.load`` and broadcast over the load's own group, also
  when the load runs on a sub-group (no hang, one GET per sub-group);
* replicated loads (HSDP replicas, every rank loading the whole model) read the stored
  bytes about once in total instead of once per replica;
* failures on one rank (a missing checkpoint, a share that cannot be read, replicas whose
  plans differ, a wrong explicit group) are raised on every rank instead of hanging.

Every result is checked bit for bit against the seeded tensors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from counting_proxy import CountingProxy, reset
from dist_utils import run_ranks
from fault_proxy import Rule
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcp_s3 import ConfigError, S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server

pytestmark = pytest.mark.multiproc

SHAPES = {"emb": (256, 96), "w1": (128, 128), "w2": (64, 200), "norm": (32,)}
EXTRA = {"step": 7, "tag": "scale"}  # a non-tensor value: a byte item


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def sharded_sd(mesh: Any, placements: list[Any], zeros: bool = False) -> dict[str, Any]:
    """Each tensor ``Shard(0)`` on the mesh's last dimension (and replicated on the others)."""
    coord = mesh.get_coordinate()[-1]
    n = mesh.size(mesh.ndim - 1)
    sd: dict[str, Any] = {}
    for name in SHAPES:
        local = full(name).chunk(n, 0)[coord].clone()
        sd[name] = DTensor.from_local(torch.zeros_like(local) if zeros else local, mesh, placements, run_check=False)
    sd["extra"] = dict(EXTRA) if not zeros else {"step": 0, "tag": ""}
    return sd


def check_sharded(sd: dict[str, Any], mesh: Any) -> None:
    coord = mesh.get_coordinate()[-1]
    n = mesh.size(mesh.ndim - 1)
    for name in SHAPES:
        assert torch.equal(sd[name].to_local(), full(name).chunk(n, 0)[coord]), name
    assert sd["extra"] == EXTRA


def full_sd(zeros: bool = True) -> dict[str, Any]:
    sd: dict[str, Any] = {k: torch.zeros(s) if zeros else full(k) for k, s in SHAPES.items()}
    sd["extra"] = {"step": 0, "tag": ""} if zeros else dict(EXTRA)
    return sd


def check_full(sd: dict[str, Any]) -> None:
    for name in SHAPES:
        assert torch.equal(sd[name], full(name)), name
    assert sd["extra"] == EXTRA


def phase(rank: int, proxy: str) -> dict[str, int] | None:
    """Barrier, then (rank 0) the counts since the previous phase, zeroed for the next."""
    dist.barrier()
    got = reset(proxy) if rank == 0 else None
    dist.barrier()
    if got is None:
        return None
    return {
        "metadata_gets": got.requests("GetObject", "/.metadata"),
        "data_bytes": got.bytes("GetObject", ".distcp"),
        "data_gets": got.requests("GetObject", ".distcp"),
    }


def failures(exc: CheckpointException) -> tuple[set[str], str]:
    """The exception types raised on the ranks (torch keeps (exception, traceback) pairs) and their text."""
    errors = [e[0] if isinstance(e, tuple) else e for e in exc.failures.values()]
    return {type(e).__name__ for e in errors}, " | ".join(map(str, errors))


# --------------------------------------------------------------------------------------------
def replicated_job(rank: int, world: int, env: dict[str, str], uri: str, proxy: str, replicas: int) -> dict[str, Any]:
    os.environ.update(env)
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    placements = [Replicate(), Shard(0)]
    dcp.save(sharded_sd(mesh, placements), storage_writer=S3StorageWriter(uri))
    out: dict[str, Any] = {"save": phase(rank, proxy)}

    sd = sharded_sd(mesh, placements, zeros=True)  # before: every replica reads everything
    dcp.load(sd, storage_reader=S3StorageReader(uri, share_metadata=False))
    check_sharded(sd, mesh)
    out["plain"] = phase(rank, proxy)

    sd = sharded_sd(mesh, placements, zeros=True)  # HSDP: the replicas of a shard share its reads
    dcp.load(sd, storage_reader=S3StorageReader(uri, replica_group=mesh.get_group("replicate")))
    check_sharded(sd, mesh)
    out["hsdp"] = phase(rank, proxy)

    sd = full_sd()  # every rank loads the whole model
    dcp.load(sd, storage_reader=S3StorageReader(uri, replica_group=dist.group.WORLD))
    check_full(sd)
    out["whole"] = phase(rank, proxy)
    return out


def stored_bytes(server: LocalS3Server, bucket: str, prefix: str) -> int:
    listing = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    return sum(o["Size"] for o in listing if o["Key"].endswith(".distcp"))


@pytest.fixture
def proxy(s3_env: LocalS3Server) -> Iterator[CountingProxy]:
    with CountingProxy(s3_env.endpoint_url) as p:
        yield p


def test_replicated_loads_read_each_byte_once(bucket: str, s3_env: LocalS3Server, proxy: CountingProxy) -> None:
    uri = f"s3://{bucket}/hsdp/step-1"
    env = {**s3_env.env(), "AWS_ENDPOINT_URL": proxy.url}
    results = run_ranks(replicated_job, 8, env, uri, proxy.url, 4, timeout=400)
    c = results[0]
    stored = stored_bytes(s3_env, bucket, "hsdp/step-1/")
    assert stored > 4 * sum(4 * torch.Size(s).numel() for s in SHAPES.values()) // 5
    # Before: 8 ranks each GET .metadata and 4 replicas each read every byte.
    assert c["plain"]["metadata_gets"] == 8
    assert c["plain"]["data_bytes"] >= 4 * stored * 0.9
    # After: one .metadata GET per load, the stored bytes read about once.
    for what in ("hsdp", "whole"):
        assert c[what]["metadata_gets"] == 1, (what, c[what])
        assert c[what]["data_bytes"] <= 1.1 * stored, (what, c[what], stored)
        assert c[what]["data_bytes"] >= stored * 0.9, (what, c[what], stored)


# --------------------------------------------------------------------------------------------
def groups_job(rank: int, world: int, env: dict[str, str], uri: str, proxy: str) -> dict[str, Any]:
    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(sharded_sd(mesh, [Shard(0)]), storage_writer=S3StorageWriter(uri))
    dcp.save(sharded_sd(mesh, [Shard(0)]), storage_writer=S3StorageWriter(uri.replace("step-1", "bad")))
    out: dict[str, Any] = {"save": phase(rank, proxy)}

    sd = sharded_sd(mesh, [Shard(0)], zeros=True)
    dcp.load(sd, storage_reader=S3StorageReader(uri))
    check_sharded(sd, mesh)
    out["world"] = phase(rank, proxy)

    half = world // 2
    low, high = dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))
    mine = low if rank < half else high
    if rank < half:  # one sub-group loads; the other half waits on its own group only
        sd = full_sd()
        dcp.load(sd, storage_reader=S3StorageReader(uri), process_group=low)
        check_full(sd)
    dist.barrier(group=mine)
    out["one_subgroup"] = phase(rank, proxy)

    sd = full_sd()  # both sub-groups at once, each on its own group
    dcp.load(sd, storage_reader=S3StorageReader(uri), process_group=mine)
    check_full(sd)
    out["two_subgroups"] = phase(rank, proxy)

    if rank < half:  # naming a group other than dcp.load's: refused on every rank, no hang
        try:
            dcp.load(full_sd(), storage_reader=S3StorageReader(uri, share_metadata=dist.group.WORLD), process_group=low)
        except CheckpointException as exc:
            out["wrong_group"] = failures(exc)
    dist.barrier()

    try:  # no checkpoint: the coordinator's error reaches every rank
        dcp.load(full_sd(), storage_reader=S3StorageReader(uri + "-missing"))
    except CheckpointException as exc:
        out["missing"] = failures(exc)

    try:  # replicas whose plans differ
        sd = full_sd()
        if rank == 1:
            del sd["w1"]
        dcp.load(sd, storage_reader=S3StorageReader(uri, replica_group=dist.group.WORLD))
    except CheckpointException as exc:
        out["mismatch"] = failures(exc)
    phase(rank, proxy)

    try:  # one object unreadable (the proxy fails its GETs): every member raises
        dcp.load(
            full_sd(), storage_reader=S3StorageReader(uri.replace("step-1", "bad"), replica_group=dist.group.WORLD)
        )
    except CheckpointException as exc:
        out["unreadable"] = failures(exc)
    return out


def test_metadata_once_per_load_and_sub_groups(bucket: str, s3_env: LocalS3Server, proxy: CountingProxy) -> None:
    uri = f"s3://{bucket}/fsdp/step-1"
    env = {**s3_env.env(), "AWS_ENDPOINT_URL": proxy.url}
    # The job saves a copy of the checkpoint at fsdp/bad whose rank-3 object cannot be read.
    proxy.set_rules([Rule(ops={"GetObject", "GetObjectRange"}, key_contains="fsdp/bad/__3_", rate=1.0)])
    results = run_ranks(groups_job, 4, env, uri, proxy.url, timeout=400)
    c = results[0]
    assert c["world"]["metadata_gets"] == 1
    assert c["one_subgroup"]["metadata_gets"] == 1
    assert c["two_subgroups"]["metadata_gets"] == 2
    for rank, r in enumerate(results):
        # torch retries read_metadata(rank=...) after the first call fails, then raises
        # AssertionError("metadata is None; global metadata read failed: <our error>")
        if rank < 2:
            assert "is not the one dcp.load runs on" in r["wrong_group"][1], (rank, r)
        else:
            assert "wrong_group" not in r
        assert ".metadata is missing" in r["missing"][1], (rank, r)
        assert r["mismatch"][0] == {"ConfigError"}, (rank, r)
        assert r["unreadable"][0] == {"S3TransferError"}, (rank, r)
        assert re.search(r"bad/__3_0\.[0-9a-f]{16}\.distcp", r["unreadable"][1]), (rank, r)
    assert proxy.injected() > 0


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="share_metadata"):
        S3StorageReader("s3://b/k", share_metadata="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="replica_group"):
        S3StorageReader("s3://b/k", replica_group=[0, 1])  # type: ignore[arg-type]
