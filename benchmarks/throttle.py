"""Savers against a prefix that throttles: botocore's ``standard`` and ``adaptive`` retries against dcp_s3's rate
controller (issue 27), through the loopback throttling proxy of the tests (``tests/throttle_proxy.py``), which
enforces a per-prefix write rate like S3's (scaled down) and answers ``503 SlowDown``.

    python -m benchmarks.throttle                  # 8 savers, overload 5x / 20x / 50x, 3 modes (~15 min)
    python -m benchmarks.throttle --overloads 20 --savers 4

Each saver is its own process (its own client), all start at the same instant, and each saves one checkpoint of
``--objects`` data objects (plus ``.metadata``) under one prefix. Overload = the writes' offered rate (all writes
in ``--burst-s`` seconds) over the enforced rate, so the ideal makespan is writes / enforced rate. Reported per
mode and overload: failed saves, makespan / ideal, attempts per accepted write, refused fraction, goodput (accepted
writes per second over the enforced rate), p99 of a write request's latency (retries included) and the spread of
finish times; and, with no throttling, the controller's overhead against botocore alone (same run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

MODES = {  # ClientConfig settings of each contestant
    "standard": {"rate_control": False, "retry_mode": "standard"},
    "adaptive": {"rate_control": False, "retry_mode": "adaptive"},
    "controller": {"rate_control": True},
}


def child(args: argparse.Namespace) -> None:
    """One saver: prints one JSON line."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_s3 import ClientConfig, S3StorageWriter

    settings = dict(MODES[args.mode], endpoint_url=args.endpoint, prefix_write_rate=args.rate)
    client = ClientConfig(**settings)
    latencies: list[float] = []

    def start(context: dict[str, Any], **_: Any) -> None:
        context["bench_t0"] = time.monotonic()

    def end(context: dict[str, Any], model: Any, **_: Any) -> None:
        if model.name in ("PutObject", "UploadPart", "CompleteMultipartUpload", "CreateMultipartUpload"):
            latencies.append(time.monotonic() - context.get("bench_t0", time.monotonic()))

    state = {f"t{i}": torch.full((256,), float(i)) for i in range(args.objects)}
    writer = S3StorageWriter(args.uri, client=client, files_per_rank=args.objects)
    events = writer._session.client_config.client().meta.events  # the writer's (shared, cached) client
    events.register("before-call.s3", start)
    events.register("after-call.s3", end)
    events.register("after-call-error.s3", end)
    time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.monotonic()
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
        error = None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("RESULT " + json.dumps({"error": error, "seconds": time.monotonic() - t0, "latencies": latencies}),
          flush=True)


