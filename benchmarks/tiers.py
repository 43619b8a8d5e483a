"""Two tiers: training stall of a local-tier save vs a direct S3 save, promotion time, restart time.

One process, a model of ``--mib`` MiB of fp32 parameters (no optimizer), a SeaweedFS server on
127.0.0.1 and a local directory on the same disk. Contestants are interleaved in every repetition:

- ``s3_save``: ``Checkpointer(s3).save`` (the training loop waits for the whole upload);
- ``local_save``: ``Checkpointer(s3, local_root=...).save(..., tier="s3")``: what the loop waits for
  (the local write); ``promotion``: from the save call until the step is committed on S3;
- ``s3_load`` / ``local_load``: a restart, ``load`` into a fresh model, from S3 alone vs the local tier.

    python -m benchmarks.tiers [--mib 256] [--reps 2]

What this machine can show: the costs of the two paths relative to each other on one disk and a
loopback S3 server (no network: S3 here is as fast as its disk and CPU allow, so the gap to a real,
remote S3 at scale — bandwidth shared by every node — is understated). What it cannot show: many
nodes writing their own disks in parallel, NVMe vs network bandwidth, ``/dev/shm``.
Results go to ``benchmarks/results/tiers.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch
from torch import nn

from dcp_s3.checkpointer import Checkpointer
from dcp_s3.local_server import LocalS3Server

RESULTS = Path(__file__).resolve().parent / "results"


def model_of(mib: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    width = 2048
    layers = max(1, mib * 2**20 // (4 * width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "tiers.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    times: dict[str, list[float]] = {k: [] for k in ("s3_save", "local_save", "promotion", "s3_load", "local_load")}
    with LocalS3Server.start("seaweedfs") as server, tempfile.TemporaryDirectory() as tmp:
        os.environ.update(server.env())
        bucket = server.create_bucket(f"b-{uuid.uuid4().hex[:12]}")
        # Warm-up (the S3 client, the server's first bucket writes), not measured.
        Checkpointer(f"s3://{bucket}/warmup").save({"m": model_of(8, 2)}, iteration=0)
        model = model_of(args.mib, 0)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for rep in range(args.reps):
            direct, tiered = f"s3://{bucket}/direct{rep}", f"s3://{bucket}/tiered{rep}"
            local = os.path.join(tmp, f"local{rep}")
            t0 = time.perf_counter()
            Checkpointer(direct).save({"m": model}, iteration=1)
            times["s3_save"].append(time.perf_counter() - t0)
            ckpt = Checkpointer(tiered, local_root=local)
            t0 = time.perf_counter()
            ckpt.save({"m": model}, iteration=1, tier="s3")
            times["local_save"].append(time.perf_counter() - t0)
            ckpt.wait_promotions()
            times["promotion"].append(time.perf_counter() - t0)
            ckpt.close()
            for name, ck in (("s3_load", Checkpointer(direct)), ("local_load", Checkpointer(tiered, local_root=local))):
                fresh = model_of(args.mib, 1)
                t0 = time.perf_counter()
                assert ck.load({"m": fresh}) == 1
                times[name].append(time.perf_counter() - t0)
                if name == "local_load":
                    assert ck.last_load["source"] == "local", ck.last_load
                assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
            shutil.rmtree(local)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model_bytes": nbytes,
        "reps": args.reps,
        "seconds": times,
        "median_s": med,
        "stall_ratio_s3_over_local": med["s3_save"] / med["local_save"],
        "restart_ratio_s3_over_local": med["s3_load"] / med["local_load"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=2))


if __name__ == "__main__":
    main()
