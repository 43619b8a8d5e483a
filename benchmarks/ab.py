"""Before/after of a library change in one run: the same ``dcp_s3`` save and load children (``benchmarks.worker``,
as ``benchmarks.run`` runs them), alternating between another source tree (``--base``, e.g. a
``git worktree add /tmp/base <commit>``) and this one, on one server, so that background load spreads over
both. Prints and writes the medians of client CPU seconds per GiB and wall seconds per tree and op.

    python -m benchmarks.ab --base /tmp/base --size-mib 256 --reps 4 --warm
    python -m benchmarks.ab --base /tmp/base --contestants dcp_s3,dcp_s3_zstd --warm   # plain and compressed
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import common

OPS = ("save", "load")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other source tree (its dcp_s3 and benchmarks)")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--workload", default="transformer", choices=("transformer", "uniform"))
    parser.add_argument("--server", default="juicefs_shm")
    parser.add_argument(
        "--contestants",
        default="dcp_s3",
        help="comma-separated dcp_s3 contestants of benchmarks.contestants (dcp_s3, dcp_s3_zstd, dcp_s3:...), "
        "each run in every rep on both trees",
    )
    parser.add_argument("--warm", action="store_true", help="after a tiny save and load in the same process")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ab.json")
    args = parser.parse_args(argv)
    trees = {"before": args.base.resolve(), "after": common.REPO_ROOT}
    contestants = args.contestants.split(",")
    runs = [(tree, c) for tree in trees for c in contestants]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {f"{t} {c}": {op: [] for op in OPS} for t, c in runs}
    endpoint = common.open_endpoint(args.server, None)
    try:
        bucket = endpoint.create_bucket(common.new_bucket_name("ab"))
        for rep in range(args.reps):
            for tree, contestant in runs if rep % 2 == 0 else reversed(runs):
                root = trees[tree]
                prefix = f"ab/{tree}/{contestant}/rep{rep}"
                target = {
                    "bucket": bucket,
                    "prefix": prefix,
                    "endpoint_url": endpoint.endpoint_url,
                    "region": endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1"),
                    "local_dir": "/tmp",
                }
                common.REPO_ROOT = root  # run_child puts it first on the child's PYTHONPATH
                try:
                    for op in OPS:
                        res = common.run_child(
                            {
                                "contestant": contestant,
                                "op": op,
                                "workload": args.workload,
                                "size_mib": args.size_mib,
                                "target": target,
                                "warm": args.warm,
                            },
                            endpoint.env,
                        )
                        if not res.get("ok"):
                            raise RuntimeError(f"{tree} {contestant} {op}: {res.get('error')}")
                        results[f"{tree} {contestant}"][op].append(res)
                        print(
                            f"rep {rep} {tree:>6} {contestant} {op}: {res['seconds']:.2f} s, "
                            f"{res['cpu_s_per_gb'] * 1.073741824:.2f} CPU s/GiB",
                            flush=True,
                        )
                finally:
                    common.REPO_ROOT = trees["after"]
                    endpoint.delete_prefix(bucket, prefix)
    finally:
        endpoint.stop()
    summary = {
        tree: {
            op: {
                "cpu_s_per_gib": statistics.median(r["cpu_s_per_gb"] * 1.073741824 for r in done),
                "seconds": statistics.median(r["seconds"] for r in done),
            }
            for op, done in ops.items()
        }
        for tree, ops in results.items()
    }
    lines = ["| tree | contestant | save CPU s/GiB | save s | load CPU s/GiB | load s |", "|---|---|---|---|---|---|"]
    for (tree, contestant), ops in zip(runs, summary.values()):
        lines.append(
            f"| {tree} ({trees[tree].name}) | {contestant} | {ops['save']['cpu_s_per_gib']:.2f} "
            f"| {ops['save']['seconds']:.2f} "
            f"| {ops['load']['cpu_s_per_gib']:.2f} | {ops['load']['seconds']:.2f} |"
        )
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "summary": summary,
                "runs": results,
                "time": time.time(),
            },
            indent=1,
            default=str,
        )
    )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
