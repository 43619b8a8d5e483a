"""One saver of tests/objstore/test_rate_control.py: a DCP save of 16 data objects + .metadata, started
at an agreed time (so that every saver meets the throttle at once). Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import ClientConfig, S3StorageWriter
from dcp_s3._objstore.rate_hooks import request_stats


def main() -> None:
    uri, endpoint, rate_control, budget, deadline, start_at = sys.argv[1:7]
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(16)}
    client = ClientConfig(
        endpoint_url=endpoint,
        rate_control=rate_control == "1",
        prefix_write_rate=float(budget),
        throttle_deadline=float(deadline),
    )
    writer = S3StorageWriter(uri, client=client, files_per_rank=16)
    time.sleep(max(0.0, float(start_at) - time.time()))
    t0 = time.monotonic()
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
        result = {"ok": True}
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException; reported to the test
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result.update(seconds=time.monotonic() - t0, stats=request_stats())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
