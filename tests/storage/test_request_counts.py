"""Requests per rank of a save and a load, by operation: what every rank asks the server.

Each rank talks to the server through its own counting proxy, so the counts are per rank.
A request every rank makes with the same answer (a listing, a HEAD) is made once, on the
coordinator, and shared through a collective the save or load already makes.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from counting_proxy import CountingProxy, reset
from dist_utils import run_ranks
from torch import nn

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._local_server import LocalS3Server

pytestmark = pytest.mark.multiproc

FILES = 2


def _ops(url: str) -> dict[str, int]:
    ops: Counter[str] = Counter()
    for op, _, n, _ in reset(url).rows:
        ops[op] += n
    return dict(ops)


def _job(rank: int, world: int, env: dict[str, str], uri: str, urls: list[str]) -> dict[str, dict[str, int]]:
    """Save (new path), save again (replacing it), save with overwrite=False (new path), load:
    this rank's requests by operation for each."""
    os.environ.update(env)
    url = urls[rank]
    state = {f"r{rank}.{i}": torch.arange(64.0) + rank + i for i in range(4)}
    out: dict[str, dict[str, int]] = {}
    _ops(url)
    for phase, path, overwrite in (("save", uri, True), ("resave", uri, True), ("exclusive", uri + "-x", False)):
        writer = S3StorageWriter(path, endpoint_url=url, files_per_rank=FILES, overwrite=overwrite)
        dcp.save(state, storage_writer=writer)
        dist.barrier()
        out[phase] = _ops(url)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=S3StorageReader(uri, endpoint_url=url))
    dist.barrier()
    out["load"] = _ops(url)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    return {**out, **_checkpointer(uri + "-run", url)}


def _checkpointer(root: str, url: str) -> dict[str, dict[str, int]]:
    """A Checkpointer: construct, save three steps (keep_last=1 deletes two), re-save the last, resume."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, dict[str, int]] = {}
    ckpt = Checkpointer(root, keep_last=1, endpoint_url=url, files_per_rank=FILES)
    out["ckpt_init"] = _ops(url)
    for it in (1, 2, 3, 3):
        ckpt.save({"m": model}, {"m": optim}, iteration=it)
        dist.barrier()
        out[f"ckpt_save{it}" if f"ckpt_save{it}" not in out else "ckpt_resave3"] = _ops(url)
    assert ckpt.load({"m": model}, {"m": optim}) == 3
    dist.barrier()
    out["ckpt_load"] = _ops(url)
    return out


def _measure(seaweed: LocalS3Server, bucket: str, world: int) -> list[dict[str, dict[str, int]]]:
    proxies = [CountingProxy(seaweed.endpoint_url) for _ in range(world)]
    for p in proxies:
        p.__enter__()
    try:
        return run_ranks(_job, world, seaweed.env(), f"s3://{bucket}/run/step-1", [p.url for p in proxies])
    finally:
        for p in proxies:
            p.__exit__(None, None, None)


#: The coordinator's requests (rank 0), by phase; FILES data objects per rank.
COORDINATOR = {
    # HeadBucket (plan), data, one GET of .metadata (404: nothing to replace), PUT .metadata
    "save": {"HeadBucket": 1, "PutObject": FILES + 1, "GetObject": 1},
    # ... the GET finds the old checkpoint; the HEAD checks that ours is still committed; one batch delete
    "resave": {"HeadBucket": 1, "PutObject": FILES + 1, "GetObject": 1, "HeadObject": 1, "DeleteObjects": 1},
    # HEAD: is a checkpoint there; the If-None-Match probe (two PUTs, a DELETE; once per process and bucket)
    "exclusive": {"HeadBucket": 1, "HeadObject": 1, "PutObject": FILES + 3, "DeleteObject": 1},
    # .metadata once for the job (shared), this rank's ranges
    "load": {"GetObject": 1, "GetObjectRange": FILES},
}


@pytest.mark.parametrize("world", [2, 4])
def test_requests_per_rank(seaweed: LocalS3Server, bucket: str, world: int) -> None:
    """Only the coordinator lists, HEADs and reads .metadata; every other rank sends its data requests only."""
    per_rank = _measure(seaweed, bucket, world)
    for rank, phases in enumerate(per_rank):
        print(f"world {world} rank {rank}: {phases}")
    assert {p: per_rank[0][p] for p in COORDINATOR} == COORDINATOR
    for phases in per_rank[1:]:
        for phase in ("save", "resave", "exclusive"):
            assert phases[phase] == {"PutObject": FILES}, phases
        assert phases["load"] == {"GetObjectRange": FILES}, phases
        for phase in ("ckpt_init", "ckpt_save1", "ckpt_save2", "ckpt_save3", "ckpt_resave3", "ckpt_load"):
            assert set(phases[phase]) <= {"PutObject", "GetObjectRange"}, (phase, phases[phase])
    # The Checkpointer's rank 0: one listing per save for retention, deletes in batches (one per kind
    # of object: markers, .metadata, the rest), one listing to find the step to resume.
    assert per_rank[0]["ckpt_save3"]["DeleteObjects"] <= 3 and per_rank[0]["ckpt_load"]["ListObjects"] == 1
