"""Issue 39's two cuts of 2026-12-04, each against the behaviour it replaced, in one warm process.

    python -m benchmarks.warm_cuts --size-mib 512 --reps 8

* **Saves**: parts grow past ``part_size`` with tensor bytes sent from their own memory, up to
  ``max_direct_part_size`` (64 MiB: a 512 MiB rank object goes up in 9 parts of 57 MiB), against
  ``max_direct_part_size=part_size`` (the old geometry: 16 MiB parts).
* **Loads**: a tensor read straight into its destination is hashed piece by piece as its bytes arrive
  (``RangeRead.received``), against one CRC32C pass over the destination once its reads are done (the old
  check, put back by replacing ``item_reads._PayloadCrc`` with one that takes no pieces).

One process, after a tiny save and load (a job's later checkpoints), the variants alternating rep by rep so
that the machine's background load spreads over both; client CPU (``getrusage``, all threads) per GiB and wall
seconds, medians. Child processes (``benchmarks.ab``) spread ±15% per op on this machine, more than the load cut.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402


def _timed(fn: Callable[[], None], gib: float) -> tuple[float, float]:
    gc.collect()
    gc.disable()
    try:
        cpu, t0 = common.cpu_seconds(), time.perf_counter()
        fn()
        return (common.cpu_seconds() - cpu) / gib, time.perf_counter() - t0
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--server", choices=list(servers.KINDS), default="juicefs_shm")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "warm_cuts.json")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_s3 import S3StorageReader, S3StorageWriter
    from dcp_s3.objstore.config import TransferConfig
    from dcp_s3.storage import item_reads

    hot = item_reads._PayloadCrc

    class AtCommit(hot):  # type: ignore[misc, valid-type]
        """The old check: no piece taken, so the destination is hashed once its reads are done."""

        def taker(self, i: int) -> Callable[[memoryview], None]:
            return lambda piece: None

        def value(self) -> int | None:
            return None

    server = servers.start(args.server)
    try:
        os.environ.update(server.env())
        bucket = server.fixed_bucket or "bench"
        if server.fixed_bucket is None:
            import boto3

            boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=bucket)
        workload = common.make_workload("transformer", args.size_mib)
        state = common.build_state_dict(workload, fill="random")
        into = common.build_state_dict(workload, fill="zeros")
        gib = sum(t.nbytes for t in workload.tensors) / 2**30
        part = TransferConfig().part_size

        def save(prefix: str, **kw: Any) -> Callable[[], None]:
            writer = S3StorageWriter(f"s3://{bucket}/{prefix}", **kw)
            return lambda: dcp.save(state, storage_writer=writer, no_dist=True)

        def load(crc: type) -> Callable[[], None]:
            def run() -> None:
                item_reads._PayloadCrc = crc  # type: ignore[misc]
                dcp.load(into, storage_reader=S3StorageReader(f"s3://{bucket}/ck"), no_dist=True)

            return run

        dcp.save({"w": torch.ones(16)}, storage_writer=S3StorageWriter(f"s3://{bucket}/warm"), no_dist=True)
        dcp.load({"w": torch.zeros(16)}, storage_reader=S3StorageReader(f"s3://{bucket}/warm"), no_dist=True)
        save("ck")()
        variants: dict[str, Callable[[int], Callable[[], None]]] = {
            "save, parts of part_size (before)": lambda r: save(f"before-{r}", max_direct_part_size=part),
            "save, parts up to max_direct_part_size (after)": lambda r: save(f"after-{r}"),
            "load, CRC32C pass at commit (before)": lambda r: load(AtCommit),
            "load, CRC32C as the bytes arrive (after)": lambda r: load(hot),
        }
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for rep in range(args.reps):
            for name, make in variants.items():
                runs[name].append(_timed(make(rep), gib))
        item_reads._PayloadCrc = hot  # type: ignore[misc]
        if not common.verify_state_dict(workload, into):
            raise SystemExit("the loaded state differs from the saved one")
    finally:
        server.stop()

    rows = [
        [
            name,
            common.fmt(statistics.median(c for c, _ in xs)),
            common.fmt(statistics.median(s for _, s in xs)),
            ", ".join(f"{c:.2f}" for c, _ in xs),
        ]
        for name, xs in runs.items()
    ]
    table = common.markdown_table(["variant", "CPU s/GiB", "wall s", "CPU s/GiB, each rep"], rows)
    print(table)
    common.write_json(
        args.out,
        {
            "benchmark": "warm_cuts",
            "size_mib": args.size_mib,
            "server": args.server,
            "machine": common.machine_info(),
            "runs": runs,
            "table_markdown": table,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
