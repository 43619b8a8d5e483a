"""Lightning checkpoints (dcp_s3.integrations.lightning_io): what each rank asks the server when loading.

Each rank talks through a counting proxy of its own. The stored Lightning metadata is sized from the
``.metadata`` the load reads once (on its coordinator, shared), so no rank reads ``.metadata`` again.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_proxy import CountingProxy, reset
from dist_utils import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dcp_s3 import StorageOptions
from dcp_s3._local_server import LocalS3Server
from dcp_s3.integrations.lightning_io import load_sharded, save_sharded

pytestmark = pytest.mark.multiproc


def _save_and_load(rank: int, world: int, env: dict[str, str], location: str, urls: list[str]) -> dict[str, Any]:
    os.environ.update(env)
    options = StorageOptions(endpoint_url=urls[rank])
    torch.manual_seed(0)
    module = nn.Linear(8, 4)
    save_sharded({"model": get_model_state_dict(module)}, {"step": 7}, location, options, rank=rank)
    dist.barrier()
    reset(urls[rank])
    with torch.no_grad():
        module.weight.zero_()
    meta = load_sharded(location, "model", module, {}, options)
    dist.barrier()
    ops: dict[str, int] = {}
    for op, key, n, _ in reset(urls[rank]).rows:
        name = f"{op} .metadata" if key.endswith("/.metadata") else op
        ops[name] = ops.get(name, 0) + n
    torch.manual_seed(0)
    return {"meta": meta, "ops": ops, "exact": torch.equal(module.weight, nn.Linear(8, 4).weight)}


def test_a_load_reads_metadata_once_for_the_job(seaweed: LocalS3Server, bucket: str) -> None:
    proxies = [CountingProxy(seaweed.endpoint_url) for _ in range(2)]
    for p in proxies:
        p.__enter__()
    try:
        results = run_ranks(_save_and_load, 2, seaweed.env(), f"s3://{bucket}/run/last", [p.url for p in proxies])
    finally:
        for p in proxies:
            p.__exit__(None, None, None)
    print([r["ops"] for r in results])
    assert all(r["meta"] == {"step": 7} and r["exact"] for r in results), results
    assert results[0]["ops"].get("GetObject .metadata") == 1, results[0]["ops"]
    assert "GetObject .metadata" not in results[1]["ops"], results[1]["ops"]
    assert set(results[1]["ops"]) == {"GetObjectRange"}, results[1]["ops"]
