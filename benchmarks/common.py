"""What every benchmark shares: workloads, measurement, the S3 server, child processes, tables.

Measurements are taken in a fresh child process per (contestant, operation,
repetition) — ``python -m benchmarks.worker SPEC`` — so one contestant's
allocator state, caches and threads never leak into another's numbers. The
parent owns the S3 server and reads its request/byte counters around each child.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------
# Workloads: deterministic state dicts built in place (no temporaries, so the process's
# peak RSS before an operation equals its RSS at the start of the operation).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "bfloat16" else 4)


@dataclass(frozen=True)
class Workload:
    name: str
    tensors: tuple[TensorSpec, ...]
    extras: dict[str, Any] = field(default_factory=dict)  # non-tensor values: DCP saves them as bytes items
    description: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def partial_keys(self, fraction: float = 0.1) -> list[str]:
        """Every 1/fraction-th tensor key in order: a deterministic, spread-out 10% of the keys."""
        step = max(1, round(1 / fraction))
        return [t.key for t in self.tensors[::step]]


def uniform_workload(size_mib: int, tensor_mib: int = 16) -> Workload:
    """``size_mib / tensor_mib`` tensors of ``tensor_mib`` MiB, alternating fp32 and bf16."""
    n = max(1, size_mib // tensor_mib)
    elems = tensor_mib * MiB
    tensors = []
    for i in range(n):
        if i % 2 == 0:
            tensors.append(TensorSpec(f"w{i:04d}", (elems // 4 // 2048, 2048), "float32"))
        else:
            tensors.append(TensorSpec(f"w{i:04d}", (elems // 2 // 2048, 2048), "bfloat16"))
    return Workload("uniform", tuple(tensors), {}, f"{n} x {tensor_mib} MiB tensors (fp32/bf16 alternating)")


def transformer_workload(size_mib: int) -> Workload:
    """A GPT-like model's training state: bf16 weights, fp32 master weights, AdamW exp_avg/exp_avg_sq.

    14 bytes per parameter (2 + 4 + 4 + 4), like mixed-precision training with an fp32
    optimizer copy. The hidden size is the largest of 256..4096 that still gives >= 8
    layers; vocabulary 16k. Keys are flat and dotted (``model.layers.3.mlp.fc.weight``,
    ``optim.state.layers.3.mlp.fc.weight.exp_avg``), with AdamW's per-parameter scalar
    ``step`` tensors and a few non-tensor values, as a real trainer's state dict has.
    """
    target_params = size_mib * MiB / 14
    vocab = 16384
    d = 256
    for cand in (256, 512, 1024, 2048, 4096):
        if (target_params - vocab * cand) / _layer_params(cand) >= 8:
            d = cand
    layers = max(1, round((target_params - vocab * d) / _layer_params(d)))
    params: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, d))]
    for i in range(layers):
        p = f"layers.{i}."
        params += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.out.weight", (d, d)),
            (p + "attn.out.bias", (d,)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc.weight", (4 * d, d)),
            (p + "mlp.fc.bias", (4 * d,)),
            (p + "mlp.proj.weight", (d, 4 * d)),
            (p + "mlp.proj.bias", (d,)),
        ]
    params += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    tensors: list[TensorSpec] = []
    for name, shape in params:
        tensors.append(TensorSpec(f"model.{name}", shape, "bfloat16"))
    for name, shape in params:
        tensors += [
            TensorSpec(f"optim.state.{name}.master", shape, "float32"),
            TensorSpec(f"optim.state.{name}.exp_avg", shape, "float32"),
            TensorSpec(f"optim.state.{name}.exp_avg_sq", shape, "float32"),
            TensorSpec(f"optim.state.{name}.step", (), "float32"),
        ]
    extras = {
        "optim.param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}],
        "trainer.step": 1000,
        "trainer.rng_seed": 1234,
    }
    n_params = sum(math.prod(s) for _, s in params)
    desc = (
        f"transformer d={d}, {layers} layers, vocab {vocab}: {n_params / 1e6:.1f}M params, "
        f"{len(tensors)} tensors (bf16 weights + fp32 master/exp_avg/exp_avg_sq + step scalars)"
    )
    return Workload("transformer", tuple(tensors), extras, desc)


def _layer_params(d: int) -> int:
    return 12 * d * d + 13 * d


def make_workload(name: str, size_mib: int) -> Workload:
    if name == "uniform":
        return uniform_workload(size_mib)
    if name == "transformer":
        return transformer_workload(size_mib)
    raise ValueError(f"unknown workload {name!r}")


def _int_dtype(dtype: Any) -> Any:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def fill_tensor(spec: TensorSpec, index: int) -> Any:
    """The tensor for ``spec``: random bits seeded by ``index`` (incompressible, reproducible)."""
    import torch

    dtype = _torch_dtype(spec.dtype)
    gen = torch.Generator().manual_seed(1_000_003 * index + 17)
    t = torch.empty(spec.shape, dtype=_int_dtype(dtype))
    t.random_(generator=gen)
    return t.view(dtype)


def build_state_dict(workload: Workload, *, fill: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """``fill="random"`` for a save; ``fill="zeros"`` (pages touched, so resident) for a load target."""
    import torch

    wanted = None if keys is None else set(keys)
    sd: dict[str, Any] = {}
    for i, spec in enumerate(workload.tensors):
        if wanted is not None and spec.key not in wanted:
            continue
        if fill == "random":
            sd[spec.key] = fill_tensor(spec, i)
        else:
            t = torch.empty(spec.shape, dtype=_torch_dtype(spec.dtype))
            t.view(_int_dtype(t.dtype)).fill_(0)
            sd[spec.key] = t
    if wanted is None:
        sd.update(workload.extras)  # small non-tensor values; a load replaces them in place
    return sd


def verify_state_dict(workload: Workload, sd: dict[str, Any], *, sample: int = 6) -> bool:
    """Bit-compare up to ``sample`` loaded tensors (spread over the dict) with their expected content."""
    import torch

    present = [(i, s) for i, s in enumerate(workload.tensors) if s.key in sd]
    if not present:
        return True
    step = max(1, len(present) // sample)
    for i, spec in present[::step][:sample] + [present[-1]]:
        want = fill_tensor(spec, i)
        got = sd[spec.key]
        if not torch.equal(got.view(_int_dtype(got.dtype)), want.view(_int_dtype(want.dtype))):
            return False
    return True


# --------------------------------------------------------------------------------------------
# Measurement inside the child.
# --------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` of the whole process (all threads): rchar counts socket reads too."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class PeakRSS:
    """Samples this process's RSS every ``interval`` seconds in a thread; ``growth`` = peak - start.

    Also reads ``ru_maxrss``: when it rose during the block it is an exact peak (the sampler
    can miss a spike shorter than its interval), and the larger of the two is reported.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = self.peak = 0
        self._maxrss_before = self._maxrss_after = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    def __enter__(self) -> PeakRSS:
        self._maxrss_before = maxrss_bytes()
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self._maxrss_after = maxrss_bytes()

    @property
    def sampled_growth(self) -> int:
        return self.peak - self.start

    @property
    def maxrss_growth(self) -> int | None:
        """Exact peak growth if the process's lifetime peak was set during the block, else None."""
        if self._maxrss_after > self._maxrss_before:
            return self._maxrss_after - self.start
        return None

    @property
    def growth(self) -> int:
        return max(self.sampled_growth, self.maxrss_growth or 0)


