"""What dcp_s3's rate controller costs when nothing throttles (issue 27's target: <= 2% overhead).

    python -m benchmarks.throttle_overhead                     # ~3-5 min on 2 cores: SeaweedFS, 512 MiB saves, 6 reps
    python -m benchmarks.throttle_overhead --requests 500 --reps 2 --size-mib 128   # a quick look

``ClientConfig(rate_control=True)`` (the default, "controller") against ``rate_control=False`` ("off":
botocore's own retries, no hooks), on a loopback S3 server that throttles nothing, in three parts:

1. **Per request**: three clients in this process (controller, off, and a second off client "off2" as a
   control) each send ``--requests`` PutObject (4-byte bodies), ranged GetObject (4 bytes) and HeadObject.
   The clients take turns request by request (every order of the three in turn), so background load and
   drift hit all three alike. ``time.process_time`` (every thread of this process; the server is another
   process) and ``perf_counter`` around each request; the difference controller − off is averaged over the
   rounds with a 95% interval, and off2 − off (an A/A comparison) shows how far noise alone moves it. Also
   counted (deterministic, whatever the machine's load): function calls per request (cProfile, 50 per
   operation and client). The hooks' own cost: timed in place (the four handlers ``install_rate_control``
   registers, ``tag``, ``pace``, ``decide`` and quota release, each wrapped in a timer inside a client sending
   requests), and in tight loops with no I/O: the controller alone (``acquire`` + ``release`` of one key with
   an unlimited budget) and the four hooks alone (called with a synthetic 200 answer).
2. **A save**: ``dcp.save(..., no_dist=True)`` of a ``--size-mib`` transformer training state through
   ``benchmarks.worker`` (a fresh process per save; contestant ``dcp_s3:rate_control=1`` or ``=0``),
   ``--reps`` saves per mode, interleaved ABBA. Wall seconds and process CPU seconds (getrusage, all
   threads) of the ``dcp.save`` call, and its requests (SeaweedFS' per-bucket counters).
3. **Expected overhead** of a save = extra CPU per request (part 1: measured; extra function calls x the off
   client's CPU per call; the hooks in place; the hooks alone) x requests per save (part 2) / the save's CPU:
   resolves far below the 2% that part 2's direct comparison cannot on a shared 2-core machine.

Results: ``results/throttle_overhead.json`` (per operation and client: means, medians, each tenth's mean; every save) and ``.md`` (the tables).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import math
import os
import pstats
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402

MODES = {"controller": True, "off": False}  # mode -> ClientConfig(rate_control=...)
# Part 1's clients: the two modes and a second off client, the control (A/A: the noise of a paired difference).
CLIENTS = {**MODES, "off2": False}
OPS = ("PutObject", "GetObject (4 bytes)", "HeadObject")
BODY = b"dcp!"


def _pair(i: int) -> tuple[str, str]:
    """Both modes, in the order of the ``i``-th round: each round the reverse of the one before (ABBA)."""
    return ("controller", "off") if i % 2 == 0 else ("off", "controller")


def _abba(n: int) -> list[tuple[int, str]]:
    """``n`` rounds of both modes, ABBA: (round, mode) in run order."""
    return [(i, m) for i in range(n) for m in _pair(i)]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _range(s: dict[str, float], digits: int = 1) -> str:
    """``median (min–max)`` of a :func:`_spread`."""
    return f"{common.fmt(s['median'], digits)} ({common.fmt(s['min'], digits)}–{common.fmt(s['max'], digits)})"


# --------------------------------------------------------------------------------------------
# Part 1: per-request cost.
# --------------------------------------------------------------------------------------------
def _requests_of(client: Any, bucket: str, op: str, mode: str) -> Callable[[int], None]:
    if op == "PutObject":
        return lambda i: client.put_object(Bucket=bucket, Key=f"requests/{mode}/{i}", Body=BODY)
    if op == "HeadObject":
        return lambda i: client.head_object(Bucket=bucket, Key="requests/object")
    return lambda i: client.get_object(Bucket=bucket, Key="requests/object", Range="bytes=0-3")["Body"].read()


def _timed(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """Process CPU and wall seconds of ``fn(0..n-1)``, with the collector off."""
    gc.collect()
    gc.disable()
    try:
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(n):
            fn(i)
        return time.process_time() - c0, time.perf_counter() - w0
    finally:
        gc.enable()


def measure_requests(endpoint: common.Endpoint, bucket: str, n: int) -> dict[str, Any]:
    """Part 1 through real clients: per operation and client, the CPU and wall µs of each of ``n`` requests, the
    clients taking turns request by request."""
    from dcp_s3 import ClientConfig
    from dcp_s3.objstore.rate_hooks import request_stats

    os.environ.update(endpoint.env)  # the clients' credentials (boto3's environment chain)
    # make_client: a new client each, not the process's shared one (the two off clients have equal settings).
    clients = {
        m: ClientConfig(endpoint_url=endpoint.endpoint_url, rate_control=rc).make_client() for m, rc in CLIENTS.items()
    }
    clients["off"].put_object(Bucket=bucket, Key="requests/object", Body=BODY)
    for mode, client in clients.items():  # warm-up: connections, botocore's lazily built models and handlers
        for op in OPS:
            _timed(_requests_of(client, bucket, op, f"warm-{mode}"), 20)
    before = request_stats()
    orders = list(itertools.permutations(CLIENTS))  # every order in turn: no client always first or last
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    for op in OPS:
        send = {m: _requests_of(c, bucket, op, m) for m, c in clients.items()}
        mine = samples[op] = {m: {"cpu_us": [], "wall_us": []} for m in clients}
        gc.collect()
        gc.disable()
        try:
            for i in range(n):
                for mode in orders[i % len(orders)]:
                    c0, w0 = time.process_time(), time.perf_counter()
                    send[mode](i)
                    c1, w1 = time.process_time(), time.perf_counter()
                    mine[mode]["cpu_us"].append((c1 - c0) * 1e6)
                    mine[mode]["wall_us"].append((w1 - w0) * 1e6)
                if i % 500 == 499:
                    gc.collect()  # outside any request's timing
        finally:
            gc.enable()
    stats = {k: v for k, v in request_stats().items() if f"s3://{bucket}/" in k}
    paced = {
        k: {f: v[f] - before.get(k, {}).get(f, 0) for f in ("attempts", "refusals", "wait_s")} for k, v in stats.items()
    }
    calls_per_request = {
        m: {op: _calls_per_request(_requests_of(c, bucket, op, f"calls-{m}"), 50) for op in OPS}
        for m, c in clients.items()
    }
    endpoint.delete_prefix(bucket, "requests/")
    return {"requests": n, "samples": samples, "controller_keys": paced, "calls_per_request": calls_per_request}


def _calls_per_request(fn: Callable[[int], None], n: int) -> float:
    """Function calls (Python and builtin, as cProfile counts them) per ``fn``: deterministic, unlike time."""

    def run() -> None:
        for i in range(n):
            fn(i)

    profile = cProfile.Profile()
    profile.runcall(run)
    return sum(v[1] for v in pstats.Stats(profile).stats.values()) / n  # type: ignore[attr-defined]


def _mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and its 95% interval (normal: the values are thousands of per-request differences)."""
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.inf
    return {"mean": mean, "low": mean - half, "high": mean + half}


