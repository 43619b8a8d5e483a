"""The per-process ceiling: GIL-held seconds per GB of a save and a load (issue 53).

    python -m benchmarks.ceiling                      # ~3 min: every row below, 128 MiB, 1 rep
    python -m benchmarks.ceiling --size-mib 512 --reps 3 --contestants dcp_s3,boto3_ceiling --schemes http

A Python data plane cannot go faster than the time it holds the GIL allows, however many cores a node has:
ceiling = 1 / (GIL-held seconds per GB). For each contestant (``dcp_s3``, ``dcp_s3_zstd`` = compressed,
``s3torchconnector``, ``boto3_ceiling`` = raw boto3 transfers), scheme (HTTP, HTTPS on the same SeaweedFS-on-tmpfs
server, its TLS from a throw-away ``trustme`` CA as ``benchmarks.servers`` makes it), operation (save, load) and
mode (cold: a fresh process's first call; warm: after a save and a load of its own state, as a training job's
later checkpoints), one ``benchmarks.worker`` child runs the timed call, and only that call is sampled.

How the GIL is sampled, and why py-spy
--------------------------------------
``py-spy record --gil --nonblocking --format raw --rate R --pid CHILD`` is started when the child reaches its timed
call and stopped (SIGINT) when the call returns: the worker's profiler handshake (``DCP_S3_BENCH_PERF_CTL``, two
FIFOs, the one ``benchmarks.stages`` drove ``perf`` with) blocks the child before and after the call until the
sampler has started or stopped, and a child blocked in ``open``/``read`` of a FIFO holds no GIL, so nothing outside
the call is counted: no no-op run to subtract (the first probe's noise). ``--gil`` keeps only samples of the thread
that holds the GIL, so GIL-held seconds = samples / R (over a region of W seconds, at most W). ``--nonblocking``
reads the child's memory without stopping it, so the sampler does not slow what it measures (it costs a share of a
core, which on 2 shared cores is why the figures are ratios, not a quiet machine's). py-spy reads which thread
holds the GIL from outside the process; an in-process sampler cannot: a Python sampling thread must itself take
the GIL to look, so it sees itself as the holder and shifts the schedule it measures. Needs ptrace on the child
(same user, no Yama restriction or root); ``py_spy_usable`` checks with ``py-spy dump`` first.

Samples the sampler missed (it falls behind on a loaded machine) lower the count: the JSON keeps the region's
wall time and the sample count, and the table the GIL share (held seconds / wall), so a missing share shows.
GB = 10^9 bytes of tensor data. Results: ``results/ceiling.{json,md}``.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.contestants import get  # noqa: E402

CONTESTANTS = ("dcp_s3", "dcp_s3_zstd", "s3torchconnector", "boto3_ceiling")
SCHEMES = ("http", "https")
OPS = ("save", "load")
MODES = ("cold", "warm")
RATE = 250  # samples per second
#: Rows that cannot run here, and why (recorded in the results, not measured).
UNSUPPORTED = {
    ("s3torchconnector", "https"): (
        "s3torchconnector 1.5's CRT client takes no CA bundle (S3ClientConfig has no such field; AWS_CA_BUNDLE and "
        "SSL_CERT_FILE are not read), so it cannot trust the server's throw-away CA: a HeadObject hung > 60 s"
    ),
}
_START_LINE = "Sampling process"


def py_spy_usable() -> str | None:
    """None when ``py-spy`` can sample a child of this process here, else why not."""
    exe = shutil.which("py-spy")
    if exe is None:
        return "py-spy is not installed (pip install py-spy)"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        dump = subprocess.run([exe, "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "py-spy dump timed out"
    finally:
        child.kill()
        child.wait()
    if dump.returncode != 0:
        return f"py-spy dump failed (ptrace permissions?): {(dump.stderr or dump.stdout).strip()[:300]}"
    return None


class GilSampler:
    """Drives the worker's profiler handshake: starts ``py-spy --gil`` on the child at ``enable`` and stops it at
    ``disable``; ``result()`` is the GIL-held samples of the region and its wall time."""

    def __init__(self, workdir: str, rate: int = RATE) -> None:
        self.rate = rate
        self.ctl, self.ack = os.path.join(workdir, "ctl"), os.path.join(workdir, "ack")
        self.raw = os.path.join(workdir, "gil.txt")
        for path in (self.ctl, self.ack):
            os.mkfifo(path)
        self.env = {"DCP_S3_BENCH_PERF_CTL": f"{self.ctl},{self.ack}"}
        self._pid: int | None = None
        self._pid_set = threading.Event()
        self._spy: subprocess.Popen[str] | None = None
        self._spy_log: list[str] = []
        self._region: tuple[float, float] | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def on_start(self, pid: int) -> None:
        self._pid = pid
        self._pid_set.set()

    def _serve(self) -> None:
        try:
            for expected in ("enable", "disable"):
                with open(self.ctl) as f:
                    command = f.readline().strip()
                if command != expected:  # "abort" from close(): the child never reached its timed call
                    return
                if command == "enable":
                    self._start_spy()
                else:
                    self._stop_spy()
                with open(self.ack, "w") as f:
                    f.write("ack\n")
        except Exception as exc:  # reported with the row; the child is killed by its timeout at worst
            self.error = f"{type(exc).__name__}: {exc}"

    def _start_spy(self) -> None:
        self._pid_set.wait(30)
        cmd = ["py-spy", "record", "--gil", "--nonblocking", "--format", "raw", "--rate", str(self.rate)]
        cmd += ["--output", self.raw, "--pid", str(self._pid)]
        # py-spy says on stdout when sampling has begun, its errors on stderr: one pipe for both.
        self._spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self._spy.stdout is not None
        for line in self._spy.stdout:
            self._spy_log.append(line.rstrip())
            if _START_LINE in line:
                break
        threading.Thread(target=self._drain, daemon=True).start()
        self._region = (time.perf_counter(), 0.0)

    def _drain(self) -> None:
        assert self._spy is not None and self._spy.stdout is not None
        for line in self._spy.stdout:
            self._spy_log.append(line.rstrip())

    def _stop_spy(self) -> None:
        assert self._spy is not None and self._region is not None
        self._region = (self._region[0], time.perf_counter())
        self._spy.send_signal(signal.SIGINT)
        self._spy.wait(60)

    def close(self) -> None:
        """After the child exits: release a controller still waiting for a command that will not come."""
        if self._thread.is_alive():
            try:
                fd = os.open(self.ctl, os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, b"abort\n")
                os.close(fd)
            except OSError:
                pass
            self._thread.join(5)
        if self._spy is not None and self._spy.poll() is None:
            self._spy.kill()
            self._spy.wait()

    def result(self) -> dict[str, Any]:
        if self._region is None or not self._region[1]:
            return {"gil_error": self.error or "the sampler did not run: " + " | ".join(self._spy_log[-3:])}
        samples = parse_raw(self.raw)
        wall = self._region[1] - self._region[0]
        behind = sum("behind" in line for line in self._spy_log)
        # py-spy's last words: "... Samples: N Errors: E" (a sample it could not read is an error, not a zero).
        found = re.search(r"Errors: (\d+)", " ".join(self._spy_log[-3:]))
        errors = int(found.group(1)) if found else None
        return {
            "gil_samples": samples,
            "gil_rate": self.rate,
            "gil_held_s": samples / self.rate,
            "sampled_wall_s": wall,
            "gil_share": samples / self.rate / wall if wall > 0 else None,
            "sampler_errors": errors,
            "sampler_error_share": errors / (self.rate * wall) if errors is not None and wall > 0 else None,
            "sampler_behind_warnings": behind,
        }


def parse_raw(path: str) -> int:
    """Samples in a py-spy ``--format raw`` file (collapsed stacks, each line ending in its count)."""
    if not os.path.exists(path):
        return 0
    total = 0
    with open(path) as f:
        for line in f:
            count = line.rstrip().rpartition(" ")[2]
            if count.isdigit():
                total += int(count)
    return total


@dataclass(frozen=True)
class Row:
    contestant: str
    scheme: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.contestant} {self.scheme} {self.mode}"


def measure_row(row: Row, endpoint: common.Endpoint, bucket: str, args: argparse.Namespace, rep: int) -> list[dict]:
    """The row's save then its load, each in a fresh child sampled over its timed call."""
    local_dir = tempfile.mkdtemp(prefix="dcp-s3-ceiling-")
    target = {
        "bucket": bucket,
        "prefix": f"ceiling/{row.label.replace(' ', '_')}/rep{rep}",
        "endpoint_url": endpoint.endpoint_url,
        "region": endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1"),
        "local_dir": local_dir,
    }
    out = []
    try:
        for op in OPS:
            work = tempfile.mkdtemp(prefix="dcp-s3-gil-")
            sampler = GilSampler(work, args.rate)
            try:
                spec = {
                    "contestant": row.contestant,
                    "op": op,
                    "workload": args.workload,
                    "size_mib": args.size_mib,
                    "target": target,
                    "warm": row.mode == "warm",
                    "verify": op == "load",
                }
                res = common.run_child(spec, {**endpoint.env, **sampler.env}, args.timeout, on_start=sampler.on_start)
            finally:
                sampler.close()
            res.update(sampler.result() if res.get("ok") else {})
            shutil.rmtree(work, ignore_errors=True)
            res.update(label=row.label, contestant=row.contestant, scheme=row.scheme, mode=row.mode, op=op, rep=rep)
            out.append(res)
            print(_line(res), flush=True)
            if not res.get("ok"):
                break
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return out


