"""Where dcp_s3's client CPU goes: a save and a load per GiB split into stages, by ``perf`` sampling.

    python -m benchmarks.stages                      # ~2 min: 512 MiB save + load, HTTP and HTTPS
    python -m benchmarks.stages --size-mib 256 --schemes http --contestant dcp_s3:part_size_mib=32

Each measurement is one fresh ``benchmarks.worker`` process run under ``perf record`` (software
clock, all threads, kernel included) with sampling switched on only around the timed ``dcp.save`` /
``dcp.load`` call (``--control`` FIFOs). Every sample is put in one stage by the function and library
it landed in (``STAGE_RULES``; first match wins), and the stage's share of the samples is scaled to
the call's CPU seconds per GiB from ``getrusage``:

* tensor → bytes and copies: ``memcpy``/``memmove`` in libc, numpy/torch copy kernels;
* page faults: the kernel zeroing and mapping fresh pages;
* checksums: the ``crc32c`` package (items and parts), zlib/``awscrt`` CRC32, MD5;
* signing: SHA-256 and HMAC (SigV4);
* TLS: OpenSSL's ciphers and record layer (libssl, libcrypto but SHA);
* socket (kernel): the copies to and from socket buffers and the TCP/IP stack on loopback;
* thread hand-offs: futexes, scheduling, wake-ups;
* Python per-request and per-item work: the interpreter and its C runtime (botocore, urllib3, DCP's
  planner, dcp_s3's own Python), ``libtorch`` calls (pickling headers, planning);
* other: everything else (listed in the JSON by library).

The HTTP server is the main benchmark server (``--server``, default ``juicefs_shm``); HTTPS runs on
``--https-server`` (default ``seaweedfs_shm``, which serves TLS; the JuiceFS gateway does not).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402

#: (stage, library pattern, symbol pattern): the first rule whose patterns both match a sample's
#: library (perf's "dso") and function takes it.
STAGE_RULES: list[tuple[str, str, str]] = [
    ("checksums", r"crc32c|_crc|awscrt|libz\b|libz\.", r""),
    ("checksums", r"", r"(?i)crc32|md5"),
    ("signing (SHA-256, HMAC)", r"", r"(?i)sha256|sha2_|hmac|sha_block|sha1"),
    ("TLS (encrypt, decrypt, records)", r"libssl|libcrypto|_ssl", r""),
    ("tensor → bytes, copies (memcpy)", r"libc[.-]", r"(?i)mem(cpy|move)|__memcpy|__memmove"),
    ("tensor → bytes, copies (memcpy)", r"numpy|_multiarray", r"(?i)copy|assign|cast"),
    (
        "page faults",
        r"kernel",
        r"(?i)clear_page|page_fault|do_anonymous|handle_mm|__handle|alloc_pages|"
        r"get_page_from_freelist|rmqueue|zap_pte|free_pages|release_pages|folio|lru|memcg|unmap|mmap|"
        r"do_user_addr|exc_page|_raw_spin_unlock_irqrestore|compact|mm_",
    ),
    (
        "socket (kernel copies, TCP/IP on loopback)",
        r"kernel",
        r"(?i)copy_user|copy_to_iter|copy_from_iter|"
        r"rep_movs|copyout|copyin|tcp|skb|sock|inet|ip_|ipv|__ip|net_|netif|dev_|loopback|napi|"
        r"__softirq|do_softirq|sk_|sys_send|sys_recv|__x64_sys_(send|recv|sendto|recvfrom)|csum|"
        r"__local_bh|release_sock|lock_sock|__dev|validate_xmit|fib|nf_|ep_|epoll|select|poll",
    ),
    (
        "thread hand-offs (futex, scheduling)",
        r"kernel",
        r"(?i)futex|schedule|switch|wake|__sched|"
        r"finish_task|enqueue|dequeue|pick_next|update_curr|ttwu|try_to_wake|idle|hrtimer|timer",
    ),
    ("kernel, other", r"kernel", r""),
    ("Python per request/item (interpreter, botocore, urllib3, DCP)", r"python|libpython", r""),
    (
        "Python per request/item (interpreter, botocore, urllib3, DCP)",
        r"libc[.-]",
        r"(?i)malloc|free|"
        r"_int_|cfree|realloc|calloc|tcache|arena|str|pthread",
    ),
    ("torch (headers, planning)", r"torch|libc10|libgomp|libshm", r""),
    ("other", r"", r""),
]
STAGES = list(dict.fromkeys(r[0] for r in STAGE_RULES))


def classify(dso: str, sym: str) -> str:
    for stage, dso_pat, sym_pat in STAGE_RULES:
        if (not dso_pat or re.search(dso_pat, dso)) and (not sym_pat or re.search(sym_pat, sym)):
            return stage
    return "other"


def profile_child(spec: dict[str, Any], env: dict[str, str], where: str, freq: int) -> dict[str, Any]:
    """Run one worker under ``perf record``; its result plus ``stages`` (share of samples per stage)."""
    ctl, ack, data = (os.path.join(where, n) for n in ("ctl", "ack", f"perf-{spec['op']}.data"))
    for fifo in (ctl, ack):
        if os.path.exists(fifo):
            os.unlink(fifo)
        os.mkfifo(fifo)
    prefix = ["perf", "record", "-q", "-F", str(freq), "-D", "-1", f"--control=fifo:{ctl},{ack}", "-o", data, "--"]
    res = common.run_child(spec, {**env, "DCP_S3_BENCH_PERF_CTL": f"{ctl},{ack}"}, prefix=prefix)
    if not res.get("ok"):
        return res
    report = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            data,
            "--no-children",
            "--sort",
            "dso,sym",
            "--stdio",
            "-q",
            "--percent-limit",
            "0",
            "-F",
            "overhead,sample,dso,sym",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shares: dict[str, float] = dict.fromkeys(STAGES, 0.0)
    by_dso: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    total = 0
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+\[[^\]]*\]\s+(.*)$", line)
        if not m:
            continue
        n, dso, sym = int(m.group(2)), m.group(3), m.group(4).strip()
        total += n
        shares[classify(dso, sym)] += n
        by_dso[dso] = by_dso.get(dso, 0) + n
        top.append((n, f"{dso} {sym}"))
    res["samples"] = total
    res["stages"] = {k: v / total for k, v in shares.items()} if total else {}
    res["by_library"] = {k: v / total for k, v in sorted(by_dso.items(), key=lambda kv: -kv[1])[:15]} if total else {}
    res["top_functions"] = [(f"{n / total:.3f}", s) for n, s in sorted(top, reverse=True)[:25]] if total else []
    os.unlink(data)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--workload", choices=["transformer", "uniform"], default="transformer")
    ap.add_argument("--contestant", default="dcp_s3")
    ap.add_argument("--server", choices=list(servers.KINDS), default="juicefs_shm")
    ap.add_argument("--https-server", choices=list(servers.KINDS), default="seaweedfs_shm")
    ap.add_argument("--schemes", default="http,https")
    ap.add_argument(
        "--modes",
        default="warm",
        help="warm (a tiny save and load first in the process: a training "
        "job's later checkpoints) and/or cold (the process's first checkpoint call: client, imports)",
    )
    ap.add_argument("--freq", type=int, default=1999, help="perf samples per second per CPU")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "stages.json")
    args = ap.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (linux-perf): it is what attributes the samples")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    _modes(args.modes)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    where = tempfile.mkdtemp(prefix="dcp-s3-stages-")
    results: dict[str, dict[str, Any]] = {}
    try:
        for scheme in schemes:
            kind = args.server if scheme == "http" else args.https_server
            endpoint = common.open_endpoint(kind, https=scheme == "https")
            try:
                ep = endpoint.https() if scheme == "https" else endpoint
                assert ep is not None
                bucket = ep.create_bucket(common.new_bucket_name("stages"))
                prefix = f"stages/{scheme}"
                target = {
                    "bucket": bucket,
                    "prefix": prefix,
                    "endpoint_url": ep.endpoint_url,
                    "region": "us-east-1",
                    "local_dir": where,
                }
                for mode, op in [(m, o) for m in _modes(args.modes) for o in ("save", "load")]:
                    spec = {
                        "contestant": args.contestant,
                        "op": op,
                        "workload": args.workload,
                        "size_mib": args.size_mib,
                        "target": target,
                        "warm": mode == "warm",
                    }
                    res = profile_child(spec, ep.env, where, args.freq)
                    if not res.get("ok"):
                        raise SystemExit(f"{scheme} {op} failed: {res.get('error')}")
                    res["cpu_s_per_gib"] = res["cpu_s"] / (res["logical_bytes"] / common.GiB)
                    results[f"{op} {scheme} {mode} ({kind})"] = res
                    _write(args, results)  # as it goes: a run cut short keeps what it measured
                    print(
                        f"{op} {scheme} {mode}: {res['cpu_s_per_gib']:.2f} CPU s/GiB, {res['seconds']:.2f} s, "
                        f"{res['samples']} samples",
                        flush=True,
                    )
                ep.delete_prefix(bucket, prefix)
            finally:
                endpoint.stop()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(_write(args, results))
    return 0


def _write(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    table = render(results)
    common.write_json(
        args.out,
        {
            "benchmark": "stages",
            "size_mib": args.size_mib,
            "workload": args.workload,
            "contestant": args.contestant,
            "machine": common.machine_info(),
            "results": results,
            "tables_markdown": table,
        },
    )
    args.out.with_suffix(".md").write_text(table + "\n")
    return table


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - {"warm", "cold"}:
        raise SystemExit(f"--modes {text!r}: expected warm, cold or both")
    return modes


def render(results: dict[str, dict[str, Any]]) -> str:
    cols = list(results)
    rows = []
    for stage in STAGES:
        rows.append(
            [stage] + [common.fmt(results[c]["stages"].get(stage, 0.0) * results[c]["cpu_s_per_gib"], 3) for c in cols]
        )
    rows.append(["**total (getrusage)**"] + [f"**{results[c]['cpu_s_per_gib']:.3f}**" for c in cols])
    return common.markdown_table(["stage (client CPU s/GiB)"] + cols, rows)


if __name__ == "__main__":
    sys.exit(main())
