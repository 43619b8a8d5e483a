"""Many real ranks on one machine: ``.metadata`` once per load, replicated loads read once.

    python -m benchmarks.many_ranks                 # 16 gloo ranks (HSDP: 4-way shard x 4 replicas)
    python -m benchmarks.many_ranks --ranks 32 --replicas 8

The same jobs as ``tests/test_scale_sharing.py`` (which runs them on 8 and 4 ranks), on
more ranks: real processes (``torch.multiprocessing`` spawn, gloo on CPU), a local
SeaweedFS behind a counting proxy (``tests/counting_proxy.py``) that records every
request and response byte per object, small tensors (~0.3 MB a checkpoint). Each job
checks every loaded tensor bit for bit. Reported per phase: ``.metadata`` GETs, data
GETs and bytes read from S3 against the bytes stored.

* ``replicated``: an HSDP checkpoint (``--replicas`` x ``ranks/replicas``-way shard) loaded
  three ways: every rank for itself (before), with ``replica_group`` = the replicate
  group (after), and every rank loading the whole model with ``replica_group`` = WORLD.
* ``groups``: an FSDP checkpoint loaded on the whole job, on one half (a sub-group; the
  other half waits on its own group), on both halves at once, then the failure cases
  (wrong explicit group, missing checkpoint, replicas with different plans, an object
  that cannot be read): every rank must raise, none may hang.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the jobs and the counting proxy live with the tests

from benchmarks import common  # noqa: E402
from dcp_s3.local_server import LocalS3Server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a job counts as hung")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "many_ranks.json")
    args = ap.parse_args(argv)
    if args.ranks % args.replicas or args.ranks % 2:
        ap.error("--ranks must be even and a multiple of --replicas")

    import test_scale_sharing as jobs
    from counting_proxy import CountingProxy
    from dist_utils import run_ranks
    from fault_proxy import Rule

    record: dict[str, object] = {
        "benchmark": "many_ranks",
        "ranks": args.ranks,
        "replicas": args.replicas,
        "machine": common.machine_info(),
    }
    with LocalS3Server.start("seaweedfs") as server:
        bucket = server.create_bucket(f"many-{uuid.uuid4().hex[:12]}")
        with CountingProxy(server.endpoint_url, max_connections=8 * args.ranks, lifetime_s=2 * args.timeout) as proxy:
            env = {**server.env(), "AWS_ENDPOINT_URL": proxy.url}
            proxy.set_rules([Rule(ops={"GetObject", "GetObjectRange"}, key_contains="fsdp/bad/__3_", rate=1.0)])
            t0 = time.perf_counter()
            rep = run_ranks(
                jobs.replicated_job,
                args.ranks,
                env,
                f"s3://{bucket}/hsdp/step-1",
                proxy.url,
                args.replicas,
                timeout=args.timeout,
            )
            t_rep = time.perf_counter() - t0
            t0 = time.perf_counter()
            grp = run_ranks(
                jobs.groups_job, args.ranks, env, f"s3://{bucket}/fsdp/step-1", proxy.url, timeout=args.timeout
            )
            t_grp = time.perf_counter() - t0
        stored_h = jobs.stored_bytes(server, bucket, "hsdp/step-1/")
        stored_f = jobs.stored_bytes(server, bucket, "fsdp/step-1/")

    rows = []
    for name, counts, stored in (
        ("HSDP, every rank reads for itself (before)", rep[0]["plain"], stored_h),
        ("HSDP, replica_group = replicate group (after)", rep[0]["hsdp"], stored_h),
        ("whole model on every rank, replica_group = WORLD", rep[0]["whole"], stored_h),
        ("FSDP, whole job", grp[0]["world"], stored_f),
        ("FSDP ckpt, whole model on one half (sub-group)", grp[0]["one_subgroup"], stored_f),
        ("FSDP ckpt, whole model on both halves at once", grp[0]["two_subgroups"], stored_f),
    ):
        rows.append(
            [
                name,
                str(counts["metadata_gets"]),
                str(counts["data_gets"]),
                f"{counts['data_bytes'] / 1e6:.2f}",
                f"{stored / 1e6:.2f}",
                f"{counts['data_bytes'] / stored:.2f}x",
            ]
        )
    failures = {
        k: sorted({t for r in grp for t in r.get(k, ((), ""))[0]})
        for k in ("wrong_group", "missing", "mismatch", "unreadable")
    }
    table = common.markdown_table(
        ["load", ".metadata GETs", "data GETs", "MB read from S3", "MB stored", "read / stored"], rows
    )
    text = (
        f"{args.ranks} gloo ranks on one machine (HSDP: {args.replicas} replicas x "
        f"{args.ranks // args.replicas}-way shard), every loaded tensor checked bit for bit; "
        f"jobs took {t_rep:.0f} s and {t_grp:.0f} s.\n\n{table}\n\n"
        "Failures raised on the ranks (none hung): " + ", ".join(f"{k}: {v}" for k, v in failures.items())
    )
    print(text)
    record.update(
        replicated=rep[0],
        groups=grp[0],
        stored_hsdp=stored_h,
        stored_fsdp=stored_f,
        failures=failures,
        seconds={"replicated": t_rep, "groups": t_grp},
        tables_markdown=text,
    )
    common.write_json(args.out, record)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