def summarize_requests(samples: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """Per operation (and all together): each client's mean and median µs per request, the mean of the per-round
    differences controller − off and off2 − off with 95% intervals, and each client's mean over each tenth of the
    run (to see drift)."""
    out: dict[str, Any] = {}
    for op in (*OPS, "all"):
        ops = OPS if op == "all" else (op,)
        series = {m: {w: [x for o in ops for x in samples[o][m][w]] for w in ("cpu_us", "wall_us")} for m in CLIENTS}
        row: dict[str, Any] = {}
        for m, s in series.items():
            tenth = max(1, len(s["cpu_us"]) // 10)
            row[m] = {
                "cpu_us_mean": statistics.fmean(s["cpu_us"]),
                "cpu_us_median": statistics.median(s["cpu_us"]),
                "wall_us_mean": statistics.fmean(s["wall_us"]),
                "cpu_us_by_tenth": [
                    round(statistics.fmean(s["cpu_us"][i : i + tenth]), 1) for i in range(0, len(s["cpu_us"]), tenth)
                ],
            }
        for name, a in (("diff", "controller"), ("control_diff", "off2")):  # a - off, request by request
            for w in ("cpu_us", "wall_us"):
                row[f"{name}_{w}"] = _mean_ci([x - y for x, y in zip(series[a][w], series["off"][w])])
        out[op] = row
    return out


HOOK_NAMES = {
    "before-parameter-build.s3": "tag",
    "request-created.s3": "pace",
    "needs-retry.s3": "decide",
    "after-call.s3": "quota release",
}


class _TimedEvents:
    """Stands in for a client's event system: registers each handler on the real one wrapped in a timer (this
    thread's CPU time, ns, summed per event)."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _timed(self, event: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        def timed(**kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return handler(**kwargs)
            finally:
                self.ns[event] = self.ns.get(event, 0) + time.thread_time_ns() - t0
                self.calls[event] = self.calls.get(event, 0) + 1

        return timed

    def register(self, event: str, handler: Callable[..., Any]) -> None:
        self.events.register(event, self._timed(event, handler))

    def register_first(self, event: str, handler: Callable[..., Any]) -> None:
        self.events.register_first(event, self._timed(event, handler))


def measure_hooks_in_place(endpoint: common.Endpoint, bucket: str, n: int) -> dict[str, float]:
    """The hooks' CPU µs per request timed where they run: inside a client sending ``n`` requests of each operation
    (cache and branch state as in real use, unlike the tight loop), less the timer's own cost (a handler that does
    nothing, timed the same way)."""
    from dcp_s3 import ClientConfig
    from dcp_s3.objstore.rate_hooks import install_rate_control

    os.environ.update(endpoint.env)  # the client's credentials (boto3's environment chain)
    config = ClientConfig(endpoint_url=endpoint.endpoint_url, rate_control=False)  # botocore's retries, no hooks
    client = config.make_client()
    events = _TimedEvents(client.meta.events)
    install_rate_control(
        SimpleNamespace(meta=SimpleNamespace(endpoint_url=client.meta.endpoint_url, events=events)),
        retry_attempts=config.retry_attempts,
        deadline=config.throttle_deadline,
        write_rate=config.prefix_write_rate,
        read_rate=config.prefix_read_rate,
    )
    events.register("before-call.s3", lambda **_: None)
    client.put_object(Bucket=bucket, Key="in-place/object", Body=BODY)
    for count in (20, n):  # warm-up, then the measurement
        events.ns.clear()
        events.calls.clear()
        for i in range(count):
            client.put_object(Bucket=bucket, Key=f"in-place/{count}-{i}", Body=BODY)
            client.get_object(Bucket=bucket, Key="in-place/object", Range="bytes=0-3")["Body"].read()
            client.head_object(Bucket=bucket, Key="in-place/object")
    per_call = {e: events.ns[e] / events.calls[e] / 1e3 for e in events.ns}
    timer = per_call.pop("before-call.s3")
    out = {HOOK_NAMES[e]: us - timer for e, us in per_call.items()}
    endpoint.delete_prefix(bucket, "in-place/")
    return {**out, "total": sum(out.values()), "timer": timer, "requests": 3 * n}


class _Recorder:
    """Stands in for a client's event system: keeps what ``install_rate_control`` registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[..., Any]] = {}

    def register(self, event: str, handler: Callable[..., Any]) -> None:
        self.handlers[event] = handler

    register_first = register


def measure_no_io(iterations: int, repeats: int) -> dict[str, Any]:
    """The controller alone and the hooks alone, µs (process CPU) per request, no I/O."""
    import botocore.session
    from botocore.awsrequest import AWSResponse

    from dcp_s3.objstore.rate_hooks import install_rate_control
    from dcp_s3.objstore.rate_limits import rate_key
    from dcp_s3.objstore.throttle import RateController

    huge = 1e12  # requests per second: never waits for a token
    controller = RateController(write_rate=huge, read_rate=huge)
    key = rate_key("PutObject", "overhead-bench", "ckpt/__0_0.distcp")

    def controller_once(_: int) -> None:
        controller.acquire(key)
        controller.release(key, refused=False)

    events = _Recorder()
    fake = SimpleNamespace(meta=SimpleNamespace(endpoint_url="http://rate-hooks.invalid", events=events))
    install_rate_control(fake, retry_attempts=5, deadline=300.0, write_rate=huge, read_rate=huge)
    h = events.handlers
    tag, pace, decide, after = (
        h["before-parameter-build.s3"],
        h["request-created.s3"],
        h["needs-retry.s3"],
        h["after-call.s3"],
    )
    model = botocore.session.get_session().get_service_model("s3").operation_model("UploadPart")
    params = {"Bucket": "overhead-bench", "Key": "ckpt/__0_0.distcp", "PartNumber": 1, "UploadId": "u"}
    ok = AWSResponse("http://rate-hooks.invalid/overhead-bench/ckpt/__0_0.distcp", 200, {}, None)

    def hooks_once(_: int) -> None:
        context: dict[str, Any] = {}
        tag(params=params, model=model, context=context)
        pace(request=SimpleNamespace(context=context))
        decide(response=(ok, {}), attempts=1, caught_exception=None, request_dict={"context": context}, operation=model)
        after(context=context, http_response=ok, parsed={}, model=model)

    out: dict[str, Any] = {"iterations": iterations, "repeats": repeats}
    for name, fn in (("controller_us", controller_once), ("hooks_us", hooks_once)):
        _timed(fn, 1000)  # warm-up
        runs = [_timed(fn, iterations)[0] / iterations * 1e6 for _ in range(repeats)]
        out[name] = {**_spread(runs), "runs": runs}
    return out


# --------------------------------------------------------------------------------------------
# Part 2: whole saves, a fresh process each.
# --------------------------------------------------------------------------------------------
def measure_saves(endpoint: common.Endpoint, bucket: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    region = endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1")
    runs = []
    for rep, mode in _abba(args.reps):
        prefix = f"saves/{mode}/rep{rep}"
        target = {
            "bucket": bucket,
            "prefix": prefix,
            "endpoint_url": endpoint.endpoint_url,
            "region": region,
            "local_dir": "",
        }  # local_dir: only the local_fs contestant uses it
        before = endpoint.counters(bucket)
        res = common.run_child(
            {
                "contestant": f"dcp_s3:rate_control={int(MODES[mode])}",
                "op": "save",
                "workload": args.workload,
                "size_mib": args.size_mib,
                "target": target,
            },
            endpoint.env,
        )
        server = common.counter_delta(before, endpoint.counters(bucket))
        requests = int(sum(v for k, v in server.items() if k.isupper())) if server else None
        endpoint.delete_prefix(bucket, prefix)
        if not res.get("ok"):
            raise RuntimeError(f"save rep {rep} ({mode}) failed: {str(res.get('error'))[:1000]}")
        run = {
            "rep": rep,
            "mode": mode,
            "seconds": res["seconds"],
            "cpu_s": res["cpu_s"],
            "requests": requests,
            "server": server,
            "logical_bytes": res["logical_bytes"],
            "n_tensors": res["n_tensors"],
        }
        runs.append(run)
        print(
            f"  save rep {rep} {mode:>10}: {run['seconds']:6.2f} s wall, {run['cpu_s']:5.2f} s CPU, "
            f"{requests} requests",
            flush=True,
        )
    return runs


def summarize_saves(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {m: {r["rep"]: r for r in runs if r["mode"] == m} for m in MODES}
    out: dict[str, Any] = {
        m: {
            "reps": len(by[m]),
            "seconds": _spread([r["seconds"] for r in by[m].values()]),
            "cpu_s": _spread([r["cpu_s"] for r in by[m].values()]),
        }
        for m in MODES
    }
    for what in ("seconds", "cpu_s"):
        pairs = [by["controller"][i][what] / by["off"][i][what] for i in by["off"] if i in by["controller"]]
        out[f"{what}_ratio_of_medians"] = out["controller"][what]["median"] / out["off"][what]["median"]
        out[f"{what}_paired_ratio"] = _spread(pairs)
    requests = [r["requests"] for r in runs if r["requests"] is not None]
    out["requests"] = statistics.median(requests) if requests else None
    return out


def expected_overhead(
    req: dict[str, Any],
    calls: dict[str, dict[str, float]],
    in_place: dict[str, float],
    no_io: dict[str, Any],
    saves: dict[str, Any],
) -> dict[str, Any]:
    """Part 3: extra CPU per request x requests per save / the save's CPU (off mode's median), for each estimate of
    the extra CPU per request: measured (mean, and the top of its 95% interval), the extra function calls at the
    off client's CPU per call, the hooks timed in place, the hooks alone in a tight loop."""
    requests, cpu_s = saves["requests"], saves["off"]["cpu_s"]["median"]
    if requests is None:
        return {"requests": None}
    off_calls = statistics.fmean(calls["off"].values())
    extra_calls = statistics.fmean(calls["controller"].values()) - off_calls
    diff = req["all"]["diff_cpu_us"]
    per = {
        "measured": diff["mean"],
        "measured_ci95_high": diff["high"],
        "extra_calls": extra_calls * req["all"]["off"]["cpu_us_mean"] / off_calls,
        "hooks_in_place": in_place["total"],
        "hooks_alone": no_io["hooks_us"]["median"],
    }
    return {
        "requests": requests,
        "save_cpu_s": cpu_s,
        "extra_calls_per_request": extra_calls,
        **{f"{k}_us": v for k, v in per.items()},
        **{f"{k}_fraction": v * 1e-6 * requests / cpu_s for k, v in per.items()},
    }


# --------------------------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------------------------
def render(result: dict[str, Any]) -> str:
    req, no_io, saves, exp = result["requests"], result["no_io"], result["saves"], result["expected_overhead"]
    hp = result["hooks_in_place"]
    part1 = result["requests_raw"]
    calls = part1["calls_per_request"]

    def calls_of(mode: str, op: str) -> float:
        return statistics.fmean(calls[mode].values()) if op == "all" else float(calls[mode][op])

    def ci(s: dict[str, float]) -> str:
        return f"{s['mean']:+.1f} [{s['low']:+.1f}, {s['high']:+.1f}]"

    def cpu(s: dict[str, Any]) -> str:
        return f"{s['cpu_us_mean']:.0f} ({s['cpu_us_median']:.0f})"

    rows = [
        [
            op if op != "all" else "all three",
            str(part1["requests"] * (len(OPS) if op == "all" else 1)),
            cpu(s["controller"]),
            cpu(s["off"]),
            ci(s["diff_cpu_us"]),
            ci(s["control_diff_cpu_us"]),
            ci(s["diff_wall_us"]),
            f"{calls_of('controller', op):.0f} / {calls_of('off', op):.0f}",
        ]
        for op, s in req.items()
    ]
    t1 = common.markdown_table(
        [
            "request",
            "requests per client",
            "controller CPU µs",
            "off CPU µs",
            "controller − off, CPU µs",
            "control: off2 − off, CPU µs",
            "controller − off, wall µs",
            "function calls, controller / off",
        ],
        rows,
    )
    keys = part1["controller_keys"]
    paced = (
        f"The controller paced {int(sum(k['attempts'] for k in keys.values()))} attempts, "
        f"{int(sum(k['refusals'] for k in keys.values()))} refused, "
        f"{sum(k['wait_s'] for k in keys.values()) * 1e3:.1f} ms in `acquire` in all (its `wait_s`, which counts "
        f"the call's own time as well as any wait for a token)."
    )
    t2 = common.markdown_table(
        ["mode", "saves", "wall s", "CPU s"],
        [
            [m, str(saves[m]["reps"]), _range(saves[m]["seconds"], digits=2), _range(saves[m]["cpu_s"], digits=2)]
            for m in MODES
        ],
    )
    ratios = common.markdown_table(
        ["controller / off", "ratio of medians", "paired ratio, median (min–max)"],
        [
            [what, common.fmt(saves[f"{key}_ratio_of_medians"], 3), _range(saves[f"{key}_paired_ratio"], digits=3)]
            for what, key in (("wall", "seconds"), ("CPU", "cpu_s"))
        ],
    )
    pr = saves["cpu_s_paired_ratio"]
    resolved = (
        f"The paired CPU ratios span {pr['min']:.3f}–{pr['max']:.3f}, {(pr['max'] - pr['min']) * 100:.0f} "
        f"points: whole saves {'resolve' if pr['max'] - pr['min'] < 0.02 else 'cannot resolve'} a 2% "
        f"difference here; part 3 estimates it from part 1."
    )
    if exp.get("requests") is None:
        part3 = "requests per save unknown (the request counters are SeaweedFS'), so not computed."
    else:
        part3 = (
            f"{exp['requests']:g} requests per save (SeaweedFS' counters), save CPU {exp['save_cpu_s']:.2f} s "
            f"(off, median).\n\n"
            + common.markdown_table(
                ["extra CPU per request, from", "µs", "share of a save's CPU"],
                [
                    [
                        "measured: controller − off, mean",
                        f"{exp['measured_us']:+.1f}",
                        f"{exp['measured_fraction']:+.3%}",
                    ],
                    [
                        "measured: top of its 95% interval",
                        f"{exp['measured_ci95_high_us']:+.1f}",
                        f"{exp['measured_ci95_high_fraction']:+.3%}",
                    ],
                    [
                        f"{exp['extra_calls_per_request']:.0f} extra function calls x off's CPU per call",
                        f"{exp['extra_calls_us']:+.1f}",
                        f"{exp['extra_calls_fraction']:+.3%}",
                    ],
                    [
                        "the hooks timed in place",
                        f"{exp['hooks_in_place_us']:+.1f}",
                        f"{exp['hooks_in_place_fraction']:+.3%}",
                    ],
                    [
                        "the hooks alone (no I/O, tight loop)",
                        f"{exp['hooks_alone_us']:+.1f}",
                        f"{exp['hooks_alone_fraction']:+.4%}",
                    ],
                ],
            )
        )
    a = result["args"]
    return (
        f"Rate controller (`ClientConfig(rate_control=True)`) against `rate_control=False`, nothing throttled; "
        f"{result['server']} on loopback, {result['machine'].get('cpus')} cores shared with other work; "
        f"run took {result['seconds']:.0f} s.\n\n"
        f"**1. Per request**: three clients in one process take turns request by request (every order in turn); "
        f"off2 is a second `rate_control=False` client, the control, whose difference from off is noise alone. "
        f"CPU = `time.process_time` around each request: mean (median) µs per request; differences: mean of the "
        f"per-round differences [95% interval]; function calls: cProfile's count per request.\n\n{t1}\n\n"
        f"{paced}\n\nNo I/O, median (min–max) of {no_io['repeats']} x {no_io['iterations']:,}: controller alone "
        f"(`acquire` + `release`) {_range(no_io['controller_us'], digits=2)} µs per attempt; hooks alone (`tag`, "
        f"`pace`, `decide`, quota release) {_range(no_io['hooks_us'], digits=2)} µs per request. The same hooks "
        f"timed in place, inside a client sending {hp['requests']} requests (this thread's CPU around each call, "
        f"less the timer's own {hp['timer']:.1f} µs): "
        + ", ".join(f"`{k}` {hp[k]:.1f}" for k in HOOK_NAMES.values())
        + f" µs; {hp['total']:.1f} µs per request in all.\n\n"
        f"**2. A save** (`dcp.save`, {a['size_mib']} MiB {a['workload']} state, fresh process each, "
        f"{a['reps']} per mode ABBA; median (min–max)):\n\n{t2}\n\n{ratios}\n\n{resolved}\n\n"
        f"**3. Expected overhead** = extra CPU per request x requests per save / save CPU: {part3}\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests per operation and client (default 2000)")
    ap.add_argument("--iterations", type=int, default=100_000, help="no-I/O loop iterations (default 100,000)")
    ap.add_argument("--size-mib", type=int, default=512, help="save size (default 512)")
    ap.add_argument("--workload", choices=["transformer", "uniform"], default="transformer")
    ap.add_argument("--reps", type=int, default=6, help="saves per mode (default 6)")
    ap.add_argument("--server", choices=list(servers.KINDS), default="seaweedfs")
    ap.add_argument(
        "--endpoint-url", help="use this S3 endpoint (credentials from AWS_* env) instead of a local server"
    )
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "throttle_overhead.json")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    info = common.machine_info()
    t0 = time.monotonic()
    endpoint = common.open_endpoint(args.server, args.endpoint_url)
    try:
        bucket = endpoint.create_bucket(common.new_bucket_name("overhead"))
        print(f"1. per request: {args.requests} x {len(OPS)} operations per client", flush=True)
        raw = measure_requests(endpoint, bucket, args.requests)
        in_place = measure_hooks_in_place(endpoint, bucket, max(1, args.requests // 6))
        no_io = measure_no_io(args.iterations, 5)
        print(f"2. saves: {args.reps} per mode, {args.size_mib} MiB", flush=True)
        save_runs = measure_saves(endpoint, bucket, args)
    finally:
        endpoint.stop()
    req, saves = summarize_requests(raw.pop("samples")), summarize_saves(save_runs)
    result = {
        "benchmark": "throttle_overhead",
        "args": vars(args),
        "machine": info,
        "seconds": time.monotonic() - t0,
        "server": "external S3" if args.endpoint_url else args.server,
        "requests": req,
        "requests_raw": raw,
        "hooks_in_place": in_place,
        "no_io": no_io,
        "saves": saves,
        "save_runs": save_runs,
        "expected_overhead": expected_overhead(req, raw["calls_per_request"], in_place, no_io, saves),
    }
    text = render(result)
    print()
    print(text)
    common.write_json(args.out, result)
    args.out.with_suffix(".md").write_text(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
