"""One measurement in a fresh process: ``python -m benchmarks.worker '<json spec>'``.

Spec keys: ``contestant``, ``op`` (``save`` | ``load`` | ``partial``), ``workload``,
``size_mib``, ``target`` (``contestants.Target`` fields), ``verify`` (bit-compare a
sample of loaded tensors afterwards, outside the timed block), ``warm`` (:func:`_warm_up` first),
``counters`` (``{"metrics_url", "bucket"}``: the server's per-bucket counters are read just before and
after the timed call, so that a warm-up's requests are not counted).

The state dict is built before measuring (the load target is zero-filled so its pages are
resident); libraries are imported before measuring; the client objects are created
inside the measured block, as a checkpoint call would. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

from . import common
from .contestants import Target, get


def _preimport(name: str) -> None:
    import boto3  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    if name.startswith("dcp_s3"):
        import dcp_s3  # noqa: F401
    elif name == "fsspec_s3fs":
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: F401
    elif name == "s3torchconnector":
        import s3torchconnector.dcp  # noqa: F401
    elif name == "msc":
        import multistorageclient.contrib.torch.filesystem  # noqa: F401


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    contestant = get(spec["contestant"])
    reason = contestant.unavailable()
    if reason:
        return {"ok": False, "skipped": True, "error": reason}
    _preimport(contestant.name)
    workload = common.make_workload(spec["workload"], int(spec["size_mib"]))
    target = Target(**spec["target"])
    op = spec["op"]
    if op == "save":
        sd = common.build_state_dict(workload, fill="random")
        keys = [t.key for t in workload.tensors]
    elif op == "load":
        sd = common.build_state_dict(workload, fill="zeros")
        keys = [t.key for t in workload.tensors]
    elif op == "partial":
        keys = workload.partial_keys(0.1)
        sd = common.build_state_dict(workload, fill="zeros", keys=keys)
    else:
        raise ValueError(f"unknown op {op!r}")
    logical = sum(t.nbytes for t in workload.tensors if t.key in set(keys))
    if spec.get("warm"):
        _warm_up(contestant, target, sd)
    counters = spec.get("counters")
    before = common.bucket_counters(**counters) if counters else None
    gc.collect()
    gc.disable()  # no collector pauses inside the timed block

    io0, cpu0 = common.proc_io(), common.cpu_seconds()
    with common.PeakRSS() as rss:
        _perf("enable")
        wall0 = time.time()
        t0 = time.perf_counter()
        if op == "save":
            contestant.save(sd, target)
        else:
            contestant.load(sd, target)
        seconds = time.perf_counter() - t0
        _perf("disable")
    cpu = common.cpu_seconds() - cpu0
    io1 = common.proc_io()
    gc.enable()
    server = common.counter_delta(before, common.bucket_counters(**counters)) if counters else None

    verified = None
    if op != "save" and spec.get("verify", True):
        verified = common.verify_state_dict(workload, sd)
    return {
        "ok": True,
        "contestant": contestant.name,
        "op": op,
        "seconds": seconds,
        "logical_bytes": logical,
        "n_tensors": len(keys),
        "gbps": logical / seconds / 1e9 if seconds > 0 else None,
        "peak_rss_growth_mib": rss.growth / common.MiB,
        "sampled_rss_growth_mib": rss.sampled_growth / common.MiB,
        "maxrss_growth_mib": None if rss.maxrss_growth is None else rss.maxrss_growth / common.MiB,
        "rss_samples": rss.samples,
        "baseline_rss_mib": rss.start / common.MiB,
        "cpu_s": cpu,
        "cpu_s_per_gb": cpu / (logical / 1e9) if logical else None,
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
        "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
        "verified": verified,
        "server": server,
        "wall_start": wall0,
        "wall_end": wall0 + seconds,
    }


def _warm_up(contestant: Any, target: Target, sd: dict[str, Any]) -> None:
    """A save and a load of this child's own state dict first, in this process, to another prefix: the timed
    call then runs as a training job's second and later checkpoints do (modules imported, the process's client
    made, as many connections open, threads started and buffers grown as a call of this size needs). Before
    2026-12-04 this was a save and load of one 16-element tensor, which left the first full-size call to open
    the other connections and grow the pools inside the timing (~0.05-0.1 CPU s/GiB more on dcp_s3's loads)."""
    import dataclasses

    warm = dataclasses.replace(target, prefix=target.prefix + "-warm", local_dir=os.path.join(target.local_dir, "warm"))
    contestant.save(sd, warm)
    contestant.load(sd, warm)


def _perf(command: str) -> None:
    """Tell a ``perf record --control fifo:CTL,ACK -D -1`` that runs this process to start or stop sampling
    (the retired ``benchmarks.stages``, commit 679e524: only the timed call is profiled); nothing without ``DCP_S3_BENCH_PERF_CTL``."""
    ctl = os.environ.get("DCP_S3_BENCH_PERF_CTL")
    if not ctl:
        return
    ctl_path, _, ack_path = ctl.partition(",")
    with open(ctl_path, "w") as f:
        f.write(command + "\n")
    with open(ack_path) as f:
        f.readline()


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = measure(spec)
    except BaseException as exc:  # report, don't crash the suite
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
