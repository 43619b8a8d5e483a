"""A resharded load from the local tier: a job of another world size reads the copies of every saving rank.

A 2-rank job saves into one local root (the rank directories side by side, as on a node's shared disk):
step 10 also promoted to S3, step 20 local only, and saved twice (a rerun: the first save's copy of rank 1
is kept aside). Jobs of 1 and of 3 ranks then load step 20 from the local tier, bit-exact, with no GET of a
data object from S3 (counted by a proxy). On 1 rank: a corrupt item (checksum), a lying layout in a marker
(stored bytes) and copies of two different saves of step 20 are each refused, and step 10 loads instead
(never a mix; nor on 2 ranks, where each rank holds its own copy of one of the two saves); with step 10's copy corrupt too, or one saving rank's directory wiped, step 10 is read
from S3.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_proxy import CountingProxy
from dist_utils import run_ranks
from test_checkpointer import build, snapshot, train
from test_tiers import check, data_gets, fresh_load

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.formats import load_metadata

pytestmark = [pytest.mark.multiproc]


def save_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> None:
    os.environ.update(env)
    local = f"{base}/shared"  # every rank's directory under one root
    model, optim, sched = build(seed=1)
    ckpt = Checkpointer(root, local_root=local, keep_last_local=3)
    refs = {}
    train(model, optim, sched, seed=10)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=10, tier="s3")
    ckpt.wait_promotions()
    refs[10] = snapshot(model, optim)
    train(model, optim, sched, seed=20)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=20, tier="local")
    dist.barrier()
    if rank == 1:  # the first save's copy of rank 1, for a rerun that did not reach it
        shutil.copytree(f"{local}/rank00001", f"{base}/first_save_rank00001")
    dist.barrier()
    train(model, optim, sched, seed=21)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=20, tier="local")  # the rerun's save
    refs[20] = snapshot(model, optim)
    ckpt.close()
    dist.barrier()
    if rank == 0:
        torch.save(refs, f"{base}/refs.pt")


def load_job(rank: int, world: int, env: dict[str, str], root: str, base: str, proxy: str) -> Any:
    os.environ.update(env)
    local = f"{base}/shared"
    refs = torch.load(f"{base}/refs.pt", weights_only=True)
    data_gets(rank, proxy)
    it, got, where, _ = fresh_load(root, local)
    assert it == 20, (it, where)
    check(refs[20], got)
    out: dict[str, Any] = {"local": (where["source"], where.get("resharded_from"), data_gets(rank, proxy))}
    if world == 1:
        out.update(refused(root, base, refs, proxy))
    return out


def model_object(local: str, rank: int, step: str) -> Path:
    (obj,) = sorted(Path(local, f"rank{rank:05d}").glob(f"{step}.m_model*/*.distcp"))
    return obj


def flip(obj: Path) -> None:
    """Flip one byte in the middle of the largest item stored in ``obj``."""
    md = load_metadata((obj.parent / ".metadata").read_bytes(), str(obj.parent))
    info = max((i for i in md.storage_data.values() if i.relative_path == obj.name), key=lambda i: i.length)
    data = bytearray(obj.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    obj.write_bytes(bytes(data))


def refused(root: str, base: str, refs: dict[int, Any], proxy: str) -> dict[str, Any]:
    """One rank: step 20's copies made unusable in three ways, then one saving rank's directory wiped."""
    local, out = f"{base}/shared", {}
    marker = Path(local, "rank00001", "0000020.pth")
    obj = model_object(local, 1, "0000020")
    originals = {marker: marker.read_bytes(), obj: obj.read_bytes()}

    # A flipped byte inside an item: its checksum fails in the load; step 20 is not on S3, step 10 loads.
    flip(obj)
    it, got, where, warned = fresh_load(root, local)
    check(refs[10], got)
    out["corrupt"] = (it, where["source"], any("0000020" in w and "checksum" in w for w in warned))
    # Step 10's copy corrupt too: it is on S3, and read from there.
    obj10 = model_object(local, 1, "0000010")
    originals[obj10] = obj10.read_bytes()
    flip(obj10)
    data_gets(0, proxy)
    it, got, where, warned = fresh_load(root, local)
    check(refs[10], got)
    out["corrupt_on_s3"] = (
        it,
        where["source"],
        data_gets(0, proxy),
        any("0000010" in w and "read from S3" in w for w in warned),
    )
    for path in (obj, obj10):
        path.write_bytes(originals[path])

    # A marker whose layout places rank 1's shard outside its tensor.
    content = torch.load(marker, weights_only=True)
    fqn, (size, offsets, sizes) = next((k, v) for k, v in content["local_layout"]["m_model"].items() if v)
    content["local_layout"]["m_model"][fqn] = (size, [size[0] + 1, *offsets[1:]], sizes)
    torch.save(content, marker)
    it, got, where, warned = fresh_load(root, local)
    check(refs[10], got)
    out["layout"] = (it, where["source"], any("0000020" in w and "not inside it" in w for w in warned))
    marker.write_bytes(originals[marker])

    # Rank 1's directory holds the first save of step 20, rank 0's the rerun's: never combined.
    os.rename(f"{local}/rank00001", f"{base}/rerun_rank00001")
    shutil.copytree(f"{base}/first_save_rank00001", f"{local}/rank00001")
    it, got, where, warned = fresh_load(root, local)
    check(refs[10], got)
    out["two_saves"] = (it, where["source"], any("0000020" in w and "different saves" in w for w in warned))
    shutil.rmtree(f"{local}/rank00001")

    # Rank 1's directory wiped: step 20 cannot be had, step 10 is read from S3.
    data_gets(0, proxy)
    it, got, where, warned = fresh_load(root, local)
    check(refs[10], got)
    out["wiped"] = (it, where["source"], data_gets(0, proxy))
    os.rename(f"{base}/rerun_rank00001", f"{local}/rank00001")
    return out


def rerun_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> tuple[int, str, bool]:
    """The saving job's own size: rank 1's directory holds the first save of step 20, rank 0's the rerun's.
    Each rank could load its own copy, but they are of different saves: step 10 is loaded instead."""
    os.environ.update(env)
    local = f"{base}/shared"
    dist.barrier()
    if rank == 0:
        os.rename(f"{local}/rank00001", f"{base}/rerun_rank00001")
        shutil.copytree(f"{base}/first_save_rank00001", f"{local}/rank00001")
    dist.barrier()
    it, got, where, warned = fresh_load(root, local)
    check(torch.load(f"{base}/refs.pt", weights_only=True)[10], got)
    return it, where["source"], any("0000020" in w and "different saves" in w for w in warned)


@pytest.fixture
def proxy(s3_env: LocalS3Server) -> Iterator[CountingProxy]:
    with CountingProxy(s3_env.endpoint_url) as p:
        yield p


def test_resharded_load_from_the_local_tier(
    bucket: str, s3_env: LocalS3Server, proxy: CountingProxy, tmp_path: Path
) -> None:
    env = {**s3_env.env(), "AWS_ENDPOINT_URL": proxy.url}
    root = f"s3://{bucket}/run"
    run_ranks(save_job, 2, env, root, str(tmp_path), timeout=300)
    (one,) = run_ranks(load_job, 1, env, root, str(tmp_path), proxy.url, timeout=300)
    assert one["local"] == ("local", 2, 0), one  # resharded from the 2 saving ranks, no data GET from S3
    assert one["corrupt"] == (10, "local", True), one
    it, source, gets, warned = one["corrupt_on_s3"]
    assert (it, source, warned) == (10, "s3", True) and gets > 0, one
    assert one["layout"] == (10, "local", True), one
    assert one["two_saves"] == (10, "local", True), one
    it, source, gets = one["wiped"]
    assert (it, source) == (10, "s3") and gets > 0, one
    three = run_ranks(load_job, 3, env, root, str(tmp_path), proxy.url, timeout=300)
    assert three[0]["local"] == ("local", 2, 0), three
    assert run_ranks(rerun_job, 2, env, root, str(tmp_path), timeout=300) == [(10, "local", True)] * 2
