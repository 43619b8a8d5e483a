"""Benchmark dcp_s3._codec against plain zstd and Blosc2 on realistic checkpoint tensors.

    python benchmarks/compression/bench_codec.py [--steps 20] [--reps 3] [--cache /tmp/bench_data.npz]

Prints markdown tables, writes ``results.json`` and the figure ``ratio_vs_decode.png``
(stored/raw against decode GB/s per codec and data kind) next to this file. Within a data
kind the contestants (codec version 1 on 2 threads, version 2 on 1 and 2 threads, Blosc2's
shuffle and bitshuffle with zstd on 2 threads) run in turn in every repetition, in one process.
Ratios are stored/raw (lower is better); speeds are GB/s of raw bytes (wall time) and CPU
seconds per GB (the process's CPU time, all threads). "zstd-1 item" compresses each data kind
as one zstd stream on one thread, the way torch's ``_extensions=[ZStandard()]`` stores a DCP
item. "other load" is how
many cores other processes used meanwhile: on a shared machine use
``--wait-quiet 300 --retries 4`` and trust rows near 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


# The dcp_s3 measured: this checkout's, or the one ``--tree PATH`` names (e.g. a checkout of main, to
# compare encoders with the same script, data and machine).
def _tree_argument(argv: list[str]) -> Path | None:
    """``--tree PATH`` / ``--tree=PATH``, read before ``dcp_s3`` is imported (argparse checks it again later)."""
    for i, a in enumerate(argv):
        if a.startswith("--tree="):
            return Path(a.split("=", 1)[1])
        if a == "--tree" and i + 1 < len(argv):
            return Path(argv[i + 1])
    return None


_TREE = (_tree_argument(sys.argv[1:]) or HERE.parents[1]).resolve()
sys.path.insert(0, str(_TREE))

from model_data import make_data  # noqa: E402

from dcp_s3._codec import Codec  # noqa: E402

ELEMENT = {
    "bf16 weights": (2, True),
    "fp32 weights": (4, True),
    "adam exp_avg": (4, True),
    "adam exp_avg_sq": (4, True),
    "int64 token ids": (8, False),
    "random bytes (as fp32)": (4, True),
}


def _timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Best of ``reps`` runs: the machine may be shared, and interference only slows runs down."""
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def _blosc2_contestants(es: int) -> dict[str, dict[str, Any]]:
    """Blosc2 settings compared (typesize = element size, zstd, 2 threads, one chunk per codec frame).

    clevel 1 (zstd level 1) is the fastest and, with shuffle, has the ratio closest to the
    codec's; higher levels store 0.5-1% less on Adam states and compress 3-10x slower."""
    try:
        import blosc2
    except ImportError:  # benchmarks/requirements.txt installs it
        return {}
    base = dict(codec=blosc2.Codec.ZSTD, typesize=es, nthreads=2)
    return {
        "blosc2 shuffle+zstd-1": dict(base, clevel=1, filters=[blosc2.Filter.SHUFFLE]),
        "blosc2 bitshuffle+zstd-1": dict(base, clevel=1, filters=[blosc2.Filter.BITSHUFFLE]),
    }


def _decode(dec: Callable[[Any], Any], encoded: dict[str, Any], label: str) -> Any:
    """Decode what ``label``'s encoder made (a function of its own: no closure over the loop's variables)."""
    return dec(encoded[label])


