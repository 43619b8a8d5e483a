"""Megatron-core ``dist_checkpointing`` (``torch_dist``): one save and one load of a ~384 MiB state, three ways.

- ``megatron-local``: Megatron-core's own writer (``FileSystemWriterAsync``) and reader to a local directory;
- ``megatron-msc``: Megatron-core with NVIDIA's multi-storage-client on (``msc://`` paths: its own route to an
  object store), against the benchmark's SeaweedFS;
- ``dcp_s3``: :mod:`dcp_s3.integrations.megatron` to the same SeaweedFS.

One rank (gloo), each measurement in a fresh process, Megatron's own ShardedTensors and a common state. On a
CPU-only torch Megatron's own writer cannot save (``FileSystemWriterAsync.preload_tensors`` calls
``torch.cuda.synchronize()``, its finalize puts a flag on ``torch.cuda.current_device()``): the children of the two
Megatron rows make those two calls CPU no-ops, nothing else. The machine is shared: times are rough, ratios from
one run are what to read. ``python -m benchmarks.megatron`` (~3 min) writes ``results/megatron.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    MiB,
    PeakRSS,
    build_state_dict,
    counter_delta,
    cpu_seconds,
    fmt,
    machine_info,
    markdown_table,
    new_bucket_name,
    open_endpoint,
    uniform_workload,
    verify_state_dict,
    write_json,
)

CONTESTANTS = ("megatron-local", "megatron-msc", "dcp_s3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sharded(state: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor

    out: dict[str, Any] = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}
    out["iteration"] = 1000  # common state: Megatron's common.pt
    return out


def _cpu_cuda_calls() -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _cpu_all() -> float:
    """CPU seconds of this process and of its children that ended (Megatron's writer forks workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return cpu_seconds() + children.ru_utime + children.ru_stime


def _timed(call: Any) -> dict[str, Any]:
    cpu0 = _cpu_all()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        value = call()
        seconds = time.perf_counter() - t0
    return {"value": value, "seconds": seconds, "cpu_s": _cpu_all() - cpu0, "peak_rss_growth": peak.growth}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One save or load in this (fresh) process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.msc_utils import MultiStorageClientFeature

    from benchmarks.contestants import msc
    from dcp_s3.integrations import megatron

    workload = uniform_workload(spec["size_mib"])
    name, op = spec["contestant"], spec["op"]
    state = build_state_dict(workload, fill="random" if op == "save" else "zeros")
    if name == "dcp_s3":
        MultiStorageClientFeature.disable()
        path = f"s3://{spec['bucket']}/{spec['prefix']}"
        save: Any = megatron.save
        load: Any = megatron.load
    else:
        _cpu_cuda_calls()
        save, load = dist_checkpointing.save, dist_checkpointing.load
        if name == "megatron-msc":
            target = SimpleNamespace(
                bucket=spec["bucket"], endpoint_url=spec["endpoint_url"], region="us-east-1", prefix=spec["prefix"]
            )
            path = msc._configure(target)
            MultiStorageClientFeature.enable()
        else:
            MultiStorageClientFeature.disable()
            path = spec["local_dir"]
            os.makedirs(path, exist_ok=True)
            os.makedirs(path + "-first", exist_ok=True)
    sharded = _sharded(state)
    result: dict[str, Any] = {"ok": True}
    if op == "save":  # first save of the process (pools, worker processes started), then the next one
        result["first_s"] = _timed(lambda: save(_sharded(state), path + "-first"))["seconds"]
    timed = _timed(lambda: save(sharded, path) if op == "save" else load(sharded, path))
    loaded = timed.pop("value")
    result.update(timed)
    if op == "load":
        result["verified"] = verify_state_dict(workload, {k: loaded[k] for k in state}) and loaded["iteration"] == 1000
    dist.destroy_process_group()
    return result


def _run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    child_env = {**os.environ, **env, "PYTHONWARNINGS": "ignore"}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.megatron", "--child", json.dumps(spec)],
        cwd=REPO_ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    return {"ok": False, "error": f"child exited {proc.returncode}: " + " | ".join(tail)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=int, default=384)
    parser.add_argument("--contestants", default=",".join(CONTESTANTS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "megatron.json")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    endpoint = open_endpoint("seaweedfs")
    local_root = Path(tempfile.mkdtemp(prefix="megatron-bench-"))
    rows: list[dict[str, Any]] = []
    try:
        bucket = endpoint.create_bucket(new_bucket_name("megatron"))
        for name in args.contestants.split(","):
            spec = {
                "contestant": name,
                "size_mib": args.size_mib,
                "bucket": bucket,
                "prefix": f"{name}/iter_0001000",
                "endpoint_url": endpoint.endpoint_url,
                "local_dir": str(local_root / name / "iter_0001000"),
            }
            for op in ("save", "load"):
                before = endpoint.counters(bucket)
                result = _run_child({**spec, "op": op}, endpoint.env)
                delta = counter_delta(before, endpoint.counters(bucket))
                rows.append({"contestant": name, "op": op, **result, "server": delta})
                print(name, op, {k: v for k, v in result.items() if k != "error"}, result.get("error", ""), flush=True)
    finally:
        endpoint.stop()
        shutil.rmtree(local_root, ignore_errors=True)
    payload = {"size_mib": args.size_mib, "rows": rows, "machine": machine_info()}
    write_json(args.out, payload)
    args.out.with_suffix(".md").write_text(_table(payload))


def _in_workers(row: dict[str, Any]) -> bool:
    """Megatron's own writer writes from forked worker processes: the saving process's RSS does not show it."""
    return bool(row["contestant"].startswith("megatron-") and row["op"] == "save")


def _table(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["rows"]:
        server = r.get("server") or {}
        requests = sum(server.get(k, 0.0) for k in ("GET", "PUT", "DELETE", "LIST", "HEAD", "POST"))
        mib = payload["size_mib"]
        rows.append(
            [
                r["contestant"],
                r["op"],
                fmt(r.get("first_s")) if r["op"] == "save" else "-",
                fmt(r.get("seconds")),
                fmt(mib / r["seconds"], 0) if r.get("seconds") else "-",
                fmt(r.get("cpu_s")),
                "(workers)"
                if _in_workers(r)
                else fmt((r.get("peak_rss_growth") or 0) / MiB, 0)
                if r.get("ok")
                else "-",
                # the save child saves twice (first, then measured): its requests are halved
                str(int(requests / (2 if r["op"] == "save" else 1)))
                if server and r["contestant"] != "megatron-local"
                else "-",
                {True: "yes", False: "NO"}.get(r.get("verified"), "-") if r["op"] == "load" else "-",
                "" if r.get("ok") else r.get("error", "")[:200],
            ]
        )
    head = [
        "contestant",
        "op",
        "first save s",
        "s",
        "MiB/s",
        "client CPU s",
        "peak RSS growth MiB",
        "S3 requests per call",
        "bit-exact",
        "error",
    ]
    return (
        f"# Megatron-core torch_dist: one save and one load of {payload['size_mib']} MiB (1 gloo rank)\n\n"
        + markdown_table(head, rows)
        + "\n"
    )


def _rewrite_table(path: Path) -> None:
    """Write ``path``'s ``.md`` again from its JSON (after a change to the table)."""
    path.with_suffix(".md").write_text(_table(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
