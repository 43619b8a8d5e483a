"""The same warm load against each benchmark server, in one process: where a load's client CPU differs by server.

    python -m benchmarks.load_by_server                # ~2 min: juicefs_shm and seaweedfs_shm, 512 MiB, 5 reps

Issue 39: a warm dcp_s3 load of the same state cost the client more against the JuiceFS gateway than against
SeaweedFS in ``benchmarks.run``. Here one process saves the transformer state to both servers, loads it once from
each, then loads it ``--reps`` times from each in turn (the servers alternating, so background load spreads over
both) into the same zero-filled destination, and reads ``getrusage`` of the whole process around each load: user
and system CPU, minor page faults and voluntary / involuntary context switches per GiB, wall seconds per GiB, and
the server's CPU (psutil, its process tree) per GiB; medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402

FIELDS = ("user", "system", "minor faults", "voluntary switches", "involuntary switches", "wall s", "server CPU s")


def _server_cpu(proc: Any) -> float:
    procs = [proc, *proc.children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--servers", default="juicefs_shm,seaweedfs_shm")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "load_by_server.json")
    args = ap.parse_args(argv)

    import boto3
    import psutil
    import torch.distributed.checkpoint as dcp

    from dcp_s3 import S3StorageReader, S3StorageWriter

    kinds = args.servers.split(",")
    started = {}
    try:
        for kind in kinds:
            started[kind] = servers.start(kind)
        workload = common.make_workload("transformer", args.size_mib)
        state = common.build_state_dict(workload, fill="random")
        into = common.build_state_dict(workload, fill="zeros")
        gib = sum(t.nbytes for t in workload.tensors) / 2**30
        places: dict[str, tuple[str, dict[str, str], Any]] = {}
        for kind, server in started.items():
            os.environ.update(server.env())  # dcp_s3 keys its clients by the AWS_* environment
            bucket = server.fixed_bucket or "bench"
            if server.fixed_bucket is None:
                boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=bucket)
            url = f"s3://{bucket}/ck"
            dcp.save(state, storage_writer=S3StorageWriter(url), no_dist=True)
            dcp.load(into, storage_reader=S3StorageReader(url), no_dist=True)  # warm: pools grown, connections open
            places[kind] = (url, server.env(), psutil.Process(server.pid))
        runs: dict[str, list[list[float]]] = {kind: [] for kind in kinds}
        for _ in range(args.reps):
            for kind, (url, env, proc) in places.items():
                os.environ.update(env)
                gc.collect()
                gc.disable()
                r0, s0, t0 = resource.getrusage(resource.RUSAGE_SELF), _server_cpu(proc), time.perf_counter()
                dcp.load(into, storage_reader=S3StorageReader(url), no_dist=True)
                t1, s1, r1 = time.perf_counter(), _server_cpu(proc), resource.getrusage(resource.RUSAGE_SELF)
                gc.enable()
                deltas = (
                    r1.ru_utime - r0.ru_utime,
                    r1.ru_stime - r0.ru_stime,
                    r1.ru_minflt - r0.ru_minflt,
                    r1.ru_nvcsw - r0.ru_nvcsw,
                    r1.ru_nivcsw - r0.ru_nivcsw,
                    t1 - t0,
                    s1 - s0,
                )
                runs[kind].append([d / gib for d in deltas])
        if not common.verify_state_dict(workload, into):
            raise SystemExit("the loaded state differs from the saved one")
    finally:
        for server in started.values():
            server.stop()

    rows = []
    for kind, xs in runs.items():
        med = [statistics.median(x[i] for x in xs) for i in range(len(FIELDS))]
        cells = [common.fmt(v, 0 if "switches" in f or "faults" in f else 3) for f, v in zip(FIELDS, med)]
        each = ", ".join(f"{x[0] + x[1]:.2f}" for x in xs)
        rows.append([kind, common.fmt(med[0] + med[1], 3), *cells, each])
    headers = ["server", "client CPU s/GiB", *(f"{f} /GiB" for f in FIELDS), "client CPU s/GiB, each rep"]
    table = common.markdown_table(headers, rows)
    print(table)
    common.write_json(
        args.out,
        {
            "benchmark": "load_by_server",
            "size_mib": args.size_mib,
            "machine": common.machine_info(),
            "fields": FIELDS,
            "runs": runs,
            "table_markdown": table,
        },
    )
    args.out.with_suffix(".md").write_text(
        f"Warm dcp_s3 loads of the {args.size_mib} MiB transformer state, one process, servers alternating, "
        f"medians of {args.reps} (`python -m benchmarks.load_by_server`).\n\n{table}\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
