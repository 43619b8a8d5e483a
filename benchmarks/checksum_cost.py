"""Cost of dcp_s3's per-item CRC32C checksums relative to a save and a load.

Times ``crc32c`` (the C package dcp_s3 uses) over a 1 GiB buffer on one thread, then a
single save and a single load of a 512 MiB state dict with S3StorageWriter /
S3StorageReader against a local SeaweedFS server, and reports the checksum time of the
checkpoint's bytes as a percentage of each. Every payload byte is checksummed once on
save and once on load (when read whole), so ``crc32c time for 512 MiB`` is the cost
added to each operation (on the thread that serializes / finishes the items).

    python -m benchmarks.checksum_cost [--state-mib 512] [--crc-mib 1024]

Writes ``benchmarks/results/checksum_cost.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid
from pathlib import Path

import torch
from crc32c import crc32c

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results" / "checksum_cost.json"


def time_crc(buf: memoryview, reps: int = 3) -> float:
    """Best of ``reps`` single-threaded crc32c passes over ``buf``, in seconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        crc32c(buf)
        best = min(best, time.perf_counter() - t0)
    return best


def state_dict(total_mib: int) -> dict[str, torch.Tensor]:
    n = 8
    per = total_mib * MiB // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per // 1024, 1024, generator=g) for i in range(n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-mib", type=int, default=512)
    ap.add_argument("--crc-mib", type=int, default=1024)
    args = ap.parse_args()

    import torch.distributed.checkpoint as dcp

    from dcp_s3 import S3StorageReader, S3StorageWriter
    from dcp_s3.local_server import LocalS3Server

    # 1. crc32c throughput on one thread.
    big = bytearray(os.urandom(MiB)) * args.crc_mib
    crc_s = time_crc(memoryview(big))
    del big
    crc_gbps = args.crc_mib * MiB / crc_s / 1e9

    sd = state_dict(args.state_mib)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    crc_state_s = nbytes / (crc_gbps * 1e9)

    with LocalS3Server.start("seaweedfs") as server:
        for name, value in server.env().items():
            os.environ[name] = value
        bucket = server.create_bucket(f"bench-{uuid.uuid4().hex[:12]}")
        uri = f"s3://{bucket}/checksum-cost/step-1"
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=S3StorageWriter(uri))
        save_s = time.perf_counter() - t0
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=S3StorageReader(uri))
        load_s = time.perf_counter() - t0
        assert all(torch.equal(out[k], sd[k]) for k in sd), "loaded tensors differ"

    result = {
        "crc_buffer_mib": args.crc_mib,
        "crc_seconds": crc_s,
        "crc_gb_per_s": crc_gbps,
        "state_mib": nbytes / MiB,
        "crc_state_seconds": crc_state_s,
        "save_seconds": save_s,
        "load_seconds": load_s,
        "save_mb_per_s": nbytes / save_s / 1e6,
        "load_mb_per_s": nbytes / load_s / 1e6,
        "crc_pct_of_save": 100 * crc_state_s / save_s,
        "crc_pct_of_load": 100 * crc_state_s / load_s,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "server": "SeaweedFS (weed mini) on 127.0.0.1, single run",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print(f"crc32c, 1 thread: {args.crc_mib} MiB in {crc_s * 1e3:.0f} ms = {crc_gbps:.2f} GB/s\n")
    print(f"| operation ({nbytes / MiB:.0f} MiB) | time | throughput | crc32c of the payload | crc share |")
    print("|---|---|---|---|---|")
    for op, secs, pct in (("save", save_s, result["crc_pct_of_save"]), ("load", load_s, result["crc_pct_of_load"])):
        print(f"| {op} | {secs:.2f} s | {nbytes / secs / 1e6:.0f} MB/s | {crc_state_s * 1e3:.0f} ms | {pct:.1f}% |")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
