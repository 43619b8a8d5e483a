"""Saves and loads against a prefix that throttles: botocore's ``standard`` and ``adaptive`` retries against dcp_s3's
rate controller (issue 27), through the loopback throttling proxy of the tests (``tests/throttle_proxy.py``), which
enforces per-prefix request rates like S3's (scaled down) and answers ``503 SlowDown``.

    python -m benchmarks.throttle                  # 8 ranks, every scenario, 3 modes (10 min on 2 cores)
    python -m benchmarks.throttle --scenarios hot --overloads 20 --ranks 4

The savers are the ranks of one gloo job (each rank its own process and client), all calling ``dcp.save`` of one
checkpoint together, so each rank starts at its plan-time share of the per-prefix budget (``prefix_write_rate``,
standing for S3's published figure; here the proxy's enforced rate: "budget known", or a multiple of it: "budget
too high", as for a new S3 prefix that starts below the published figure). Each rank writes ``--objects`` data
objects (rank 0 also ``.metadata``). Overload = the writes' offered rate (all writes in ``--burst-s`` seconds) over
the enforced rate; the ideal makespan is (accepted writes - the proxy's bucket depth) / enforced rate (the depth:
max(0.2 s of requests, the ranks sending to the prefix)). Every job-mode row runs on one
gloo job, one after the other (each row its own proxy and top-level prefix), modes interleaved per scenario. Scenarios: ``none`` (no throttling: the
controller's overhead against botocore alone), ``hot`` (one prefix at each overload), ``unknown`` (the controller
told ``--budget-multiples`` x the enforced rate), ``prefixes`` (``key_prefixes=4``, one of them hot),
``drop`` (the capacity halves mid-save), ``uneven`` (rank 0 has 4x the objects of the others: the
ranks still sending must take up what the finished ones leave), ``load`` (every rank loads its shards with throttled ranged GETs),
``independent`` (separate processes, each its own no_dist save and told the whole budget, at each of ``--overloads``;
``--baseline-ref REF`` runs the same savers on the code at git ``REF`` too, interleaved, for before and after in one
run; ``--calibrate F`` first measures the writes/s the savers sustain unthrottled on this machine now and enforces F x
that, each saver getting the objects its overload needs, so that the proxy, not a loaded machine, limits them),
``independent-load`` (the same savers' checkpoints, saved unthrottled first, loaded by as many independent processes
with throttled GETs; not in the default list).
Reported: failed saves, makespan / ideal, attempts per accepted request, refused fraction (all, and in steady
state: the second half of the makespan), goodput (accepted requests per second over the enforced rate), p99
request latency (retries included), spread of finish times, and in the JSON the refused fraction per 5 s from the
first request (``refused_by_5s``: when a ramp or a capacity drop has passed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

MODES = {  # ClientConfig settings of each contestant
    "standard": {"rate_control": False, "retry_mode": "standard"},
    "adaptive": {"rate_control": False, "retry_mode": "adaptive"},
    "controller": {"rate_control": True},
}
WRITES = ("PutObject", "UploadPart", "CompleteMultipartUpload", "CreateMultipartUpload")


def _timed_client(writer_or_reader: Any, ops: tuple[str, ...]) -> list[float]:
    """Latencies (retries included) of ``ops`` made by the writer's or reader's (shared, cached) client."""
    latencies: list[float] = []

    def start(context: dict[str, Any], model: Any, **_: Any) -> None:
        context["bench_t0"], context["bench_op"] = time.monotonic(), model.name

    def end(context: dict[str, Any], **_: Any) -> None:  # (after-call-error passes no model)
        if context.get("bench_op") in ops:
            latencies.append(time.monotonic() - context.get("bench_t0", time.monotonic()))

    events = writer_or_reader._session.client_config.client().meta.events
    events.register("before-call.s3", start)
    events.register("after-call.s3", end)
    events.register("after-call-error.s3", end)
    return latencies


def _state(rank: int, objects: int) -> dict[str, Any]:
    import torch

    return {f"r{rank}.t{i}": torch.full((256,), float(rank * 1000 + i)) for i in range(objects)}


def job_rank(rank: int, world: int, env: dict[str, str], specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One rank of the job: for each spec in turn, save (or load) one checkpoint with every other rank. Each spec
    has its own proxy (endpoint), so its own controller; its checkpoint has its own top-level prefix, so nothing
    learnt in one carries to the next."""
    os.environ.update(env)
    return [_one(rank, spec) for spec in specs]


