"""End to end: a compressed save vs an uncompressed one, on the local S3 server.

    python -m benchmarks.compression_e2e            # 1 GiB bf16-heavy state dict, 3 reps
    python -m benchmarks.compression_e2e --size-mib 256 --reps 1

The state dict is made of realistic tensors: a small GPT-like model trained for a
few AdamW steps (``benchmarks/compression/model_data.py``), its bf16 weights tiled
to 3/4 of the size and its fp32 ``exp_avg_sq`` to the rest, cut into 32 MiB
tensors. Each repetition saves it uncompressed, with ``compression="zstd"`` (codec
version 2, the default) and with codec version 1 (``zstd-v1``: the writer's codec
pinned to version 1, as releases up to 0.3 wrote), in an order rotating per
repetition, then loads each back and checks it bit for bit. Reports median save/load
seconds, the client process's CPU seconds and stored bytes; writes
``results/compression_e2e.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.compression.model_data import make_data  # noqa: E402

TENSOR_MIB = 32


def build(size_mib: int) -> dict[str, torch.Tensor]:
    data = make_data(steps=20, verbose=False)
    sources = [
        (data["bf16 weights"], torch.bfloat16, size_mib * 3 // 4),
        (data["adam exp_avg_sq"], torch.float32, size_mib - size_mib * 3 // 4),
    ]
    sd: dict[str, torch.Tensor] = {}
    for src, dtype, mib in sources:
        flat = torch.from_numpy(src.copy())
        elem = torch.empty(0, dtype=dtype).element_size()
        for i in range(max(1, mib // TENSOR_MIB)):
            nbytes = TENSOR_MIB << 20
            reps = -(-nbytes // flat.numel())
            start = (i * 7919 * elem) % flat.numel()  # a different phase per tensor
            raw = flat.roll(-start).repeat(reps)[:nbytes]
            sd[f"{dtype}.{i}"] = raw.view(dtype).reshape(-1, 1024).clone()
    return sd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "compression_e2e.json")
    args = ap.parse_args(argv)

    import torch.distributed.checkpoint as dcp

    import dcp_s3._dcp.writer as writer_module
    from dcp_s3 import S3StorageReader, S3StorageWriter
    from dcp_s3._codec import Codec

    sd = build(args.size_mib)
    logical = sum(t.nbytes for t in sd.values())
    print(f"state dict: {len(sd)} tensors, {logical / common.MiB:.0f} MiB (3/4 bf16 weights, 1/4 fp32 exp_avg_sq)")
    endpoint = common.open_endpoint("seaweedfs")
    os.environ.update(endpoint.env)  # credentials for the writer/reader (standard boto3 chain)
    modes = ["none", "zstd", "zstd-v1"]
    results: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    try:
        bucket = endpoint.create_bucket(common.new_bucket_name("e2e"))
        client = endpoint.client()
        opts: dict[str, Any] = {"endpoint_url": endpoint.endpoint_url, "region": "us-east-1"}
        for rep in range(args.reps):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                uri = f"s3://{bucket}/{mode}/{rep}"
                writer = S3StorageWriter(uri, compression=None if mode == "none" else "zstd", **opts)
                writer_module.Codec = functools.partial(Codec, version=1) if mode == "zstd-v1" else Codec  # type: ignore[misc]
                c0, t0 = time.process_time(), time.perf_counter()
                try:
                    dcp.save(sd, storage_writer=writer, no_dist=True)
                finally:
                    writer_module.Codec = Codec  # type: ignore[misc]
                save_s, save_cpu = time.perf_counter() - t0, time.process_time() - c0
                stored = sum(
                    o["Size"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{mode}/{rep}/")["Contents"]
                )
                out = {k: torch.empty_like(v) for k, v in sd.items()}
                c0, t0 = time.process_time(), time.perf_counter()
                dcp.load(out, storage_reader=S3StorageReader(uri, **opts), no_dist=True)
                load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
                assert all(torch.equal(out[k], sd[k]) for k in sd), f"{mode}: round trip differs"
                for name, value in (
                    ("save_s", save_s),
                    ("load_s", load_s),
                    ("save_cpu_s", save_cpu),
                    ("load_cpu_s", load_cpu),
                    ("stored", stored),
                ):
                    results[mode].setdefault(name, []).append(value)
                print(
                    f"rep {rep} {mode:>7}: save {save_s:.2f}s ({save_cpu:.2f} CPU s) load {load_s:.2f}s "
                    f"({load_cpu:.2f} CPU s) stored {stored / common.MiB:.0f} MiB",
                    flush=True,
                )
    finally:
        endpoint.stop()

    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}
    rows = [
        [
            m,
            common.fmt(med[m]["save_s"]),
            common.fmt(med[m]["save_cpu_s"]),
            common.fmt(med[m]["load_s"]),
            common.fmt(med[m]["load_cpu_s"]),
            f"{med[m]['stored'] / common.MiB:.0f}",
            common.fmt(med[m]["stored"] / logical, 3),
        ]
        for m in modes
    ]
    print()
    print(
        common.markdown_table(
            ["compression", "save s", "save CPU s", "load s", "load CPU s", "stored MiB", "stored/raw"], rows
        )
    )
    for m in ("zstd", "zstd-v1"):
        print(
            f"\n{m} vs none: save time x{med[m]['save_s'] / med['none']['save_s']:.2f}, "
            f"load time x{med[m]['load_s'] / med['none']['load_s']:.2f}, "
            f"load CPU x{med[m]['load_cpu_s'] / med['none']['load_cpu_s']:.2f}, "
            f"bytes stored -{100 * (1 - med[m]['stored'] / med['none']['stored']):.0f}%"
        )
    common.write_json(
        args.out,
        {
            "size_mib": args.size_mib,
            "reps": args.reps,
            "runs": results,
            "median": med,
            "machine": common.machine_info(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
