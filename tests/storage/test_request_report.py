"""Per-rank request figures of a save or load: gathered through DCP's own finish step, never stored."""

from __future__ import annotations

import logging
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from throttle_proxy import ThrottleProxy

from dcp_s3 import ClientConfig, S3StorageReader, S3StorageWriter
from dcp_s3._dcp.request_report import RankResults, split_results, summary
from dcp_s3._layout import METADATA_KEY
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._objstore.rate_hooks import request_stats


def _throttled_save(rank: int, world: int, env: dict[str, str], uri: str, endpoint: str) -> dict:
    """A save whose client is told 100x the rate the proxy enforces: every rank is refused at first."""
    os.environ.update(env)
    client = ClientConfig(endpoint_url=endpoint, prefix_write_rate=200, throttle_deadline=300)
    state = {f"r{rank}.{i}": torch.arange(256.0) + rank + i for i in range(6)}
    writer = S3StorageWriter(uri, client=client, files_per_rank=6, metadata_format="dcp")
    dcp.save(state, storage_writer=writer)
    reader = S3StorageReader(uri, client=client)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=reader)
    dist.barrier()
    return {
        "save": writer.request_stats,
        "load": reader.request_stats,
        "process": request_stats(),
        "exact": all(torch.equal(got[k], v) for k, v in state.items()),
    }


@pytest.mark.multiproc
@pytest.mark.torch_range  # torch < 2.9 gives the writer no rank: the figures must still be keyed by rank
def test_the_coordinator_sees_every_ranks_refusals(seaweed: LocalS3Server, bucket: str) -> None:
    uri = f"s3://{bucket}/job/step-1"
    with ThrottleProxy(seaweed.endpoint_url, write_rate=2, read_rate=400) as proxy:
        results = run_ranks(_throttled_save, 2, seaweed.env(), uri, proxy.url)
        refused = proxy.stats()["refused"].get("write", 0)
    assert all(r["exact"] for r in results)
    coordinator, other = results[0]["save"], results[1]["save"]
    assert set(coordinator) == {0, 1} and set(other) == {1}
    # Rank 1's figures reached the coordinator as rank 1 measured them.
    assert coordinator[1] == other[1]
    for rank in (0, 1):
        assert sum(f["refusals"] for f in coordinator[rank].values()) > 0, coordinator
        assert sum(f["attempts"] for f in coordinator[rank].values()) >= 6, coordinator
        assert all(
            set(f) == {"attempts", "refusals", "wait_s", "rate", "peak_rate"} for f in coordinator[rank].values()
        )
    # Together they account for every refusal the proxy made during the save (the load reads only).
    assert sum(f["refusals"] for figures in coordinator.values() for f in figures.values()) == refused
    # The load: each rank its own, and none of the save's requests.
    for rank, r in enumerate(results):
        assert set(r["load"]) == {rank}
        load = r["load"][rank]
        assert load and all(k.endswith("(read)") for k in load), load
    # Nothing of it is in the stored .metadata.
    body = seaweed.client().get_object(Bucket=bucket, Key=f"job/step-1/{METADATA_KEY}")["Body"].read()
    assert b"refusals" not in body and b"request_report" not in body and b"RankResults" not in body
    load_metadata(body, uri)


def test_figures_are_this_saves_not_the_process_lifetime(
    s3_env: LocalS3Server, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = {f"t{i}": torch.arange(100.0) + i for i in range(4)}
    figures = []
    for step in range(2):
        writer = S3StorageWriter(f"s3://{bucket}/run/step-{step}", files_per_rank=4)
        with caplog.at_level(logging.INFO, logger="dcp_s3"):
            dcp.save(state, storage_writer=writer)
        figures.append(writer.request_stats)
        reader = S3StorageReader(f"s3://{bucket}/run/step-{step}")
        dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, storage_reader=reader)
        assert set(reader.request_stats) == {0} and reader.request_stats[0]
    assert set(figures[0]) == set(figures[1]) == {0}
    attempts = [sum(f["attempts"] for f in fig[0].values()) for fig in figures]
    # The same save twice: the same requests, not the second counting the first's too.
    assert attempts[0] == attempts[1] >= 5, figures
    assert any("save of s3://" in r.getMessage() and "paced requests" in r.getMessage() for r in caplog.records)


def test_rank_results_travel_by_pickle_and_are_taken_out() -> None:
    wrapped = RankResults(
        [], 3, {"s3://b/p/ (write)": {"attempts": 4.0, "refusals": 1.0, "wait_s": 0.5, "rate": 2.0, "peak_rate": 3.0}}
    )
    back = pickle.loads(pickle.dumps(wrapped))
    assert list(back) == [] and len(back) == 0
    plain, figures = split_results([back, []])
    assert plain == [[], []] and set(figures) == {3}
    line = summary("save of s3://b/p", figures)
    assert "1 rank(s), 4 paced requests, 1 refused" in line and "s3://b/p/ (write)" in line
