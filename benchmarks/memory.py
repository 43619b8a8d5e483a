"""Peak RSS growth of a 1 GiB DCP save and load: dcp_s3 vs the naive BytesIO backend.

    python -m benchmarks.memory                       # 1 GiB, 3 repetitions, SeaweedFS on loopback
    python -m benchmarks.memory --size-mib 256 --reps 1
    python -m benchmarks.memory --contestants dcp_s3,naive,dcp_s3_reads_naive

Each measurement runs in a fresh process (``benchmarks.worker``) that builds the
state dict (64 x 16 MiB tensors, fp32/bf16 alternating, by default), then saves or
loads it once with ``no_dist=True`` while a thread samples RSS every 5 ms;
``ru_maxrss`` cross-checks the peak. Growth = peak RSS during the call minus RSS
at its start, so the state dict itself (or the zero-filled load target) is not
counted. Prints a markdown table of medians and writes ``results/memory.json``.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402

TARGET_MIB = 256  # dcp_s3's goal for a 1 GiB save or load with default settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workload", choices=["uniform", "transformer"], default="uniform")
    ap.add_argument(
        "--contestants",
        default="dcp_s3,naive",
        help="comma-separated; dcp_s3 variants like dcp_s3:part_size_mib=8,max_concurrency=4; dcp_s3_reads_naive",
    )
    ap.add_argument("--server", choices=list(servers.KINDS), default="seaweedfs")
    ap.add_argument(
        "--endpoint-url", help="use this S3 endpoint (credentials from AWS_* env) instead of a local server"
    )
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "memory.json")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server and temporary data are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    names = [n.strip() for n in args.contestants.split(",") if n.strip()]
    workload = common.make_workload(args.workload, args.size_mib)
    print(f"workload: {workload.description}, {workload.nbytes / common.MiB:.0f} MiB", flush=True)
    endpoint = common.open_endpoint(args.server, args.endpoint_url)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"save": [], "load": []} for n in names}
    info = common.machine_info()
    info["awscrt"] = _awscrt_state()
    print(f"awscrt: {info['awscrt']}", flush=True)
    try:
        bucket = endpoint.create_bucket(common.new_bucket_name("mem"))
        for rep in range(args.reps):
            for name in names:  # interleaved, so background load hits every contestant alike
                local_dir = tempfile.mkdtemp(prefix="dcp-s3-bench-")
                prefix = f"memory/{name.replace(':', '_').replace(',', '_')}/rep{rep}"
                target = {
                    "bucket": bucket,
                    "prefix": prefix,
                    "endpoint_url": endpoint.endpoint_url,
                    "region": endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1"),
                    "local_dir": local_dir,
                }
                try:
                    for op in ("save", "load"):
                        before = endpoint.counters(bucket)
                        res = common.run_child(
                            {
                                "contestant": name,
                                "op": op,
                                "workload": args.workload,
                                "size_mib": args.size_mib,
                                "target": target,
                            },
                            endpoint.env,
                        )
                        res["server"] = common.counter_delta(before, endpoint.counters(bucket))
                        runs[name][op].append(res)
                        _progress(rep, name, op, res)
                        if not res.get("ok"):
                            break
                finally:
                    endpoint.delete_prefix(bucket, prefix)
                    shutil.rmtree(local_dir, ignore_errors=True)
    finally:
        endpoint.stop()

    rows, summary = [], {}
    for name in names:
        s = _summarize(runs[name])
        summary[name] = s
        rows.append(
            [
                name,
                common.fmt(s["save"]["growth_mib"], 0),
                common.fmt(s["load"]["growth_mib"], 0),
                common.fmt(s["save"]["seconds"]),
                common.fmt(s["load"]["seconds"]),
                _range(s["save"]["growth_all"]),
                _range(s["load"]["growth_all"]),
            ]
        )
    table = common.markdown_table(
        [
            "contestant",
            "save peak RSS growth MiB",
            "load peak RSS growth MiB",
            "save s",
            "load s",
            "save growth, all reps",
            "load growth, all reps",
        ],
        rows,
    )
    print()
    print(
        f"Peak RSS growth, {workload.nbytes / common.MiB:.0f} MiB {workload.name} state dict, "
        f"median of {args.reps} (fresh process each; target for dcp_s3 < {TARGET_MIB} MiB)"
    )
    print()
    print(table)
    for name in names:
        if name == "dcp_s3":
            worst = max((summary[name][op]["growth_mib"] or 0) for op in ("save", "load"))
            verdict = "meets" if worst < TARGET_MIB else "MISSES"
            print(f"\ndcp_s3 {verdict} the {TARGET_MIB} MiB target (worst median growth {worst:.0f} MiB).")
    common.write_json(
        args.out,
        {
            "benchmark": "memory",
            "workload": workload.description,
            "size_mib": args.size_mib,
            "reps": args.reps,
            "server": "external" if args.endpoint_url else args.server,
            "target_mib": TARGET_MIB,
            "machine": info,
            "summary": summary,
            "runs": runs,
            "table_markdown": table,
        },
    )
    header = (
        f"Peak RSS growth, {workload.nbytes / common.MiB:.0f} MiB {workload.name} state dict, median of "
        f"{args.reps} (fresh process each; awscrt: {info['awscrt']})"
    )
    args.out.with_suffix(".md").write_text(header + "\n\n" + table + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def _awscrt_state() -> str:
    """Whether botocore in the workers signs and checksums with awscrt (it does whenever awscrt is importable)."""
    import importlib.metadata
    import importlib.util
    import os

    if importlib.util.find_spec("awscrt") is None:
        return "not installed"
    version = importlib.metadata.version("awscrt")
    if os.environ.get("BOTO_DISABLE_CRT", "false").lower() == "true":
        return f"{version}, disabled by BOTO_DISABLE_CRT"
    return f"{version}, used by botocore"


def _progress(rep: int, name: str, op: str, res: dict[str, Any]) -> None:
    if res.get("ok"):
        print(
            f"  rep {rep} {name:>16} {op}: {res['seconds']:.2f} s, +{res['peak_rss_growth_mib']:.0f} MiB RSS, "
            f"{res['cpu_s']:.2f} CPU s{'' if res.get('verified') in (None, True) else ' VERIFY FAILED'}",
            flush=True,
        )
    else:
        print(f"  rep {rep} {name:>16} {op}: FAILED {res.get('error', '')[:300]}", flush=True)


def _summarize(per_op: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op, results in per_op.items():
        ok = [r for r in results if r.get("ok")]
        out[op] = {
            "growth_mib": common.median([r["peak_rss_growth_mib"] for r in ok]),
            "growth_all": [round(r["peak_rss_growth_mib"], 1) for r in ok],
            "seconds": common.median([r["seconds"] for r in ok]),
            "cpu_s": common.median([r["cpu_s"] for r in ok]),
            "verified": all(r.get("verified") in (None, True) for r in ok),
            "failures": [r.get("error") for r in results if not r.get("ok")],
        }
    return out


def _range(vals: list[float]) -> str:
    return "—" if not vals else f"{min(vals):.0f}–{max(vals):.0f}"


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(rc)
