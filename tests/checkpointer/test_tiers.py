"""Two tiers (node-local disk in front of S3) on real gloo ranks, each rank its own local directory.

Requests are counted by a proxy in front of SeaweedFS: a restart from the local tier GETs no data
object from S3. Promotion leaves a committed step on S3 that loads bit-exact with the local
directories gone; a wiped, a corrupt and a truncated local copy make just that rank read S3; a
local-only step that one rank lost is skipped for the newest S3 step, with a warning; a job of
another size (resharded) loads from S3.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_proxy import CountingProxy, reset
from dist_utils import run_ranks
from test_checkpointer import build, same, snapshot, train, trainable

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.formats import load_metadata

pytestmark = [pytest.mark.multiproc]


def data_gets(rank: int, proxy: str) -> int | None:
    """Barrier, then (rank 0) the GETs of data objects since the previous call, zeroed."""
    dist.barrier()
    got = reset(proxy) if rank == 0 else None
    dist.barrier()
    return None if got is None else got.requests("GetObject", ".distcp")


def fresh_load(root: str, local: str, **kw: Any) -> tuple[int, dict[str, Any], dict[str, Any], list[str]]:
    model, optim, sched = build(seed=99)
    ckpt = Checkpointer(root, local_root=local, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = ckpt.load({"m": model}, {"m": optim}, {"m": sched})
    ckpt.close()
    return it, snapshot(model, optim), ckpt.last_load, [str(w.message) for w in caught]


def check(ref: dict[str, Any], got: dict[str, Any]) -> None:
    same(trainable(ref["model"]), trainable(got["model"]))
    same(ref["optim"], got["optim"])


def local_objects(local: str, rank: int, part: str, step: str) -> list[Path]:
    return sorted((Path(local) / f"rank{rank:05d}").glob(f"{step}.m_{part}*/*.distcp"))


def damage(obj: Path, how: str) -> None:
    """Flip one byte inside the largest item stored in ``obj``, or cut ``obj`` to half its size."""
    if how == "truncated":
        with open(obj, "r+b") as f:
            f.truncate(obj.stat().st_size // 2)
        return
    md = load_metadata((obj.parent / ".metadata").read_bytes(), str(obj.parent))
    info = max((i for i in md.storage_data.values() if i.relative_path == obj.name), key=lambda i: i.length)
    data = bytearray(obj.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    obj.write_bytes(bytes(data))


def tiers_job(rank: int, world: int, env: dict[str, str], root: str, base: str, proxy: str) -> dict[str, Any]:
    os.environ.update(env)
    local = f"{base}/node{rank}"  # each rank its own "node-local disk"
    out: dict[str, Any] = {}
    model, optim, sched = build(seed=1)
    ckpt = Checkpointer(root, local_root=local, s3_every=20, keep_last_local=3)
    refs = {}
    for it in (10, 20):  # 10: local only; 20: local, then promoted (s3_every)
        train(model, optim, sched, seed=it)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=it)
        refs[it] = snapshot(model, optim)
    ckpt.wait_promotions()
    dist.barrier()
    out["status"] = {s["step"]: (s["tiers"], s["promotion"]) for s in ckpt.tier_status()}
    train(model, optim, sched, seed=30)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=30)  # local only, newer than S3
    refs[30] = snapshot(model, optim)
    data_gets(rank, proxy)

    # (1) restart on the same "nodes": the newest step (30, local only), no data object read from S3.
    it, got, where, _ = fresh_load(root, local)
    assert it == 30, it
    check(refs[30], got)
    out["restart"] = (where["source"], data_gets(rank, proxy))

    # (3) rank 1 loses step 30 (not on S3): every rank falls back to 20, the newest step either tier
    # has complete, with a warning; rank 1's local copy of 20 still serves it.
    dist.barrier()
    if rank == 1:
        for p in (Path(local) / "rank00001").glob("0000030*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    dist.barrier()
    it, got, where, warned = fresh_load(root, local)
    assert it == 20, it
    check(refs[20], got)
    out["lost_local_only"] = (where["source"], any("0000030" in w and "ranks [0] only" in w for w in warned))

    # (3) rank 0's model object of 20 corrupt (a byte of an item flipped): its checksum fails, rank 0
    # alone reads S3; then rank 1's optimizer object truncated: found before the load, rank 1 reads S3.
    for damaged, part, how in ((0, "model", "corrupt"), (1, "optim", "truncated")):
        dist.barrier()
        if rank == damaged:
            (obj,) = local_objects(local, rank, part, "0000020")
            original = obj.read_bytes()
            damage(obj, how)
        dist.barrier()
        it, got, where, warned = fresh_load(root, local)
        assert it == 20, it
        check(refs[20], got)
        out[how] = (
            where["source"],
            where["s3_ranks"],
            how in where["reasons"].get(damaged, "") or any("0000020" in w and f"rank {damaged}" in w for w in warned),
        )
        dist.barrier()
        if rank == damaged:
            obj.write_bytes(original)

    # (3) rank 1's copy of 20 wiped: rank 1 alone reads S3, rank 0 stays local.
    dist.barrier()
    if rank == 1:
        shutil.rmtree(Path(local) / "rank00001")
    dist.barrier()
    data_gets(rank, proxy)
    it, got, where, _ = fresh_load(root, local)
    assert it == 20, it
    check(refs[20], got)
    out["wiped"] = (where["source"], where["s3_ranks"], data_gets(rank, proxy))

    # (2) every local directory gone: the promoted step loads from S3 alone.
    dist.barrier()
    os.rename(local, local + ".away")
    dist.barrier()
    it, got, where, _ = fresh_load(root, local)
    assert it == 20, it
    check(refs[20], got)
    out["s3_only"] = where["source"]
    dist.barrier()
    shutil.rmtree(local, ignore_errors=True)
    os.rename(local + ".away", local)  # back, for the resharded jobs
    ckpt.close()
    if rank == 0:
        torch.save(refs[20], f"{base}/ref20.pt")
    return out


def reshard_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> None:
    """(6) A job of another size on the same "nodes": the local copies (saved by a 2-rank job, its step 30
    newer than S3's) do not fit, S3's newest step serves it."""
    os.environ.update(env)
    it, got, where, _ = fresh_load(root, f"{base}/node{rank}")
    assert it == 20 and where["source"] == "s3", (it, where)
    check(torch.load(f"{base}/ref20.pt", weights_only=True), got)


@pytest.fixture
def proxy(s3_env: LocalS3Server) -> Iterator[CountingProxy]:
    with CountingProxy(s3_env.endpoint_url) as p:
        yield p


def test_two_tiers_on_2_ranks(bucket: str, s3_env: LocalS3Server, proxy: CountingProxy, tmp_path: Path) -> None:
    env = {**s3_env.env(), "AWS_ENDPOINT_URL": proxy.url}
    root = f"s3://{bucket}/run"
    out = run_ranks(tiers_job, 2, env, root, str(tmp_path), proxy.url, timeout=400)
    r0, r1 = out
    print(r0)
    assert r0["status"] == {"0000010": (["local"], "not planned"), "0000020": (["local", "s3"], "done")}, r0
    assert r1["status"]["0000020"] == (["local"], "uploaded"), r1
    assert r0["restart"] == ("local", 0)  # no GET of any data object from S3
    assert r0["lost_local_only"] == ("local", True) and r1["lost_local_only"][1]
    source, s3_ranks, gets = r0["wiped"]
    assert (source, s3_ranks) == ("mixed", [1]) and gets > 0, r0["wiped"]
    assert r0["corrupt"] == ("mixed", [0], True), r0["corrupt"]
    assert r0["truncated"] == ("mixed", [1], True), r0["truncated"]
    assert r0["s3_only"] == "s3"
    # S3 holds exactly the promoted step, complete; no upload report is left behind.
    s3 = open_store(root)
    assert [s.name for s in find_complete(s3, None)] == ["0000020"]
    assert not [e.name for e in s3.list_objects() if "__rankmeta_" in e.name]
    # (6) resharded: one rank, then three, load the 2-rank step from S3.
    for world in (1, 3):
        run_ranks(reshard_job, world, env, root, str(tmp_path), timeout=300)
