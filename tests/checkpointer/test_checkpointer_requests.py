"""What a Checkpointer.load costs in requests, counted by a proxy in front of SeaweedFS on real gloo ranks.

Loading a step with an optimizer GETs each part's ``.metadata`` once in total: the optimizer
compatibility check runs inside ``dcp.load`` on the metadata it already shares, not on a read of
its own on every rank. A mismatching optimizer still gives the same warning and fresh state, on
every rank, also when only one rank's optimizer does not fit.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_proxy import CountingProxy, reset
from dist_utils import run_ranks
from test_checkpointer import Net, build, same, snapshot, train, trainable

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._local_server import LocalS3Server

pytestmark = [pytest.mark.multiproc, pytest.mark.torch_range]  # torch_range: also on the lowest and highest torch


def metadata_gets(rank: int, proxy: str) -> dict[str, int] | None:
    """Barrier, then (rank 0) the ``.metadata`` GETs per part since the previous call, zeroed."""
    dist.barrier()
    got = reset(proxy) if rank == 0 else None
    dist.barrier()
    if got is None:
        return None
    # Each part lies in the save's generation directory (<step>.m_<part>.<16 hex>/).
    return {
        part: sum(
            n
            for op, key, n, _ in got.rows
            if op.startswith("GetObject") and re.search(rf"\.m_{part}(\.[0-9a-f]{{16}})?/\.metadata$", key)
        )
        for part in ("model", "optim")
    }


def mismatch_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "does not match the optimizer" in str(w.message)]


def load_job(rank: int, world: int, env: dict[str, str], root: str, proxy: str) -> dict[str, Any]:
    os.environ.update(env)
    model, optim, sched = build(seed=1)
    ckpt = Checkpointer(root)
    train(model, optim, sched, seed=10)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=10)
    ref = snapshot(model, optim)
    out: dict[str, Any] = {"save": metadata_gets(rank, proxy)}

    # A matching optimizer: model and optimizer restored, one GET of each part's .metadata.
    model2, optim2, sched2 = build(seed=2)
    assert ckpt.load({"m": model2}, {"m": optim2}, {"m": sched2}) == 10
    got = snapshot(model2, optim2)
    same(trainable(ref["model"]), trainable(got["model"]))
    same(ref["optim"], got["optim"])
    out["load"] = metadata_gets(rank, proxy)

    # Every rank's optimizer mismatches (SGD momentum vs saved Adam state): a warning, fresh state.
    model3, _, _ = build(seed=3)
    sgd = torch.optim.SGD([p for p in model3.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.load({"m": model3}, {"m": sgd}, path=f"{root}/0000010") == 10
    out["all_mismatch_warnings"] = mismatch_warnings(caught)
    assert all(int(torch.count_nonzero(s["momentum_buffer"].full_tensor())) == 0 for s in sgd.state.values())
    same(trainable(ref["model"]), trainable(snapshot(model3)["model"]))
    out["all_mismatch"] = metadata_gets(rank, proxy)

    # Only the last rank's optimizer mismatches (unsharded models, each rank loads it whole):
    # no rank loads optimizer state, every rank warns with the same reason.
    torch.manual_seed(4)
    plain = Net()
    params = [p for p in plain.parameters() if p.requires_grad]
    mine = torch.optim.SGD(params, lr=0.1, momentum=0.9) if rank == world - 1 else torch.optim.Adam(params, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.load({"m": plain}, {"m": mine}, path=f"{root}/0000010") == 10
    out["one_mismatch_warnings"] = mismatch_warnings(caught)
    # fresh moments are zeros (get_optimizer_state_dict initializes them by a step with zero grads)
    out["one_mismatch_nonzero"] = sum(
        int(torch.count_nonzero(v))
        for s in mine.state.values()
        for k, v in s.items()
        if k != "step" and isinstance(v, torch.Tensor)
    )
    same(trainable(ref["model"]), trainable(plain.state_dict()))
    out["one_mismatch"] = metadata_gets(rank, proxy)
    return out


@pytest.fixture
def proxy(s3_env: LocalS3Server) -> Iterator[CountingProxy]:
    with CountingProxy(s3_env.endpoint_url) as p:
        yield p


def test_load_with_optimizer_gets_each_metadata_once(bucket: str, s3_env: LocalS3Server, proxy: CountingProxy) -> None:
    world = 3
    env = {**s3_env.env(), "AWS_ENDPOINT_URL": proxy.url}
    results = run_ranks(load_job, world, env, f"s3://{bucket}/run", proxy.url, timeout=400)
    counts = results[0]
    print(
        "'.metadata' GETs per part:", {k: v for k, v in counts.items() if k in ("load", "all_mismatch", "one_mismatch")}
    )
    assert counts["load"] == {"model": 1, "optim": 1}, counts
    assert counts["all_mismatch"] == {"model": 1, "optim": 1}, counts
    assert counts["one_mismatch"] == {"model": 1, "optim": 1}, counts
    for r in results:
        (warned,) = r["all_mismatch_warnings"]
        assert "0000010.m_optim" in warned and "momentum_buffer" in warned, warned
        assert "continuing with fresh optimizer state" in warned
        (warned,) = r["one_mismatch_warnings"]
        assert "0000010.m_optim" in warned, warned
        assert r["one_mismatch_nonzero"] == 0, r  # no rank loaded optimizer state, not even the matching ones
    # the reason is the same on every rank (it comes from one rank, through the coordinator)
    assert len({r["one_mismatch_warnings"][0] for r in results}) == 1