def _one(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_s3 import ClientConfig, S3StorageReader, S3StorageWriter

    client = ClientConfig(
        **MODES[spec["mode"]],
        endpoint_url=spec["endpoint"],
        prefix_write_rate=spec["write_budget"],
        prefix_read_rate=spec["read_budget"],
    )
    objects = spec["objects"] * (spec["rank0_factor"] if rank == 0 else 1)
    state = _state(rank, objects)
    if spec["load"]:
        io: Any = S3StorageReader(spec["uri"], client=client)
        latencies = _timed_client(io, ("GetObject", "HeadObject"))
    else:
        io = S3StorageWriter(spec["uri"], client=client, files_per_rank=objects, key_prefixes=spec["key_prefixes"])
        latencies = _timed_client(io, WRITES)
    dist.barrier()
    t0 = time.monotonic()
    try:
        if spec["load"]:
            dcp.load(state, storage_reader=io)
        else:
            dcp.save(state, storage_writer=io)
        error = None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"error": error, "t0": t0, "t1": time.monotonic(), "latencies": latencies}


def child(args: argparse.Namespace) -> None:
    """One independent saver (the contrast mode), or loader with ``--load``: prints one JSON line."""
    import torch.distributed.checkpoint as dcp

    from dcp_s3 import ClientConfig, S3StorageReader, S3StorageWriter

    rate = {"prefix_read_rate": args.rate} if args.load else {"prefix_write_rate": args.rate}
    client = ClientConfig(**MODES[args.mode], endpoint_url=args.endpoint, **rate)
    io: Any
    if args.load:
        io = S3StorageReader(args.uri, client=client)
        latencies = _timed_client(io, ("GetObject", "HeadObject"))
    else:
        io = S3StorageWriter(args.uri, client=client, files_per_rank=args.objects)
        latencies = _timed_client(io, WRITES)
    time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.monotonic()
    try:
        if args.load:
            dcp.load(_state(0, args.objects), storage_reader=io, no_dist=True)
        else:
            dcp.save(_state(0, args.objects), storage_writer=io, no_dist=True)
        error = None
    except BaseException as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {str(exc)[:300]} ... {str(exc)[-600:]}"
    print(
        "RESULT " + json.dumps({"error": error, "t0": t0, "t1": time.monotonic(), "latencies": latencies}), flush=True
    )