def run_savers(proxy: Any, bucket: str, env: dict[str, str], mode: str, args: argparse.Namespace,
               rate: float) -> list[dict[str, Any]]:
    start_at = time.time() + 8 + 2 * args.savers  # every saver has imported torch by then
    run = f"{mode}-{int(time.time() * 1000)}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.throttle", "--child", "--mode", mode, "--endpoint", proxy.url,
             "--uri", f"s3://{bucket}/hot/{run}-{i}", "--rate", str(rate), "--objects", str(args.objects),
             "--start-at", str(start_at)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=common.REPO_ROOT,
        )
        for i in range(args.savers)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"saver died: {err[-2000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def measure(server: Any, bucket: str, mode: str, args: argparse.Namespace, rate: float | None) -> dict[str, Any]:
    from throttle_proxy import ThrottleProxy

    enforced = rate if rate is not None else 1e6
    env = {**os.environ, **server.env(), "PYTHONPATH": str(common.REPO_ROOT)}
    with ThrottleProxy(server.endpoint_url, write_rate=enforced, read_rate=1e6, prefix_depth=1) as proxy:
        # The controller is told the enforced rate as its per-prefix budget (the setting for it); with no
        # throttling it gets S3's default.
        results = run_savers(proxy, bucket, env, mode, args, enforced if rate is not None else 3500.0)
        stats = proxy.stats()
    accepted, refused = stats["accepted"].get("write", 0), stats["refused"].get("write", 0)
    seconds = [r["seconds"] for r in results]
    latencies = sorted(x for r in results for x in r["latencies"])
    makespan = max(seconds)
    row: dict[str, Any] = {
        "mode": mode, "enforced_rate": rate, "failed": sum(r["error"] is not None for r in results),
        "savers": len(results), "makespan_s": makespan, "accepted": accepted, "refused": refused,
        "refused_fraction": refused / max(1, accepted + refused), "attempts_per_write": (accepted + refused) / max(1, accepted),
        "p99_latency_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "finish_spread_s": makespan - min(seconds), "errors": sorted({r["error"] for r in results if r["error"]}),
    }
    if rate is not None:
        row["ideal_s"] = accepted / rate
        row["makespan_over_ideal"] = makespan / row["ideal_s"]
        row["goodput"] = accepted / makespan / rate
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="controller")
    ap.add_argument("--endpoint")
    ap.add_argument("--uri")
    ap.add_argument("--rate", type=float, default=3500.0)
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--savers", type=int, default=8)
    ap.add_argument("--overloads", default="5,20,50")
    ap.add_argument("--burst-s", type=float, default=2.0, help="offered load: every write in this many seconds")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(common.RESULTS_DIR / "throttle.json"))
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(common.REPO_ROOT / "tests"))  # the tests' throttling proxy (stdlib only)
    from dcp_s3.local_server import LocalS3Server

    writes = args.savers * (args.objects + 1)
    offered = writes / args.burst_s
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LocalS3Server.start("seaweedfs") as server:
        bucket = server.create_bucket(common.new_bucket_name("throttle"))
        modes = args.modes.split(",")
        for mode in ("standard", "controller"):  # overhead when nothing throttles, same run
            rows.append({**measure(server, bucket, mode, args, None), "overload": 0})
            print(json.dumps(rows[-1]), flush=True)
        for overload in (float(x) for x in args.overloads.split(",")):
            for mode in modes:  # interleaved: background load hits every mode alike
                rows.append({**measure(server, bucket, mode, args, offered / overload), "overload": overload})
                print(json.dumps(rows[-1]), flush=True)
    table = [
        [f"{r['overload']:g}x" if r["overload"] else "none", r["mode"], f"{r['failed']}/{r['savers']}",
         common.fmt(r.get("makespan_over_ideal")) if r["overload"] else common.fmt(r["makespan_s"]) + " s",
         common.fmt(r["attempts_per_write"]), common.fmt(r["refused_fraction"]), common.fmt(r.get("goodput")),
         common.fmt(r["p99_latency_s"]), common.fmt(r["finish_spread_s"])]
        for r in rows
    ]
    md = common.markdown_table(
        ["overload", "mode", "failed saves", "makespan / ideal", "attempts per write", "refused", "goodput",
         "p99 write latency s", "finish spread s"], table)
    base = {r["mode"]: r["makespan_s"] for r in rows if not r["overload"]}
    overhead = base["controller"] / base["standard"] - 1 if "standard" in base else None
    text = (f"{args.savers} savers x {args.objects + 1} writes, one prefix, offered {offered:.0f} writes/s "
            f"(enforced rate = offered / overload); SeaweedFS behind tests/throttle_proxy.py\n\n{md}\n\n"
            f"No throttling: controller makespan {base.get('controller', 0):.2f} s against {base.get('standard', 0):.2f} s "
            f"for botocore alone ({overhead:+.1%}).\n")
    print(text)
    out = Path(args.out)
    common.write_json(out, {"benchmark": "throttle", "rows": rows, "machine": common.machine_info(),
                            "seconds": time.monotonic() - t0, "args": vars(args)})
    out.with_suffix(".md").write_text(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
