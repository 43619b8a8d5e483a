"""Latency of small checkpoints: a tiny step saved and loaded the way training codebases do it.

Those codebases construct ``S3StorageWriter(credential_path=..., path=...)`` (and a reader)
for every part of every step, so each part used to pay for a new boto3 session and client
(0.3-0.5 s here) before its first byte moved. dcp_s3 now shares one client per settings in
a process. This measures a step of 2 models x (model + optimizer) parts plus the ``.pth``
marker, each part its own ``dcp.save`` / ``dcp.load`` with fresh writer/reader objects,
against torch's ``FileSystemWriter``/``FileSystemReader`` on local disk.

    python -m benchmarks.small_steps [--reps 5]

Run it against another checkout of dcp_s3 (``PYTHONPATH=<checkout>``) to compare versions;
results go to ``benchmarks/results/small_steps.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dcp_s3
from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3.local_server import LocalS3Server

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("model", "ema")


def tiny_step() -> dict[str, dict[str, Any]]:
    """Parts of one step: ~100 KB each, a few dozen tensors, plus optimizer-like byte items."""
    torch.manual_seed(0)
    parts: dict[str, dict[str, Any]] = {}
    for key in KEYS:
        parts[f"{key}_model"] = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
        parts[f"{key}_optim"] = {
            "state": {f"layer{i}.weight": {"exp_avg": torch.randn(64, 64)} for i in range(6)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [f"layer{i}.weight" for i in range(6)]}],
        }
    return parts


def blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank(v) for v in state]
    return state


def save_step(root: str, step: int, parts: dict[str, Any], s3: dict[str, Any] | None) -> None:
    for name, state in parts.items():
        where = f"{root}/{step:07d}.{name}"
        writer = S3StorageWriter(path=where, **s3) if s3 is not None else FileSystemWriter(where)
        dcp.save(state, storage_writer=writer, no_dist=True)
    dcp_s3.save_object({"iteration": step}, f"{root}/{step:07d}.pth", **(s3 or {}))


def load_step(root: str, step: int, parts: dict[str, Any], s3: dict[str, Any] | None) -> None:
    for name, state in parts.items():
        where = f"{root}/{step:07d}.{name}"
        reader = S3StorageReader(path=where, **s3) if s3 is not None else FileSystemReader(where)
        out = blank(state)
        dcp.load(out, storage_reader=reader, no_dist=True)


def measure(root: str, s3: dict[str, Any] | None, reps: int) -> dict[str, float]:
    parts = tiny_step()
    save_s, load_s = [], []
    for step in range(reps + 1):  # the first repetition warms imports and the server up: not counted
        t0 = time.perf_counter()
        save_step(root, step, parts, s3)
        t1 = time.perf_counter()
        load_step(root, step, parts, s3)
        t2 = time.perf_counter()
        if step:
            save_s.append(t1 - t0)
            load_s.append(t2 - t1)
    return {"save_s": statistics.median(save_s), "load_s": statistics.median(load_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(RESULTS / "small_steps.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {"label": args.label, "dcp_s3": os.path.dirname(dcp_s3.__file__), "reps": args.reps}
    with tempfile.TemporaryDirectory(prefix="dcp-s3-small-") as tmp:
        results["local"] = measure(tmp, None, args.reps)
        with LocalS3Server.start("seaweedfs") as server:
            bucket = server.create_bucket(f"small-{uuid.uuid4().hex[:8]}")
            cred = Path(tmp) / "cred.json"
            cred.write_text(
                json.dumps(
                    {
                        "aws_access_key_id": server.access_key,
                        "aws_secret_access_key": server.secret_key,
                        "endpoint_url": server.endpoint_url,
                        "region_name": server.region,
                    }
                )
            )
            cred.chmod(0o600)
            results["s3"] = measure(f"s3://{bucket}/run", {"credential_path": str(cred)}, args.reps)
    for where in ("local", "s3"):
        r = results[where]
        print(f"{where:>5}: save {r['save_s']:.3f} s, load {r['load_s']:.3f} s (median of {args.reps}, 4 parts)")
    print(
        f"S3 / local: save {results['s3']['save_s'] / results['local']['save_s']:.1f}x, "
        f"load {results['s3']['load_s'] / results['local']['load_s']:.1f}x"
    )
    existing = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    existing[args.label or "current"] = results
    Path(args.out).write_text(json.dumps(existing, indent=2) + "\n")


if __name__ == "__main__":
    main()