def bench_kind(name: str, data: np.ndarray, reps: int, frame_size: int) -> dict[str, Any]:
    """One data kind; every contestant's encode and decode runs once per repetition, in turn,
    so that machine noise hits them alike. Per contestant the best of ``reps`` is kept, as wall
    time (GB/s) and as the process's CPU time (CPU seconds per GB: all threads)."""
    es, floating = ELEMENT[name]
    raw = len(data)
    row: dict[str, Any] = {"kind": name, "raw_mb": raw / 1e6, "element_size": es, "floating": floating}
    cctx = zstandard.ZstdCompressor(level=1)
    t, comp = _timed(lambda: cctx.compress(data.data), reps)
    row["zstd1_ratio"] = len(comp) / raw
    row["zstd1_comp_gbs"] = raw / t / 1e9
    dctx = zstandard.ZstdDecompressor()
    t, _ = _timed(lambda: dctx.decompress(comp), reps)
    row["zstd1_decomp_gbs"] = raw / t / 1e9
    out = bytearray(raw)
    codecs = {
        f"v{version} {threads}t": Codec(level=1, threads=threads, frame_size=frame_size, version=version)
        for version, threads in ((1, 2), (2, 1), (2, 2))
    }
    blosc = _blosc2_contestants(es)
    # name -> (encode, decode): encode returns what decode needs
    contestants: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}

    def codec_pair(codec: Codec) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        # The sink copies each frame into one reused buffer, as the writer copies frames into its part
        # buffers: the timing holds the codec and that copy, not the allocation of a new item-sized buffer.
        sink_buf = memoryview(bytearray(raw + 64 * (raw // frame_size + 1)))

        def enc() -> Any:
            pos = 0

            def sink(frame: Any) -> None:
                nonlocal pos
                n = memoryview(frame).nbytes
                sink_buf[pos : pos + n] = memoryview(frame).cast("B")
                pos += n

            index = codec.encode(data.data, es, floating, sink)
            return index, sink_buf[:pos]

        def dec(e: Any) -> None:
            codec.decode_into(e[0], e[1], 0, 0, raw, out)

        return enc, dec

    for label, codec in codecs.items():
        contestants[label] = codec_pair(codec)
    if blosc:
        import blosc2

        chunk = frame_size - frame_size % es
        for label, params in blosc.items():

            def benc(params: dict[str, Any] = params) -> Any:
                return [blosc2.compress2(data[p : p + chunk], **params) for p in range(0, raw, chunk)]

            def bdec(chunks: Any) -> None:
                view = np.frombuffer(out, np.uint8)
                for k, c in enumerate(chunks):
                    blosc2.decompress2(c, dst=view[k * chunk : (k + 1) * chunk])

            contestants[label] = (benc, bdec)
    inf = float("inf")
    times = {k: {"enc": inf, "dec": inf, "enc_cpu": inf, "dec_cpu": inf} for k in contestants}
    encoded: dict[str, Any] = {}
    try:
        for _ in range(reps):
            for label, (enc, dec) in contestants.items():
                for step, fn in (("enc", enc), ("dec", functools.partial(_decode, dec, encoded, label))):
                    c0, t0 = time.process_time(), time.perf_counter()
                    result = fn()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    if step == "enc":
                        encoded[label] = result
                    times[label][step] = min(times[label][step], wall)
                    times[label][step + "_cpu"] = min(times[label][step + "_cpu"], cpu)
                if out != data.tobytes():
                    raise AssertionError(f"{name}: {label} round trip mismatch")
        chunks = [data[p : p + (16 << 20)] for p in range(0, raw, 16 << 20)]
        # the writer's case: input arrives in 16 MiB chunks (e.g. from a GPU)
        t, _ = _timed(lambda: codecs["v2 2t"].encode(iter(chunks), es, floating, lambda b: None), reps)
        row["v2_comp_gbs_t2_16mib_chunks"] = raw / t / 1e9
    finally:
        for codec in codecs.values():
            codec.close()
    row["contestants"] = {}
    for label in contestants:
        e = encoded[label]
        stored = e[1].nbytes if label in codecs else sum(map(len, e))
        tm = times[label]
        row["contestants"][label] = {
            "ratio": stored / raw,
            "comp_gbs": raw / tm["enc"] / 1e9,
            "decomp_gbs": raw / tm["dec"] / 1e9,
            "comp_cpu_s_per_gb": tm["enc_cpu"] / raw * 1e9,
            "decomp_cpu_s_per_gb": tm["dec_cpu"] / raw * 1e9,
        }
        if label in codecs:
            index = e[0]
            row["contestants"][label]["raw_frames"] = bin(index.raw_frames).count("1")
            row["contestants"][label]["frames"] = index.num_frames
        else:
            row["contestants"][label]["settings"] = _describe(blosc[label])
    return row


def _commit(tree: Path) -> str | None:
    """The git commit of the measured checkout, if it is one."""
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def _spread(data: np.ndarray, nbytes: int, frame_size: int) -> np.ndarray:
    """About ``nbytes`` of ``data``: whole frames (a multiple of 8 bytes) evenly spaced across it."""
    frame = frame_size - frame_size % 8
    total = len(data) // frame
    want = max(1, min(total, nbytes // frame))
    if want >= total:
        return data
    picks = np.linspace(0, total - 1, want).round().astype(int)
    return np.concatenate([data[i * frame : (i + 1) * frame] for i in picks])


def _describe(params: dict[str, Any]) -> str:
    filters = "+".join(getattr(f, "name", str(f)) for f in params["filters"])
    return f"{filters}, zstd clevel {params['clevel']}, typesize = element size, {params['nthreads']} threads"


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(v) - v[3] - v[4], sum(v)


class OtherLoad:
    """Measures how many cores other processes used while the block ran (timings are only
    meaningful near 0; on a shared machine rerun until it is)."""

    def __enter__(self) -> OtherLoad:
        self.ticks, self.cpu, self.wall = _cpu_ticks(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        ticks, cpu, wall = _cpu_ticks(), time.process_time() - self.cpu, time.perf_counter() - self.wall
        self.cores: float | None = None
        if self.ticks and ticks:
            busy = (ticks[0] - self.ticks[0]) / max(1, ticks[1] - self.ticks[1]) * (os.cpu_count() or 1)
            self.cores = round(max(0.0, busy - cpu / wall), 2)


def wait_quiet(limit_s: float) -> None:
    """Wait (at most ``limit_s``) until the machine is at least 95% idle over 2 s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        a = _cpu_ticks()
        time.sleep(2)
        b = _cpu_ticks()
        if a is None or b is None or (b[0] - a[0]) <= 0.05 * max(1, b[1] - a[1]):
            return


def markdown(rows: list[dict[str, Any]]) -> str:
    labels = list(rows[0]["contestants"]) if rows else []
    lines = [
        "| data | raw MB | " + " | ".join(labels) + " | zstd-1 item (1 thread) | other load (cores) |",
        "|" + "---|" * (4 + len(labels)),
    ]
    for r in rows:
        cells = [
            f"{c['ratio']:.3f}, {c['comp_gbs']:.2f}, {c['decomp_gbs']:.2f}"
            for c in (r["contestants"][k] for k in labels)
        ]
        lines.append(
            f"| {r['kind']} | {r['raw_mb']:.0f} | "
            + " | ".join(cells)
            + f" | {r['zstd1_ratio']:.3f}, {r['zstd1_comp_gbs']:.2f}, {r['zstd1_decomp_gbs']:.2f}"
            + f" | {r['other_processes_cores']} |"
        )
    lines += [
        "",
        "CPU seconds per GB (all threads; compress / decompress):",
        "",
        "| data | " + " | ".join(labels) + " |",
        "|" + "---|" * (1 + len(labels)),
    ]
    for r in rows:
        cells = [
            f"{c['comp_cpu_s_per_gb']:.2f} / {c['decomp_cpu_s_per_gb']:.2f}"
            for c in (r["contestants"][k] for k in labels)
        ]
        lines.append(f"| {r['kind']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Codec v2 against its targets (2 threads; decode and CPU figures against Blosc2 shuffle+zstd-1, "
        "ratio against v1):",
        "",
        "| data | v2 decode / Blosc2 (wall) | v2 decode CPU / Blosc2 CPU | v2 compress GB/s "
        "(16 MiB chunks) | v2 ratio / v1 ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["contestants"]
        b = c.get("blosc2 shuffle+zstd-1")
        v1, v2 = c["v1 2t"], c["v2 2t"]
        vs_b = (
            (
                f"{v2['decomp_gbs'] / b['decomp_gbs']:.2f}x",
                f"{v2['decomp_cpu_s_per_gb'] / b['decomp_cpu_s_per_gb']:.2f}x",
            )
            if b
            else ("-", "-")
        )
        lines.append(
            f"| {r['kind']} | {vs_b[0]} | {vs_b[1]} | {v2['comp_gbs']:.2f} "
            f"({r['v2_comp_gbs_t2_16mib_chunks']:.2f}) | {v2['ratio'] / v1['ratio']:.3f} |"
        )
    if rows and any(not k.startswith("v") for k in labels):
        lines += [
            "",
            "Blosc2 settings: "
            + "; ".join(f"{k}: {v['settings']}" for k, v in rows[0]["contestants"].items() if "settings" in v),
        ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One figure: stored/raw against 2-thread decode GB/s, a marker per codec, a colour per data kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(9, 6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shapes = "*Xo^vD"
    for i, r in enumerate(rows):
        if not r["floating"]:
            continue
        c = colours[i % len(colours)]
        points = {
            f"dcp_s3 {k}": (v["decomp_gbs"], v["ratio"])
            for k, v in r["contestants"].items()
            if k.startswith("v") and k.endswith("2t")
        }
        points.update({k: (v["decomp_gbs"], v["ratio"]) for k, v in r["contestants"].items() if not k.startswith("v")})
        points["zstd-1 item (1 thread)"] = (r["zstd1_decomp_gbs"], r["zstd1_ratio"])
        for j, (label, (x, y)) in enumerate(points.items()):
            marker = "s" if label.startswith("zstd") else shapes[j % len(shapes)]
            ax.scatter(
                x,
                y,
                color=c,
                marker=marker,
                s=140 if marker == "*" else 50,
                label=label if i == 0 else None,
                edgecolors="black",
                linewidths=0.4,
            )
        ax.annotate(r["kind"], points["dcp_s3 v2 2t"], textcoords="offset points", xytext=(6, -12), color=c, fontsize=8)
    ax.set_xlabel("decompress GB/s (2 threads; zstd item: 1)")
    ax.set_ylabel("stored / raw (lower is better)")
    ax.set_title("Checkpoint compression: ratio against decode speed, per data kind (colour)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps before snapshotting (default 20)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions, best reported (default 3)")
    ap.add_argument("--frame-size", type=int, default=4 << 20)
    ap.add_argument("--cache", type=Path, help="npz file to reuse the generated tensors across runs")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--plot", type=Path, default=HERE / "ratio_vs_decode.png", help="the figure (PNG)")
    ap.add_argument("--limit-mb", type=float, default=0, help="use only the first N MB of each kind (quick runs)")
    ap.add_argument(
        "--spread-mb",
        type=float,
        default=0,
        help="use N MB of each kind: whole frames taken evenly across it (every layer and tensor kind "
        "represented; keeps a shared-machine run short)",
    )
    ap.add_argument(
        "--tree",
        type=Path,
        help="measure the dcp_s3 of this checkout (default: the one holding this script), e.g. main's",
    )
    ap.add_argument("--kinds", nargs="+", metavar="KIND", help=f"only these data kinds (of: {', '.join(ELEMENT)})")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each data kind, wait up to S seconds for the machine to be idle",
    )
    ap.add_argument(
        "--retries", type=int, default=0, help="rerun a data kind up to N times while other processes load the machine"
    )
    args = ap.parse_args()

    if args.cache and args.cache.exists():
        with np.load(args.cache) as f:
            kinds = {str(name): f[f"k{i}"] for i, name in enumerate(f["names"])}
    else:
        kinds = make_data(steps=args.steps)
        rng = np.random.default_rng(0)
        # Token ids of a data loader batch (vocab 128k), a typical non-float item.
        kinds["int64 token ids"] = rng.integers(0, 128_000, 8 << 20, dtype=np.int64).view(np.uint8)
        kinds["random bytes (as fp32)"] = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
        if args.cache:
            np.savez(args.cache, names=np.array(list(kinds)), **{f"k{i}": v for i, v in enumerate(kinds.values())})
    if args.kinds:
        kinds = {k: kinds[k] for k in args.kinds}
    if args.spread_mb:
        kinds = {k: _spread(v, int(args.spread_mb * 1e6), args.frame_size) for k, v in kinds.items()}
    if args.limit_mb:
        kinds = {k: v[: int(args.limit_mb * 1e6)] for k, v in kinds.items()}
    rows = []
    for name, data in kinds.items():
        best: dict[str, Any] | None = None
        for attempt in range(1 + args.retries):
            wait_quiet(args.wait_quiet)
            with OtherLoad() as load:
                row = bench_kind(name, np.ascontiguousarray(data), args.reps, args.frame_size)
            row["other_processes_cores"] = load.cores
            if best is None or (load.cores or 0) < (best["other_processes_cores"] or 0):
                best = row
            print(f"{name}: other processes used {load.cores} cores (attempt {attempt + 1})", file=sys.stderr)
            if (load.cores or 0) < 0.1:
                break
        assert best is not None
        rows.append(best)
    print(markdown(rows))
    plot(rows, args.plot)
    try:
        import blosc2

        blosc2_version = blosc2.__version__
    except ImportError:
        blosc2_version = None
    env = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "blosc2": blosc2_version,
        "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "frame_size": args.frame_size,
        "reps": args.reps,
        "dcp_s3_tree": str(_TREE),
        "dcp_s3_commit": _commit(_TREE),
    }
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
