"""The comparison suite: dcp_s3 against the other ways of putting DCP checkpoints on S3.

    python -m benchmarks.run                                  # 512 MiB transformer state, 3 reps, SeaweedFS
    python benchmarks/run.py --size-mib 128 --reps 1 --contestants dcp_s3,naive
    python -m benchmarks.run --endpoint-url http://host:9000  # an external S3 (credentials from AWS_* env)

For each repetition and contestant (interleaved, so background load spreads evenly)
three fresh processes run: a full save, a full load and a partial load (10% of the
tensor keys). Each reports wall seconds, peak RSS growth, client CPU seconds
(getrusage: all threads, native ones included) and bytes read (/proc/self/io rchar);
with our own SeaweedFS the parent also reads the server's per-bucket counters around
each child (bytes sent/received, requests by type), which count every client alike —
boto3, aiobotocore and the Rust CRT. Medians of ``--reps`` go into a markdown table
(with ratios to the best alternative and to the boto3 transport ceiling), a PNG plot
and ``results/run.json``.

The server is the JuiceFS S3 gateway on tmpfs by default (``benchmarks.servers``; the fastest
real server here, ``benchmarks.server_throughput`` at 679e524). Every row also says which side was busier:
the child's and the server's CPU, sampled by PID over the timed call. ``--warm`` rows run after a
tiny save and load in the same process (a training job's later checkpoints); ``--https`` rows come
in pairs, HTTP and HTTPS on ``--https-server`` (SeaweedFS on tmpfs, a throw-away ``trustme`` CA).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402
from benchmarks.contestants import CONTESTANTS, get  # noqa: E402

OPS = ("save", "load", "partial")
CEILING = "boto3_ceiling"
REFERENCE = "local_fs"
DEFAULT_CONTESTANTS = [
    "dcp_s3",
    "dcp_s3_zstd",
    "fsspec_s3fs",
    "s3torchconnector",
    "msc",
    "naive",
    "local_fs",
    "boto3_ceiling",
]


@dataclass(frozen=True)
class Row:
    """One row of the table: a contestant on an endpoint ("main", or the HTTPS server's "http"/"https"),
    cold (the first checkpoint call of a process) or warm (after a tiny save and load in the same process)."""

    label: str
    contestant: str
    where: str = "main"
    warm: bool = False


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512, help="logical size of the state dict (default 512)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    ap.add_argument("--workload", choices=["transformer", "uniform"], default="transformer")
    ap.add_argument(
        "--contestants",
        default=",".join(DEFAULT_CONTESTANTS),
        help=f"comma-separated, from {', '.join(CONTESTANTS)} (and dcp_s3 variants: dcp_s3:opt=v,...)",
    )
    ap.add_argument(
        "--warm",
        default="dcp_s3,boto3_ceiling",
        help="contestants also measured warm (a save and load of the same state first in the same process: "
        "a training job's second and later checkpoints); '' for none",
    )
    ap.add_argument(
        "--https",
        default="dcp_s3,boto3_ceiling",
        help="contestants also measured warm over HTTP and HTTPS on --https-server (trustme CA); '' for none",
    )
    ap.add_argument(
        "--server",
        choices=list(servers.KINDS),
        default="juicefs_shm",
        help="local server to start (benchmarks.servers; moto's ranged GETs re-read whole objects)",
    )
    ap.add_argument(
        "--https-server",
        choices=list(servers.KINDS),
        default="seaweedfs_shm",
        help="local server for the HTTP/HTTPS pair of rows (one that serves TLS)",
    )
    ap.add_argument("--endpoint-url", help="use this S3 endpoint instead of starting a server (no HTTPS rows)")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "run.json")
    ap.add_argument("--plot", type=Path, default=common.RESULTS_DIR / "run.png")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server and temporary data are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    names = _names(args.contestants)
    rows = [Row(n, n) for n in names] + [Row(f"{n} warm", n, warm=True) for n in _names(args.warm)]
    if not args.endpoint_url:
        for n in _names(args.https):
            rows += [
                Row(f"{n} warm http@{args.https_server}", n, "http", True),
                Row(f"{n} warm https@{args.https_server}", n, "https", True),
            ]
    for r in rows:
        get(r.contestant)  # fail early on a typo
    workload = common.make_workload(args.workload, args.size_mib)
    print(
        f"workload: {workload.description}; {workload.nbytes / common.MiB:.0f} MiB; "
        f"partial load: {len(workload.partial_keys())} of {len(workload.tensors)} tensors",
        flush=True,
    )
    info = common.machine_info()
    endpoints: dict[str, common.Endpoint] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {r.label: {op: [] for op in OPS} for r in rows}
    skipped: dict[str, str] = {}
    t_start = time.time()
    try:
        endpoints["main"] = common.open_endpoint(args.server, args.endpoint_url)
        if any(r.where != "main" for r in rows):
            endpoints["http"] = common.open_endpoint(args.https_server, https=True)
            https = endpoints["http"].https()
            assert https is not None
            endpoints["https"] = https
        buckets = {w: ep.create_bucket(common.new_bucket_name("run")) for w, ep in endpoints.items() if w != "https"}
        buckets["https"] = buckets.get("http", "")
        for rep in range(args.reps):
            for r in rows:
                if r.label not in skipped:
                    _one_round(endpoints[r.where], buckets[r.where], r, rep, args, runs, skipped)
    finally:
        for w, ep in endpoints.items():
            if w != "https":
                ep.stop()

    summary = {r.label: _summarize(runs[r.label]) for r in rows if r.label not in skipped}
    tables = render_tables(summary, workload, args)
    print()
    print(tables)
    for n, why in skipped.items():
        print(f"\nskipped {n}: {why}")
    payload = {
        "benchmark": "run",
        "workload": workload.description,
        "size_mib": args.size_mib,
        "reps": args.reps,
        "server": "external" if args.endpoint_url else args.server,
        "https_server": args.https_server,
        "machine": info,
        "elapsed_s": time.time() - t_start,
        "contestants": {r.label: get(r.contestant).description for r in rows},
        "skipped": skipped,
        "summary": summary,
        "runs": runs,
        "tables_markdown": tables,
    }
    common.write_json(args.out, payload)
    (args.out.with_suffix(".md")).write_text(tables + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    if not args.no_plot:
        server = "external S3" if args.endpoint_url else f"loopback {args.server}, {os.cpu_count()} cores"
        _plot(
            {r.label: summary[r.label] for r in rows if r.where == "main" and r.label in summary},
            workload,
            args.plot,
            server,
        )
    return 0


def _one_round(
    endpoint: common.Endpoint,
    bucket: str,
    row: Row,
    rep: int,
    args: argparse.Namespace,
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    skipped: dict[str, str],
) -> None:
    local_dir = tempfile.mkdtemp(prefix="dcp-s3-bench-")
    name = row.contestant
    prefix = f"run/{row.label.replace(':', '_').replace(',', '_').replace(' ', '_').replace('@', '_')}/rep{rep}"
    target = {
        "bucket": bucket,
        "prefix": prefix,
        "endpoint_url": endpoint.endpoint_url,
        "region": endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1"),
        "local_dir": local_dir,
    }
    try:
        for op in OPS:
            res = common.run_child(
                {
                    "contestant": name,
                    "op": op,
                    "workload": args.workload,
                    "size_mib": args.size_mib,
                    "target": target,
                    "warm": row.warm,
                    "counters": {"metrics_url": endpoint.metrics_url, "bucket": bucket} if get(name).uses_s3 else None,
                },
                endpoint.env,
                server_pid=endpoint.server_pid if get(name).uses_s3 else None,
            )
            res.setdefault("server", None)
            res["uses_s3"] = get(name).uses_s3
            if res.get("skipped"):
                skipped[row.label] = res["error"]
                print(f"  {row.label}: skipped — {res['error']}", flush=True)
                return
            runs[row.label][op].append(res)
            if res.get("ok"):
                srv = res["server"] or {}
                print(
                    f"  rep {rep} {row.label:>30} {op:>7}: {res['seconds']:6.2f} s  {res['gbps'] or 0:.3f} GB/s  "
                    f"+{res['peak_rss_growth_mib']:.0f} MiB  {res['cpu_s_per_gb'] or 0:.2f} CPU s/GB"
                    + (
                        f"  CPU% client {res['client_cpu_pct']:.0f} server {res['server_cpu_pct']:.0f}"
                        if res.get("server_cpu_pct") is not None
                        else ""
                    )
                    + (f"  read {srv.get('sent', 0) / 1e6:.1f} MB in {_requests(srv)} req" if srv else "")
                    + ("" if res.get("verified") in (None, True) else "  VERIFY FAILED"),
                    flush=True,
                )
            else:
                print(f"  rep {rep} {row.label:>30} {op:>7}: FAILED {str(res.get('error'))[:400]}", flush=True)
                if op == "save":
                    return
    finally:
        if get(name).uses_s3:
            try:
                endpoint.delete_prefix(bucket, prefix)
            except Exception as exc:  # cleanup only
                print(f"  (could not delete {prefix}: {exc})")
        shutil.rmtree(local_dir, ignore_errors=True)


def _requests(srv: dict[str, float] | None) -> int | None:
    if not srv:
        return None
    return int(sum(v for k, v in srv.items() if k.isupper()))


def _summarize(per_op: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op, results in per_op.items():
        ok = [r for r in results if r.get("ok")]
        if not ok:
            out[op] = {"n": 0, "failures": [r.get("error") for r in results]}
            continue
        logical = ok[0]["logical_bytes"]
        secs = common.median([r["seconds"] for r in ok])
        sent = common.median([(r["server"] or {}).get("sent") for r in ok])
        out[op] = {
            "n": len(ok),
            "seconds": secs,
            "gbps": logical / secs / 1e9 if secs else None,
            "logical_bytes": logical,
            "peak_rss_growth_mib": common.median([r["peak_rss_growth_mib"] for r in ok]),
            "cpu_s_per_gb": common.median([r["cpu_s_per_gb"] for r in ok]),
            "rchar": common.median([r["rchar"] for r in ok]),
            "server_bytes_sent": sent,
            "server_bytes_received": common.median([(r["server"] or {}).get("received") for r in ok]),
            "requests": common.median([_requests(r["server"]) for r in ok]),
            # rchar misses socket reads made with recv_into: only a file reader's (local_fs) is its bytes read.
            "bytes_read": sent
            if sent is not None
            else (None if ok[0].get("uses_s3", True) else common.median([r["rchar"] for r in ok])),
            "client_cpu_pct": common.median([r.get("client_cpu_pct") for r in ok]),
            "server_cpu_pct": common.median([r.get("server_cpu_pct") for r in ok]),
            "verified": all(r.get("verified") in (None, True) for r in ok),
            "failures": [r.get("error") for r in results if not r.get("ok")],
        }
    return out


def _get(summary: dict[str, Any], name: str, op: str, key: str) -> float | None:
    return summary.get(name, {}).get(op, {}).get(key)


def render_tables(summary: dict[str, Any], workload: common.Workload, args: argparse.Namespace) -> str:
    names = list(summary)
    alternatives = [
        n for n in names if n in DEFAULT_CONTESTANTS and not n.startswith("dcp_s3") and n not in (CEILING, REFERENCE)
    ]
    f = common.fmt

    def pct_of_ceiling(name: str, op: str) -> str:
        c, s = _get(summary, CEILING, op, "seconds"), _get(summary, name, op, "seconds")
        return f"{100 * c / s:.0f}%" if c and s else "—"

    main_rows = []
    for n in names:
        main_rows.append(
            [
                n,
                f(_get(summary, n, "save", "seconds")),
                f(_get(summary, n, "save", "gbps"), 3),
                pct_of_ceiling(n, "save"),
                f(_get(summary, n, "load", "seconds")),
                f(_get(summary, n, "load", "gbps"), 3),
                pct_of_ceiling(n, "load"),
                f(_get(summary, n, "partial", "seconds")),
                f(_get(summary, n, "save", "peak_rss_growth_mib"), 0),
                f(_get(summary, n, "load", "peak_rss_growth_mib"), 0),
                f(_get(summary, n, "save", "cpu_s_per_gb"), 2),
                f(_get(summary, n, "load", "cpu_s_per_gb"), 2),
                saturation(summary, n, "save"),
                saturation(summary, n, "load"),
            ]
        )
    t1 = common.markdown_table(
        [
            "contestant",
            "save s",
            "save GB/s",
            "save % of ceiling",
            "load s",
            "load GB/s",
            "load % of ceiling",
            "partial load s",
            "save RSS +MiB",
            "load RSS +MiB",
            "save CPU s/GB",
            "load CPU s/GB",
            "save CPU% client / server: busier",
            "load CPU% client / server: busier",
        ],
        main_rows,
    )

    io_rows = []
    for n in names:
        logical = _get(summary, n, "partial", "logical_bytes")
        read = _get(summary, n, "partial", "bytes_read")
        io_rows.append(
            [
                n,
                f(read / 1e6 if read is not None else None, 1),
                f(read / logical if read is not None and logical else None, 2),
                f(_get(summary, n, "save", "requests"), 0),
                f(_get(summary, n, "load", "requests"), 0),
                f(_get(summary, n, "partial", "requests"), 0),
            ]
        )
    logical_partial = next(
        (_get(summary, n, "partial", "logical_bytes") for n in names if _get(summary, n, "partial", "logical_bytes")),
        None,
    )
    t2 = common.markdown_table(
        [
            "contestant",
            "partial load: MB read",
            "partial: read / needed",
            "save requests",
            "load requests",
            "partial requests",
        ],
        io_rows,
    )

    lines = [
        f"{workload.nbytes / common.MiB:.0f} MiB {workload.name} state dict ({workload.description}); "
        f"server: {'external' if args.endpoint_url else args.server}; median of {args.reps} runs, "
        "each in a fresh process; GB = 1e9 bytes of tensor data.",
        "",
        t1,
        "",
        f"Partial load = {len(workload.partial_keys())} of {len(workload.tensors)} tensors "
        f"({(logical_partial or 0) / 1e6:.1f} MB needed). Bytes read and requests are the server's counters "
        "(SeaweedFS); — where the server keeps none (the JuiceFS gateway); local_fs: its file reads (rchar).",
        "",
        t2,
    ]
    if "dcp_s3" in summary and alternatives:
        lines += ["", _versus(summary, alternatives)]
    return "\n".join(lines)


def saturation(summary: dict[str, Any], name: str, op: str) -> str:
    """Client and server CPU% during the call (100% = one core, sampled by PID) and which side was busier;
    "cores full" when the two together used 90% of the machine's cores."""
    c, s = _get(summary, name, op, "client_cpu_pct"), _get(summary, name, op, "server_cpu_pct")
    if c is None or s is None:
        return "—"
    side = "server" if s > c else "client"
    full = ", cores full" if c + s >= 90 * (os.cpu_count() or 1) else ""
    return f"{c:.0f} / {s:.0f}: {side}{full}"


def _versus(summary: dict[str, Any], alternatives: list[str]) -> str:
    """dcp_s3 against the best alternative per metric (lower is better for all of them)."""
    rows = []
    metrics = [
        ("save s", "save", "seconds"),
        ("load s", "load", "seconds"),
        ("partial load s", "partial", "seconds"),
        ("save RSS +MiB", "save", "peak_rss_growth_mib"),
        ("load RSS +MiB", "load", "peak_rss_growth_mib"),
        ("save CPU s/GB", "save", "cpu_s_per_gb"),
        ("load CPU s/GB", "load", "cpu_s_per_gb"),
        ("partial bytes read", "partial", "bytes_read"),
    ]
    for label, op, key in metrics:
        ours = _get(summary, "dcp_s3", op, key)
        cands = [(v, n) for n in alternatives if (v := _get(summary, n, op, key)) is not None]
        if ours is None or not cands:
            continue
        best, best_name = min(cands)
        ceiling = _get(summary, CEILING, op, key)
        scale, digits = (1e6, 1) if key == "bytes_read" else (1, 2)
        label = label.replace("bytes read", "MB read")
        rows.append(
            [
                label,
                common.fmt(ours / scale, digits),
                f"{best_name} {common.fmt(best / scale, digits)}",
                f"{best / ours:.2f}x" if ours else "—",
                f"{ours / ceiling:.2f}x" if ceiling else "—",
            ]
        )
    return (
        "dcp_s3 vs the best alternative (s3fs, s3torchconnector, msc, naive) and the boto3 ceiling "
        "(ratio > 1 in 'best alt / dcp_s3' means dcp_s3 is better; 'dcp_s3 / ceiling' near 1 means "
        "nothing left to gain):\n\n"
        + common.markdown_table(["metric", "dcp_s3", "best alternative", "best alt / dcp_s3", "dcp_s3 / ceiling"], rows)
    )


def _plot(summary: dict[str, Any], workload: common.Workload, path: Path, server: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    names = list(summary)
    panels = [
        ("save throughput, GB/s (higher is better)", lambda n: _get(summary, n, "save", "gbps")),
        ("full load throughput, GB/s (higher is better)", lambda n: _get(summary, n, "load", "gbps")),
        ("save: client CPU s per GB (lower is better)", lambda n: _get(summary, n, "save", "cpu_s_per_gb")),
        ("full load: client CPU s per GB (lower is better)", lambda n: _get(summary, n, "load", "cpu_s_per_gb")),
        ("peak RSS growth, MiB (save | load)", None),
        ("partial load: bytes read / bytes needed", lambda n: _ratio(summary, n)),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    colors = [
        "#d62728" if n.startswith("dcp_s3") else "#7f7f7f" if n in (CEILING, REFERENCE) else "#1f77b4" for n in names
    ]
    for ax, (title, fn) in zip(axes.flat, panels, strict=True):
        if fn is None:
            xs = range(len(names))
            save = [_get(summary, n, "save", "peak_rss_growth_mib") or 0 for n in names]
            load = [_get(summary, n, "load", "peak_rss_growth_mib") or 0 for n in names]
            ax.bar([x - 0.2 for x in xs], save, 0.4, label="save", color=colors)
            ax.bar([x + 0.2 for x in xs], load, 0.4, label="load", color=colors, alpha=0.5)
            ax.legend()
        else:
            values = [fn(n) for n in names]
            bars = ax.bar(range(len(names)), [v or 0 for v in values], color=colors)
            for bar, v in zip(bars, values, strict=True):
                if v is not None:
                    ax.annotate(
                        f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7
                    )
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"DCP to S3 ({server}): {workload.nbytes / common.MiB:.0f} MiB {workload.name} state dict, medians", fontsize=11
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _ratio(summary: dict[str, Any], n: str) -> float | None:
    read, logical = _get(summary, n, "partial", "bytes_read"), _get(summary, n, "partial", "logical_bytes")
    return read / logical if read is not None and logical else None


if __name__ == "__main__":
    sys.exit(main())
