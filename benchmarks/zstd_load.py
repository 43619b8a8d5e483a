"""A compressed load against a plain one, and what decoding alone costs: warm loads in one process.

    python -m benchmarks.zstd_load                     # 256 MiB, 5 reps, juicefs_shm (~2 min)
    python -m benchmarks.zstd_load --size-mib 128 --reps 3 --workloads realistic

For each workload the state dict is saved once plain and once with ``compression="zstd"``, then loaded
warm (the reader's client made by an earlier load in this process) ``--reps`` times each, alternating,
and timed (client CPU seconds from ``time.process_time``, all threads). "decode alone" decodes every
frame of the compressed checkpoint from memory on one thread, as a load does (``Codec.decode_into`` of
one frame at a time into a destination buffer, then the frame's CRC32C): the CPU a compressed load must
spend on top of moving its stored bytes. Workloads:

* ``transformer``: the main table's state (``benchmarks.common``: random bits, so it barely compresses);
* ``realistic``: 3/4 bf16 weights and 1/4 fp32 ``exp_avg_sq`` of a trained model
  (``benchmarks.compression_e2e.build``).

``--links 8,4,2`` repeats the loads with what the server sends limited to each of those rates (Gbit/s; ``none``:
unshaped) by ``benchmarks.link`` (root, Linux ``tc``): where moving a byte costs more than decoding it, a
compressed load is the faster one, and this finds the rate at which it becomes so.

``--base TREE`` adds the loads of both checkpoints with ``TREE``'s ``dcp_s3/storage/item_reads.py`` (the code
that turns a load plan into reads) swapped in for this tree's, alternating with this tree's in the same process:
a before/after of a change there with nothing else different (it needs the same ``ItemReads`` interface).

Writes ``results/zstd_load.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from crc32c import crc32c

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dcp_s3.storage.reader as reader_module  # noqa: E402
from benchmarks import common, link  # noqa: E402
from benchmarks.compression_e2e import build  # noqa: E402
from dcp_s3 import S3StorageReader, S3StorageWriter  # noqa: E402
from dcp_s3.codec import Codec  # noqa: E402

GiB = 1 << 30


def state(workload: str, size_mib: int) -> dict[str, Any]:
    if workload == "realistic":
        return dict(build(size_mib))
    return common.build_state_dict(common.make_workload("transformer", size_mib), fill="random")


def decode_alone(reader: Any, reps: int) -> tuple[float, float]:
    """(stored/raw, median CPU s/GiB) of decoding every compressed frame of ``reader``'s checkpoint from memory."""
    md = reader.read_metadata()
    items = [i for i in md.storage_data.values() if getattr(i, "frames", None) is not None]
    store, session = reader._session.object_store, reader._session
    objects = {p: store.get(session.key(p)) for p in {i.relative_path for i in items}}
    raw = sum(i.frames.raw_length for i in items)
    outs = [np.ones(i.frames.raw_length, np.uint8) for i in items]  # resident, as a load's destination
    codec = Codec(threads=1)
    figures = []
    for _ in range(reps + 1):  # the first pass warms the codec's buffers: not counted
        c0 = time.process_time()
        for info, out in zip(items, outs):
            frames, data = info.frames, memoryview(objects[info.relative_path])
            for f in range(frames.num_frames):
                (lo, hi), (s0, s1) = frames.raw_range(f), frames.stored_range(f)
                stored = data[info.offset + s0 : info.offset + s1]
                codec.decode_into(frames, stored, s0, lo, hi, out[lo:hi])
                if crc32c(out[lo:hi]) != info.frame_crc32c[f]:
                    raise RuntimeError(f"{info.relative_path}: frame {f} differs")
        figures.append((time.process_time() - c0) / (raw / GiB))
    return sum(i.length for i in items) / raw, statistics.median(figures[1:])