# --------------------------------------------------------------------------------------------
# The S3 server and its counters (parent side).
# --------------------------------------------------------------------------------------------
@dataclass
class Endpoint:
    """Where the contestants write: an S3 endpoint plus credentials, or our own local server."""

    endpoint_url: str
    env: dict[str, str]
    server: Any = None  # benchmarks.servers.BenchServer when we started it
    metrics_url: str | None = None
    #: The server's PID (its process tree's CPU is sampled around each child), when it is ours.
    server_pid: int | None = None
    #: The one bucket the server serves (the JuiceFS gateway: its volume), or None.
    fixed_bucket: str | None = None
    #: The throw-away CA and certificate files of an HTTPS server we started (removed by ``stop``).
    tls_dir: str | None = None

    def https(self) -> Endpoint | None:
        """The same server over HTTPS (its CA in ``AWS_CA_BUNDLE``), if it was started with TLS."""
        if self.server is None or self.server.https_url is None:
            return None
        return Endpoint(
            self.server.https_url,
            self.server.env(https=True),
            self.server,
            self.metrics_url,
            self.server_pid,
            self.fixed_bucket,
        )

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.env.get("AWS_DEFAULT_REGION", "us-east-1"),
            aws_access_key_id=self.env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY"),
            config=Config(s3={"addressing_style": "path"}),
            verify=self.env.get("AWS_CA_BUNDLE"),
        )

    def create_bucket(self, name: str) -> str:
        if self.fixed_bucket is not None:
            return self.fixed_bucket
        c = self.client()
        try:
            c.head_bucket(Bucket=name)
        except Exception:
            c.create_bucket(Bucket=name)
        return name

    def delete_prefix(self, bucket: str, prefix: str) -> None:
        c = self.client()
        keys = [
            o["Key"]
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
        ]
        if self.fixed_bucket is not None:  # the JuiceFS gateway wants Content-MD5 on DeleteObjects
            for k in keys:
                c.delete_object(Bucket=bucket, Key=k)
            return
        for i in range(0, len(keys), 1000):
            c.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})

    def counters(self, bucket: str) -> dict[str, float] | None:
        """SeaweedFS' per-bucket counters: bytes sent/received and requests by type (None elsewhere)."""
        return bucket_counters(self.metrics_url, bucket)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)


