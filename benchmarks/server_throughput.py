"""Which real S3-compatible server on this machine is not the bottleneck: raw PUT/GET with one fixed client.

    python -m benchmarks.server_throughput                      # every candidate, 512 MiB each way, 2 reps
    python -m benchmarks.server_throughput --kinds seaweedfs_shm,juicefs_shm --size-mib 256

The candidates are ``benchmarks.servers.KINDS``. The yardstick is one fixed client for every server:
``obstore`` (Rust, outside the GIL, unsigned payloads), 8 concurrent PUTs then GETs of 16 MiB objects.
Reported per server: MiB/s each way, the client's and the server's CPU seconds (psutil, by PID, the
server's whole process tree) per GiB, and both CPU% (100% = one core).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.servers import BenchServer, ProcessCPU, start  # noqa: E402

OBJECT = 16 << 20
CONCURRENCY = 8


def _store(server: BenchServer, bucket: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=server.endpoint_url,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
        unsigned_payload=True,
    )


def raw_throughput(server: BenchServer, size_mib: int) -> dict[str, float]:
    """PUT then GET ``size_mib`` MiB as 16 MiB objects, 8 at a time, with obstore; MiB/s and CPU s/GiB each way."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import obstore
    from botocore.config import Config

    bucket = server.fixed_bucket or common.new_bucket_name("srv")
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(s3={"addressing_style": "path"}),
    )
    if server.fixed_bucket is None:
        client.create_bucket(Bucket=bucket)
    store = _store(server, bucket)
    data = os.urandom(OBJECT)
    n = max(1, (size_mib << 20) // OBJECT)
    keys = [f"raw/{time.time_ns()}/{i}" for i in range(n)]
    srv = ProcessCPU(server.pid)
    out: dict[str, float] = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for op in ("put", "get"):
            s0, c0, t0 = srv.seconds(), common.cpu_seconds(), time.perf_counter()
            if op == "put":
                list(pool.map(lambda k: obstore.put(store, k, data, use_multipart=False), keys))
            else:
                got = list(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys))
                assert all(g == OBJECT for g in got), got
            wall = time.perf_counter() - t0
            gib = n * OBJECT / (1 << 30)
            out[f"{op}_mib_s"] = n * OBJECT / (1 << 20) / wall
            out[f"{op}_client_cpu_s_per_gib"] = (common.cpu_seconds() - c0) / gib
            out[f"{op}_server_cpu_s_per_gib"] = (srv.seconds() - s0) / gib
            out[f"{op}_client_cpu_pct"] = 100 * (common.cpu_seconds() - c0) / wall
            out[f"{op}_server_cpu_pct"] = 100 * (srv.seconds() - s0) / wall
        list(pool.map(lambda k: client.delete_object(Bucket=bucket, Key=k), keys))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="seaweedfs,seaweedfs_shm,juicefs_shm")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "server_throughput.json")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    servers = {}
    try:
        for k in kinds:
            servers[k] = start(k)
        for rep in range(args.reps):  # interleaved, so background load hits every server alike
            for k in kinds:
                r = raw_throughput(servers[k], args.size_mib)
                results[k].append(r)
                print(
                    f"  rep {rep} {k:>14}: PUT {r['put_mib_s']:6.0f} MiB/s (client {r['put_client_cpu_pct']:.0f}% "
                    f"server {r['put_server_cpu_pct']:.0f}%)  GET {r['get_mib_s']:6.0f} MiB/s (client "
                    f"{r['get_client_cpu_pct']:.0f}% server {r['get_server_cpu_pct']:.0f}%)",
                    flush=True,
                )
    finally:
        for s in servers.values():
            s.stop()
    rows = []
    for k in kinds:
        med = {f: common.median([r[f] for r in results[k]]) for f in results[k][0]}
        rows.append(
            [
                k,
                common.fmt(med["put_mib_s"], 0),
                common.fmt(med["get_mib_s"], 0),
                common.fmt(med["put_server_cpu_s_per_gib"]),
                common.fmt(med["get_server_cpu_s_per_gib"]),
                common.fmt(med["put_client_cpu_s_per_gib"]),
                common.fmt(med["get_client_cpu_s_per_gib"]),
                f"{med['put_client_cpu_pct']:.0f}% / {med['put_server_cpu_pct']:.0f}%",
                f"{med['get_client_cpu_pct']:.0f}% / {med['get_server_cpu_pct']:.0f}%",
            ]
        )
    table = common.markdown_table(
        [
            "server",
            "PUT MiB/s",
            "GET MiB/s",
            "server CPU s/GiB PUT",
            "server CPU s/GiB GET",
            "client CPU s/GiB PUT",
            "client CPU s/GiB GET",
            "PUT CPU% client / server",
            "GET CPU% client / server",
        ],
        rows,
    )
    print()
    print(table)
    common.write_json(
        args.out,
        {
            "benchmark": "server_throughput",
            "size_mib": args.size_mib,
            "reps": args.reps,
            "machine": common.machine_info(),
            "runs": results,
            "tables_markdown": table,
        },
    )
    args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