def base_item_reads(tree: Path) -> Any:
    """``ItemReads`` of ``tree``'s ``dcp_s3/storage/item_reads.py``, imported under another name."""
    spec = importlib.util.spec_from_file_location("base_item_reads", tree / "dcp_s3" / "storage" / "item_reads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ItemReads


def _loads(
    sd: dict[str, Any], prefix: str, modes: dict[str, Any], item_reads: dict[str, Any], opts: dict[str, Any], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]]]:
    """Warm loads of ``prefix/<mode>`` for every mode (and ``item_reads`` tree), alternating; medians of
    (client CPU s/GiB, wall s) by name, and every rep's. Checks the state each load gives back."""
    logical = sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor))
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    loads = [(tree + mode, mode) for tree in item_reads for mode in modes]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in loads}
    for rep in range(reps + 1):  # the first round warms up: not counted
        for name, mode in loads if rep % 2 == 0 else reversed(loads):
            reader_module.ItemReads = item_reads[name[: -len(mode)]]
            reader = S3StorageReader(f"{prefix}/{mode}", **opts)
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                dcp.load(out, storage_reader=reader, no_dist=True)
            finally:
                reader_module.ItemReads = item_reads[""]
            if rep:
                runs[name].append(((time.process_time() - c0) / (logical / GiB), time.perf_counter() - t0))
            same = all(
                torch.equal(out[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                for k, v in sd.items()
                if isinstance(v, torch.Tensor)
            )
            if not same:
                raise RuntimeError(f"{prefix}/{mode}: the loaded state differs")
            for t in out.values():  # the next load must write every byte again
                if isinstance(t, torch.Tensor):
                    t.zero_()
    return {m: [statistics.median(x[j] for x in r) for j in (0, 1)] for m, r in runs.items()}, runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--server", default="juicefs_shm")
    ap.add_argument("--workloads", default="transformer,realistic")
    ap.add_argument("--base", type=Path, help="another source tree: also load with its item_reads.py")
    ap.add_argument("--links", help="link rates to load through, Gbit/s, comma-separated ('none': unshaped)")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "zstd_load.json")
    args = ap.parse_args(argv)
    links = [None if x == "none" else float(x) for x in args.links.split(",")] if args.links else [None]

    item_reads = {"": reader_module.ItemReads}
    if args.base:
        item_reads["base "] = base_item_reads(args.base.resolve())

    endpoint = common.open_endpoint(args.server)
    os.environ.update(endpoint.env)
    opts: dict[str, Any] = {"endpoint_url": endpoint.endpoint_url, "region": "us-east-1"}
    results: dict[str, dict[str, Any]] = {}
    try:
        bucket = endpoint.create_bucket(common.new_bucket_name("zl"))
        shaping = link.shaped(link.port_of(endpoint.endpoint_url)) if args.links else contextlib.nullcontext()
        with shaping as set_rate:
            for workload in args.workloads.split(","):
                sd = state(workload, args.size_mib)
                modes = {"plain": {}, "zstd": {"compression": "zstd"}}
                for mode, extra in modes.items():
                    writer = S3StorageWriter(f"s3://{bucket}/{workload}/{mode}", **opts, **extra)
                    dcp.save(sd, storage_writer=writer, no_dist=True)
                ratio, decode = decode_alone(S3StorageReader(f"s3://{bucket}/{workload}/zstd", **opts), args.reps)
                for rate in links:
                    if set_rate is not None:
                        set_rate(rate)
                    speed = "unshaped" if rate is None else f"{rate:g} Gbit/s"
                    label = workload if not args.links else f"{workload} @ {speed}"
                    med, runs = _loads(sd, f"s3://{bucket}/{workload}", modes, item_reads, opts, args.reps)
                    results[label] = {"runs": runs, "median": med, "stored_over_raw": ratio}
                    results[label]["decode_cpu_s_per_gib"] = decode
                    print(
                        f"{label}: "
                        + "; ".join(f"{name} {cpu:.2f} CPU s/GiB {wall:.2f} s" for name, (cpu, wall) in med.items())
                        + f"; decode alone {decode:.2f}; stored/raw {ratio:.3f}",
                        flush=True,
                    )
    finally:
        endpoint.stop()
    rows = [
        [
            w,
            f"{r['stored_over_raw']:.3f}",
            common.fmt(r["median"]["plain"][0]),
            common.fmt(r["median"]["zstd"][0]),
            common.fmt(r["median"]["zstd"][0] - r["median"]["plain"][0]),
            common.fmt(r["decode_cpu_s_per_gib"]),
            common.fmt(r["median"]["plain"][1]),
            common.fmt(r["median"]["zstd"][1]),
            f"{r['median']['zstd'][1] / r['median']['plain'][1]:.2f}",
        ]
        + [
            f"{common.fmt(r['median'][f'base {m}'][0])} / {common.fmt(r['median'][f'base {m}'][1])}"
            for m in ("plain", "zstd")
            if args.base
        ]
        for w, r in results.items()
    ]
    table = common.markdown_table(
        [
            "workload",
            "stored/raw",
            "plain load CPU s/GiB",
            "zstd load CPU s/GiB",
            "difference",
            "decode alone CPU s/GiB",
            "plain load s",
            "zstd load s",
            "zstd / plain s",
        ]
        + (["base plain load CPU s/GiB / s", "base zstd load CPU s/GiB / s"] if args.base else []),
        rows,
    )
    print(table)
    common.write_json(
        args.out,
        {
            "size_mib": args.size_mib,
            "reps": args.reps,
            "links_gbit": links,
            "results": results,
            "table": table,
            "machine": common.machine_info(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