def _line(res: dict[str, Any]) -> str:
    head = f"  {res['label']:>32} {res['op']:>4}:"
    if not res.get("ok"):
        return f"{head} {'skipped' if res.get('skipped') else 'FAILED'} {str(res.get('error'))[:300]}"
    per_gb = _per_gb(res)
    return (
        f"{head} {res['seconds']:6.2f} s  {res['gbps'] or 0:.3f} GB/s  {res['cpu_s_per_gb'] or 0:.2f} CPU s/GB  "
        f"GIL {res.get('gil_held_s', 0):.3f} s ({common.fmt(res.get('gil_share'))} of the call) = "
        f"{common.fmt(per_gb, 3)} s/GB" + ("" if res.get("verified") in (None, True) else "  VERIFY FAILED")
    )


def _per_gb(res: dict[str, Any]) -> float | None:
    if not res.get("ok") or res.get("gil_held_s") is None or not res.get("logical_bytes"):
        return None
    return res["gil_held_s"] / (res["logical_bytes"] / 1e9)


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """label -> op -> medians over the reps (GIL-held s/GB, ceiling GB/s, GIL share, GB/s, CPU s/GB)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        for op in OPS:
            ok = [r for r in runs if r["label"] == label and r["op"] == op and _per_gb(r) is not None]
            if not ok:
                continue
            per_gb = common.median([_per_gb(r) for r in ok])
            out.setdefault(label, {})[op] = {
                "gil_s_per_gb": per_gb,
                "ceiling_gbps": 1 / per_gb if per_gb else None,
                "gil_share": common.median([r.get("gil_share") for r in ok]),
                "gbps": common.median([r.get("gbps") for r in ok]),
                "cpu_s_per_gb": common.median([r.get("cpu_s_per_gb") for r in ok]),
                "sampler_error_share": common.median([r.get("sampler_error_share") for r in ok]),
                "reps": len(ok),
            }
    return out


def render(summary: dict[str, Any], failed: dict[str, str], args: argparse.Namespace) -> str:
    headers = ["contestant", "scheme", "mode"]
    for op in OPS:
        headers += [f"{op} GIL s/GB", f"{op} ceiling GB/s", f"{op} GIL share", f"{op} GB/s", f"{op} CPU s/GB"]
    headers += ["samples lost"]
    rows = []
    for label, ops in summary.items():
        cells = label.split(" ")
        for op in OPS:
            m = ops.get(op, {})
            cells += [
                common.fmt(m.get("gil_s_per_gb"), 3),
                common.fmt(m.get("ceiling_gbps"), 1),
                common.fmt(m.get("gil_share")),
                common.fmt(m.get("gbps")),
                common.fmt(m.get("cpu_s_per_gb")),
            ]
        lost = [ops.get(op, {}).get("sampler_error_share") for op in OPS]
        cells.append(" / ".join(common.fmt(v) for v in lost))
        rows.append(cells)
    note = (
        f"GIL-held seconds per GB (10^9 B of tensor data) over the timed call only (py-spy --gil --nonblocking, "
        f"{args.rate} Hz), median of {args.reps}; ceiling = 1 / that; GIL share = GIL-held s / the call's wall s; "
        f"samples lost (save / load) = py-spy's unreadable samples over the samples due (they count as not held). "
        f"{args.size_mib} MiB ({args.workload}), server {args.server} (HTTP and HTTPS ports of one server), "
        f"{os.cpu_count()} cores. dcp_s3_zstd = compression='zstd' (random bits: the codec's work, not its ratio)."
    )
    lines = [common.markdown_table(headers, rows), "", note]
    lines += [f"\n{label}: {why}" for label, why in failed.items()]
    return "\n".join(lines)


def _names(text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contestants", default=",".join(CONTESTANTS))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--workload", default="uniform", choices=["uniform", "transformer"])
    ap.add_argument("--server", default="seaweedfs_shm", choices=["seaweedfs_shm", "seaweedfs"], help="serves TLS")
    ap.add_argument("--rate", type=int, default=RATE, help="py-spy samples per second")
    ap.add_argument("--timeout", type=float, default=180, help="per child, seconds")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "ceiling.json")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server and temporary data are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = py_spy_usable()
    if why:
        raise SystemExit(why)
    names, schemes = _names(args.contestants, CONTESTANTS), _names(args.schemes, SCHEMES)
    rows = [Row(n, s, m) for s in schemes for n in names for m in _names(args.modes, MODES)]
    failed: dict[str, str] = {f"{n} {s}": why for (n, s), why in UNSUPPORTED.items() if n in names and s in schemes}
    rows = [r for r in rows if (r.contestant, r.scheme) not in UNSUPPORTED]
    for r in rows:
        reason = get(r.contestant).unavailable()
        if reason:
            raise SystemExit(f"{r.contestant}: {reason}")
    t0 = time.time()
    endpoint = common.open_endpoint(args.server, https=True)
    endpoints = {"http": endpoint, "https": endpoint.https()}
    runs: list[dict[str, Any]] = []
    try:
        bucket = endpoint.create_bucket(common.new_bucket_name("ceiling"))
        for rep in range(args.reps):
            for r in rows:
                ep = endpoints[r.scheme]
                assert ep is not None
                for res in measure_row(r, ep, bucket, args, rep):
                    runs.append(res)
                    if not res.get("ok"):
                        failed[f"{r.label} {res['op']}"] = str(res.get("error"))[:500]
    finally:
        endpoint.stop()
    summary = summarize(runs)
    table = render(summary, failed, args)
    print("\n" + table)
    payload = {
        "benchmark": "ceiling",
        "size_mib": args.size_mib,
        "reps": args.reps,
        "workload": args.workload,
        "server": args.server,
        "rate": args.rate,
        "machine": common.machine_info(),
        "elapsed_s": time.time() - t0,
        "summary": summary,
        "failed": failed,
        "runs": runs,
        "table_markdown": table,
    }
    common.write_json(args.out, payload)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