def run_independent(
    proxy: Any,
    bucket: str,
    env: dict[str, str],
    mode: str,
    args: argparse.Namespace,
    budget: float,
    run: str,
    src: Path = common.REPO_ROOT,
    load: bool = False,
) -> list[dict[str, Any]]:
    start_at = time.time() + 8 + 2 * args.ranks  # every saver has imported torch by then
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.throttle",
                "--child",
                "--mode",
                mode,
                "--endpoint",
                proxy.url,
                "--uri",
                f"s3://{bucket}/{run}/saver-{i}",
                "--rate",
                str(budget),
                "--objects",
                str(args.objects),
                "--start-at",
                str(start_at),
                *(["--load"] if load else []),
            ],
            env={**env, "PYTHONPATH": str(src)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=src,
        )
        for i in range(args.ranks)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"saver died: {err[-2000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def summarize(
    results: list[dict[str, Any]],
    events: list[tuple[float, str, bool, str]],
    kind: str,
    rate: float | None,
    drop: tuple[float, float] | None,
    prefix: str | None = None,
    burst: float = 0.0,
) -> dict[str, Any]:
    t0, t1 = min(r["t0"] for r in results), max(r["t1"] for r in results)
    makespan = t1 - t0
    mine = [(t, ok) for t, k, ok, p in events if k == kind and (prefix is None or p == prefix)]
    accepted = sum(ok for _, ok in mine)
    refused = len(mine) - accepted
    half = [ok for t, ok in mine if t >= t0 + makespan / 2]
    latencies = sorted(x for r in results for x in r["latencies"])
    row: dict[str, Any] = {
        "failed": sum(r["error"] is not None for r in results),
        "ranks": len(results),
        "makespan_s": makespan,
        "accepted": accepted,
        "refused": refused,
        "refused_fraction": refused / max(1, len(mine)),
        "steady_refused_fraction": (len(half) - sum(half)) / max(1, len(half)),
        "attempts_per_success": len(mine) / max(1, accepted),
        "p99_latency_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "finish_spread_s": t1 - min(r["t1"] for r in results),
        "errors": sorted({r["error"] for r in results if r["error"]}),
        # Refused fraction per 5 s from the first request: when a transient (the ramp, a capacity drop) has passed.
        "refused_by_5s": _by_window(mine, 5.0),
    }
    if rate is not None:
        # The proxy's bucket starts full: that many requests need no time (subtracting them makes the ideal
        # shorter, the ratio harder).
        paced = max(1.0, accepted - burst)
        ideal = paced / rate
        if drop is not None:  # rate until drop_at, then drop_factor x rate
            at, factor = drop
            ideal = ideal if ideal <= at else at + (paced - at * rate) / (rate * factor)
        row["ideal_s"] = ideal
        row["makespan_over_ideal"] = makespan / ideal
        row["goodput"] = ideal / makespan  # accepted / makespan over the enforced (mean) rate
        # The same over the time requests were sent (first request to last accepted one): without DCP's planning
        # before and its gather and commit after, which no pacing can shorten.
        sent = [t for t, ok in mine if ok]
        if sent:
            row["goodput_sending"] = ideal / max(1e-9, max(sent) - min(t for t, _ in mine))
    return row


