"""Soak: 50 save/load cycles on 2 real ranks through a proxy injecting ~5% transient faults.

One spawn runs all 50 cycles inside the ranks (gloo); each cycle saves to a new prefix,
loads every rank's tensors back and compares them bit-exactly. The proxy caps faults per
request below botocore's retry budget, so nothing may fail; afterwards the test checks
that faults were injected, no object or multipart upload was lost or left behind, and the
ranks' resident memory stayed flat.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from dist_utils import run_ranks  # noqa: E402
from fault_proxy import FaultProxy, Rule  # noqa: E402
from objects import data_name  # noqa: E402

from dcp_s3._local_server import LocalS3Server  # noqa: E402

MiB = 1 << 20
CYCLES = 50
WORLD = 2
PART = 5 * MiB
#: RSS growth allowed between cycle 10 and cycle 50, per rank.
RSS_SLACK = 40 * MiB


def _rank_state(rank: int, cycle: int) -> dict[str, torch.Tensor]:
    """Rank 0 writes ~5.2 MiB (a 2-part multipart upload), rank 1 ~1.2 MiB (one PutObject)."""
    g = torch.Generator().manual_seed(1000 * cycle + rank)
    big = 5 * MiB if rank == 0 else 1 * MiB
    return {
        f"r{rank}.w": torch.randn(big // 4, generator=g),
        f"r{rank}.h": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        f"r{rank}.i": torch.randint(-(1 << 40), 1 << 40, (4096,), generator=g, dtype=torch.int64),
        f"r{rank}.s": torch.tensor(float(cycle)),
    }


def _soak_rank(rank: int, world: int, endpoint: str, bucket: str, cycles: int) -> dict[str, Any]:
    import psutil
    import torch.distributed.checkpoint as dcp

    from dcp_s3 import S3StorageReader, S3StorageWriter
    from dcp_s3._objstore.config import TransferConfig

    proc = psutil.Process()
    rss: list[int] = []
    items = 0
    for cycle in range(cycles):
        uri = f"s3://{bucket}/soak/step-{cycle:04d}"
        mine = _rank_state(rank, cycle)
        writer = S3StorageWriter(uri, endpoint_url=endpoint, transfer=TransferConfig(part_size=PART, max_concurrency=4))
        dcp.save(mine, storage_writer=writer)
        writer._session.close()
        # Load every rank's tensors (own object and the other rank's) into fresh zeros.
        want: dict[str, torch.Tensor] = {}
        for r in range(world):
            want.update(_rank_state(r, cycle))
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        reader = S3StorageReader(uri, endpoint_url=endpoint, max_concurrency=4, max_range_size=4 * MiB)
        dcp.load(got, storage_reader=reader)
        reader._session.close()
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, (cycle, k)
            assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (
                f"cycle {cycle}: {k} differs"
            )
            items += 1
        del mine, want, got, writer, reader
        gc.collect()
        rss.append(proc.memory_info().rss)
    return {"rss": rss, "items": items}


@pytest.fixture
def proxy(s3_env: LocalS3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_env.endpoint_url, seed=2026, lifetime_s=300) as p:
        yield p


def test_soak_50_cycles_two_ranks_with_transient_faults(proxy: FaultProxy, bucket: str, s3_env: LocalS3Server) -> None:
    faults = ("500", "503", "reset", "truncate")  # truncate becomes reset on non-GET requests
    proxy.set_rules(
        [
            Rule(
                {"UploadPart", "PutObject", "GetObject", "GetObjectRange"}, faults=faults, rate=0.05, max_per_request=2
            ),
        ]
    )
    t0 = time.monotonic()
    results = run_ranks(_soak_rank, WORLD, proxy.url, bucket, CYCLES, timeout=240)
    elapsed = time.monotonic() - t0

    # Nothing lost: every rank checked every tensor of every cycle bit-exactly...
    per_cycle = sum(len(_rank_state(r, 0)) for r in range(WORLD))
    assert [res["items"] for res in results] == [CYCLES * per_cycle] * WORLD
    # ...and every checkpoint is complete on the server, with no upload left open.
    client = s3_env.client()
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="soak/"):
        keys.update(o["Key"] for o in page.get("Contents", []))
    for cycle in range(CYCLES):
        step = f"soak/step-{cycle:04d}"
        assert f"{step}/.metadata" in keys, cycle
        assert {data_name(k) for k in keys if k.startswith(step + "/") and k.endswith(".distcp")} == {"__0_0", "__1_0"}
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    # The proxy really injected faults, into uploads and downloads, multipart parts included.
    assert proxy.injected() >= 10, (proxy.faults, proxy.counts)
    assert proxy.injected(op="UploadPart") > 0, proxy.faults
    assert proxy.injected(op="PutObject") > 0, proxy.faults
    assert proxy.injected(op="GetObjectRange") + proxy.injected(op="GetObject") > 0, proxy.faults
    assert proxy.counts["UploadPart"] >= 2 * CYCLES, proxy.counts

    # RSS is flat once warmed up.
    for rank, res in enumerate(results):
        growth = res["rss"][-1] - res["rss"][9]
        assert growth < RSS_SLACK, f"rank {rank} RSS grew {growth / MiB:.1f} MiB from cycle 10 to {CYCLES}"
    print(
        f"\nsoak: {CYCLES} cycles x {WORLD} ranks in {elapsed:.1f}s; faults {dict(proxy.faults)}; "
        f"rss MiB (cycle 10 -> 50): {[(r['rss'][9] >> 20, r['rss'][-1] >> 20) for r in results]}"
    )
    assert elapsed < 150, elapsed  # ~75 s on 2 cores: ~1.1 s/cycle is DCP + SeaweedFS overhead even without faults