def open_endpoint(kind: str, endpoint_url: str | None = None, *, https: bool = False) -> Endpoint:
    """Start a loopback server of ``kind`` (``benchmarks.servers.KINDS``), with an HTTPS port too when
    ``https`` (a throw-away ``trustme`` CA), or use ``endpoint_url`` with credentials from the environment."""
    if endpoint_url:
        env = {
            k: os.environ[k]
            for k in (
                "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN",
                "AWS_DEFAULT_REGION",
                "AWS_CA_BUNDLE",
            )
            if k in os.environ
        }
        env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        env["AWS_ENDPOINT_URL"] = endpoint_url
        return Endpoint(endpoint_url, env)
    import tempfile

    from benchmarks import servers

    tls_dir = tempfile.mkdtemp(prefix="dcp-s3-bench-tls-") if https else None
    try:
        server = servers.start(kind, tls=servers.make_tls(tls_dir) if tls_dir else None)
    except BaseException:
        if tls_dir:
            shutil.rmtree(tls_dir, ignore_errors=True)
        raise
    return Endpoint(
        server.endpoint_url, server.env(), server, server.metrics_url, server.pid, server.fixed_bucket, tls_dir
    )


def bucket_counters(metrics_url: str | None, bucket: str) -> dict[str, float] | None:
    """SeaweedFS' per-bucket counters at ``metrics_url``: bytes sent/received and requests by type (None
    without a metrics URL, or when it does not answer)."""
    if metrics_url is None:
        return None
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return None
    out: dict[str, float] = {"sent": 0.0, "received": 0.0, "GET": 0.0, "PUT": 0.0, "DELETE": 0.0, "LIST": 0.0}
    b = re.escape(bucket)
    for line in text.splitlines():
        m = re.match(rf'SeaweedFS_s3_bucket_traffic_(sent|received)_bytes_total\{{bucket="{b}"\}} (\S+)', line)
        if m:
            out[m.group(1)] += float(m.group(2))
            continue
        m = re.match(rf'SeaweedFS_s3_request_total\{{bucket="{b}",code="[^"]*",type="([A-Z]+)"\}} (\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def new_bucket_name(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------------------------
# Child processes.
# --------------------------------------------------------------------------------------------
def run_child(
    spec: dict[str, Any],
    env: dict[str, str],
    timeout: float = 900,
    *,
    server_pid: int | None = None,
    prefix: Sequence[str] = (),
    on_start: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run one measurement in a fresh ``python -m benchmarks.worker``; returns its result dict.

    With ``server_pid``, the child's and the server's CPU are sampled by PID (psutil, every 50 ms) and the
    result gets ``client_cpu_pct`` and ``server_cpu_pct`` over the child's timed call (100% = one core
    busy). ``prefix`` runs the worker under another command (``perf record ... --``). ``on_start`` is called with
    the child's PID as soon as it runs (``benchmarks.ceiling`` attaches its sampler to it).
    """
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    child_env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    child_env.pop("AWS_ENDPOINT_URL_S3", None)
    child_env.pop("AWS_PROFILE", None)
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
        cwd=REPO_ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if on_start is not None:
        on_start(proc.pid)
    sampler = CPUSampler(proc.pid, server_pid) if server_pid is not None else None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"ok": False, "error": f"timed out after {timeout}s"}
    finally:
        if sampler is not None:
            sampler.stop()
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            if sampler is not None and result.get("ok"):
                result.update(sampler.shares(result["wall_start"], result["wall_end"]))
            return result
    tail = (stderr or stdout).strip().splitlines()[-15:]
    return {"ok": False, "error": f"child exited {proc.returncode}: " + " | ".join(tail)}


class CPUSampler:
    """Samples the CPU seconds of a client process tree and of a server process tree by PID (psutil)."""

    def __init__(self, client_pid: int, server_pid: int, interval: float = 0.05) -> None:
        import psutil

        self._procs = [psutil.Process(client_pid), psutil.Process(server_pid)]
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), client CPU s, server CPU s)
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _tree_cpu(self, root: Any) -> float:
        import psutil

        total = 0.0
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return math.nan
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while True:
            now = time.time()
            client, server = (self._tree_cpu(p) for p in self._procs)
            if math.isfinite(client) and math.isfinite(server):
                self.samples.append((now, client, server))
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def shares(self, start: float, end: float) -> dict[str, float | None]:
        """Client and server CPU% (100 = one core) between the samples nearest ``start`` and ``end``."""
        inside = [s for s in self.samples if start - self._interval <= s[0] <= end + self._interval]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return {"client_cpu_pct": None, "server_cpu_pct": None}
        (t0, c0, s0), (t1, c1, s1) = inside[0], inside[-1]
        return {"client_cpu_pct": 100 * (c1 - c0) / (t1 - t0), "server_cpu_pct": 100 * (s1 - s0) / (t1 - t0)}


# --------------------------------------------------------------------------------------------
# Aggregation and tables.
# --------------------------------------------------------------------------------------------
def median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return "—"
    return f"{v:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = os.getloadavg()
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    for mod in ("boto3", "botocore", "s3fs", "s3torchconnector"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:
            pass
    return info


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)