def _by_window(answers: list[tuple[float, bool]], width: float) -> list[float | None]:
    if not answers:
        return []
    first = min(t for t, _ in answers)
    windows: list[list[bool]] = [[] for _ in range(int((max(t for t, _ in answers) - first) // width) + 1)]
    for t, ok in answers:
        windows[int((t - first) // width)].append(ok)
    return [round(1 - sum(w) / len(w), 3) if w else None for w in windows]


def prepare(
    server: Any,
    bucket: str,
    args: argparse.Namespace,
    *,
    scenario: str,
    mode: str,
    overload: float,
    budget_multiple: float = 1.0,
) -> dict[str, Any]:
    """One row's proxy settings and the spec its ranks run."""
    rank0_factor = 4 if scenario == "uneven" else 1
    writes = (args.ranks - 1 + rank0_factor) * args.objects + 1
    offered = writes / args.burst_s
    rate = offered / overload if overload else None
    enforced = rate if rate is not None else 1e6
    run = f"{scenario}-{mode}-{overload:g}-{budget_multiple:g}-{int(time.time() * 1000)}"
    load = scenario in ("load", "independent-load")
    key_prefixes = 4 if scenario == "prefixes" else 1
    drop = (args.drop_at, 0.5) if scenario == "drop" else None
    senders = -(-args.ranks // key_prefixes)  # ranks writing to one prefix (rank r: p-(r % key_prefixes))
    proxy_kw: dict[str, Any] = {"write_rate": enforced, "read_rate": 1e6, "prefix_depth": 1, "min_burst": senders}
    if scenario == "prefixes":  # p-0/ is hot, the other prefixes are not throttled
        rate = enforced = offered / key_prefixes / overload
        proxy_kw.update(write_rate=1e6, prefix_depth=3, prefix_write_rates={f"{run}/ckpt/p-0": enforced})
    if load:
        proxy_kw.update(write_rate=1e6, read_rate=enforced)
    if drop is not None:
        proxy_kw.update(drop_at_s=drop[0], drop_factor=drop[1])
    # "budget known": the per-prefix budget setting is the enforced rate; with no throttling, S3's default.
    budget = enforced * budget_multiple if rate is not None else 3500.0
    spec = {
        "mode": mode,
        "endpoint": "",
        "uri": f"s3://{bucket}/{run}/ckpt",
        "objects": args.objects,
        "key_prefixes": key_prefixes,
        "load": load,
        "rank0_factor": rank0_factor,
        "write_budget": 3500.0 if load else budget,
        "read_budget": budget if load else 5500.0,
    }
    row = {
        "scenario": scenario,
        "mode": mode,
        "overload": overload,
        "budget_multiple": budget_multiple,
        "enforced_rate": rate,
    }
    return {
        "row": row,
        "proxy_kw": proxy_kw,
        "spec": spec,
        "drop": drop,
        "run": run,
        "budget": budget,
        "burst": max(senders, enforced * 0.2),
        "hot": f"{run}/ckpt/p-0" if scenario == "prefixes" else None,
    }


def measure_job(
    server: Any, bucket: str, args: argparse.Namespace, items: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every item on one gloo job of ``args.ranks`` ranks (each with its own proxy), one after the other."""
    from dist_utils import run_ranks
    from throttle_proxy import ThrottleProxy

    env = {**os.environ, **server.env(), "PYTHONPATH": str(common.REPO_ROOT)}
    preps = [prepare(server, bucket, args, **item) for item in items]
    with contextlib.ExitStack() as stack:
        specs = []
        for prep in preps:
            proxy = prep["proxy"] = stack.enter_context(ThrottleProxy(server.endpoint_url, **prep["proxy_kw"]))
            if prep["spec"]["load"]:  # the checkpoint to load, saved unthrottled just before
                plain = stack.enter_context(ThrottleProxy(server.endpoint_url, write_rate=1e6, read_rate=1e6))
                specs.append({**prep["spec"], "endpoint": plain.url, "load": False, "mode": "standard"})
            specs.append({**prep["spec"], "endpoint": proxy.url})
        per_rank = run_ranks(job_rank, args.ranks, env, specs, timeout=3600)
        rows, at = [], 0
        for prep in preps:
            at += prep["spec"]["load"]  # skip the unthrottled save before a load
            results = [r[at] for r in per_rank]
            at += 1
            row = summarize(
                results,
                list(prep["proxy"].events),
                "read" if prep["spec"]["load"] else "write",
                prep["row"]["enforced_rate"],
                prep["drop"],
                prep["hot"],
                prep["burst"],
            )
            rows.append({**row, **prep["row"]})
    return rows


def measure_independent(server: Any, bucket: str, args: argparse.Namespace, item: dict[str, Any]) -> dict[str, Any]:
    """Separate processes, each its own no_dist save, each told the whole budget (issue 39). ``item["src"]``: the
    source tree the savers import (``--baseline-ref``'s extracted copy for the "before" rows)."""
    from throttle_proxy import ThrottleProxy

    item = dict(item)
    src, label = item.pop("src", common.REPO_ROOT), item.pop("label", None)
    args = argparse.Namespace(**{**vars(args), "objects": item.pop("objects", args.objects)})
    env = {**os.environ, **server.env()}
    prep = prepare(server, bucket, args, **item)
    load = prep["spec"]["load"]
    if load:  # the checkpoints to load, saved just before straight to the server (the proxy drops connections then)
        direct = argparse.Namespace(url=server.endpoint_url)
        saved = run_independent(direct, bucket, env, "controller", args, 3500.0, prep["run"], Path(src))
        if any(r["error"] for r in saved):
            raise RuntimeError(f"the unthrottled save before the load failed: {[r['error'] for r in saved]}")
    with ThrottleProxy(server.endpoint_url, **prep["proxy_kw"]) as proxy:
        results = run_independent(
            proxy, bucket, env, item["mode"], args, prep["budget"], prep["run"], Path(src), load=load
        )
        events = list(proxy.events)
    kind = "read" if load else "write"
    row = {
        **summarize(results, events, kind, prep["row"]["enforced_rate"], None, None, prep["burst"]),
        **prep["row"],
        "objects": args.objects,
    }
    return {**row, "mode": f"{row['mode']} ({label})"} if label else row


def calibrate(server: Any, bucket: str, args: argparse.Namespace) -> float:
    """Writes per second that the savers, the proxy and the server sustain together on this machine now, with
    nothing throttled (one independent round of ``args.ranks`` savers x ``args.objects``): the enforced rate of a
    calibrated run is a fraction of it, so that the proxy's refusals, not the machine, limit the savers."""
    from throttle_proxy import ThrottleProxy

    env = {**os.environ, **server.env()}
    run = f"calibrate-{int(time.time() * 1000)}"
    with ThrottleProxy(server.endpoint_url, write_rate=1e6, read_rate=1e6) as proxy:
        run_independent(proxy, bucket, env, "controller", args, 3500.0, run)
        sent = [t for t, kind, ok, _ in proxy.events if kind == "write" and ok]
    return len(sent) / max(1e-9, max(sent) - min(sent))


def baseline_tree(ref: str) -> Path:
    """The repository's ``dcp_s3``, ``benchmarks`` and ``tests`` at git ``ref``, extracted to a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="throttle-baseline-"))
    archive = subprocess.run(
        ["git", "archive", ref, "dcp_s3", "benchmarks", "tests"], cwd=common.REPO_ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = {
        m: statistics.median(r["makespan_s"] for r in rows if r["scenario"] == "none" and r["mode"] == m)
        for m in {r["mode"] for r in rows if r["scenario"] == "none"}
    }
    fixed = base.get("controller", 0.0)  # what a save takes with nothing throttled: DCP's own steps, not pacing

    def net(r: dict[str, Any]) -> str:
        return common.fmt((r["makespan_s"] - fixed) / r["ideal_s"]) if r["overload"] and not r["failed"] else "—"

    table = [
        [
            r["scenario"],
            f"{r['overload']:g}x" if r["overload"] else "none",
            f"{r['budget_multiple']:g}x" if r["overload"] else "S3 default",
            r["mode"],
            f"{r['failed']}/{r['ranks']}",
            common.fmt(r.get("makespan_over_ideal")) if r["overload"] else common.fmt(r["makespan_s"]) + " s",
            net(r),
            common.fmt(r["attempts_per_success"]),
            common.fmt(r["refused_fraction"]),
            common.fmt(r["steady_refused_fraction"]),
            common.fmt(r.get("goodput")),
            common.fmt(r.get("goodput_sending")),
            common.fmt(r["p99_latency_s"]),
            common.fmt(r["finish_spread_s"]),
        ]
        for r in rows
    ]
    md = common.markdown_table(
        [
            "scenario",
            "overload",
            "budget / capacity",
            "mode",
            "ranks failed",
            "makespan / ideal",
            "(makespan - unthrottled) / ideal",
            "attempts per success",
            "refused",
            "refused, 2nd half",
            "goodput",
            "goodput while sending",
            "p99 latency s",
            "finish spread s",
        ],
        table,
    )
    overhead = (
        f"No throttling: controller makespan {base['controller']:.2f} s against {base['standard']:.2f} s for "
        f"botocore alone, medians of 3 interleaved runs ({base['controller'] / base['standard'] - 1:+.1%}).\n"
        if {"controller", "standard"} <= set(base)
        else ""
    )
    return (
        f"{args.ranks} ranks of one gloo job x {args.objects} objects (+ .metadata), offered = all writes in "
        f"{args.burst_s:g} s, enforced rate = offered / overload, proxy bucket depth max(0.2 s, the ranks "
        f'sending to the prefix: {args.ranks}, or {-(-args.ranks // 4)} with 4 prefixes), ideal = (accepted - bucket depth) / enforced rate; "unthrottled" = the controller\'s median '
        f'save with nothing throttled ({fixed:.2f} s: DCP\'s planning and finish steps). "ranks failed": ranks whose '
        f"dcp.save/load raised (for those rows makespan is the time to fail). p99 latency: a request's, from the "
        f"call to its answer, retries and (controller) the wait for a token included. SeaweedFS behind "
        f"tests/throttle_proxy.py\n\n{md}\n\n{overhead}"
    )


def main() -> None:
    if sys.argv[1:2] == ["--sim"]:  # the simulation of jobs sharing a prefix: benchmarks.throttle_sim's options follow
        from benchmarks import throttle_sim

        del sys.argv[1]
        throttle_sim.main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="first argument: run benchmarks.throttle_sim with the rest")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="controller")
    ap.add_argument("--endpoint")
    ap.add_argument("--uri")
    ap.add_argument("--rate", type=float, default=3500.0)
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--overloads", default="5,20,50")
    ap.add_argument("--budget-multiples", default="4,20")
    ap.add_argument("--burst-s", type=float, default=1.0, help="offered load: every write in this many seconds")
    ap.add_argument("--drop-at", type=float, default=8.0, help="drop scenario: capacity halves after this many s")
    ap.add_argument("--scenarios", default="none,hot,unknown,prefixes,drop,uneven,load,independent")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(common.RESULTS_DIR / "throttle.json"))
    ap.add_argument("--render", action="store_true", help="only rewrite the .md of --out from its .json")
    ap.add_argument(
        "--baseline-ref",
        default=None,
        help="independent scenario: also run the savers on the code at this git ref, interleaved",
    )
    ap.add_argument("--repeats", type=int, default=1, help="independent scenario: runs of each controller")
    ap.add_argument(
        "--calibrate",
        type=float,
        default=None,
        help="independent scenario: enforce this fraction of the writes/s measured unthrottled first (the "
        "objects per saver follow from each overload)",
    )
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.out).read_text())
        Path(args.out).with_suffix(".md").write_text(render(saved["rows"], argparse.Namespace(**saved["args"])))
        return
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(common.REPO_ROOT / "tests"))  # the tests' throttling proxy and gloo launcher
    from dcp_s3._local_server import LocalS3Server

    scenarios, modes = args.scenarios.split(","), args.modes.split(",")
    overloads = [float(x) for x in args.overloads.split(",")]
    plan: list[dict[str, Any]] = []
    if "none" in scenarios:  # three of each, interleaved; the table gives each one, the overhead the medians
        plan += [{"scenario": "none", "mode": m, "overload": 0.0} for _ in range(3) for m in ("standard", "controller")]
    for overload in overloads if "hot" in scenarios else []:
        plan += [{"scenario": "hot", "mode": m, "overload": overload} for m in modes]
    for multiple in [float(x) for x in args.budget_multiples.split(",")] if "unknown" in scenarios else []:
        plan += [{"scenario": "unknown", "mode": "controller", "overload": 20.0, "budget_multiple": multiple}]
    for scenario in ("prefixes", "drop", "uneven", "load"):
        if scenario in scenarios:
            plan += [{"scenario": scenario, "mode": m, "overload": 20.0} for m in modes]
    independent = [s for s in ("independent", "independent-load") if s in scenarios]
    for scenario, overload in [(s, o) for o in overloads for s in independent]:
        item = {"scenario": scenario, "mode": "controller", "overload": overload}
        for _ in range(args.repeats):
            if args.baseline_ref:
                plan += [{**item, "src": baseline_tree(args.baseline_ref), "label": args.baseline_ref}]
            plan += [{**item, "label": "this tree"} if args.baseline_ref else item]
    t0 = time.monotonic()
    out = Path(args.out)
    with LocalS3Server.start("seaweedfs") as server:
        bucket = server.create_bucket(common.new_bucket_name("throttle"))
        rows = measure_job(server, bucket, args, [i for i in plan if not i["scenario"].startswith("independent")])
        if args.calibrate and any(i["scenario"].startswith("independent") for i in plan):
            # Each independent row's enforced rate = calibrate x what the machine sustains now; its savers get the
            # objects that make all their writes in --burst-s seconds that many times the enforced rate.
            sustained = calibrate(server, bucket, args)
            target = args.calibrate * sustained
            print(f"calibrated: {sustained:.0f} writes/s unthrottled, enforcing about {target:.0f}", flush=True)
            for i in plan:
                if i["scenario"].startswith("independent"):
                    i["objects"] = max(2, round(i["overload"] * target * args.burst_s / args.ranks) - 1)
        try:
            rows += [
                measure_independent(server, bucket, args, i) for i in plan if i["scenario"].startswith("independent")
            ]
        finally:  # the extracted --baseline-ref trees
            for src in {i["src"] for i in plan if "src" in i}:
                shutil.rmtree(src, ignore_errors=True)
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "errors"}), flush=True)
    common.write_json(
        out,
        {
            "benchmark": "throttle",
            "rows": rows,
            "machine": common.machine_info(),
            "seconds": time.monotonic() - t0,
            "args": vars(args),
        },
    )
    text = render(rows, args)
    print(text)
    out.with_suffix(".md").write_text(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
