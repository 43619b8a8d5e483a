"""The device check (project issue 37): CUDA tensors through dcp_s3 on one GPU, in under 5 minutes.

``python -m benchmarks.gpu_check`` (on the GPU machine: ``benchmarks/gpu_check.sh run``) measures and
writes ``benchmarks/results/gpu.md`` (and ``gpu.json``):

* the limit: torch's own pinned ``copy_`` device→host and host→device (and a pageable copy), GB/s;
* the same copies inside dcp_s3: a tensor's bytes through the writer's pinned staging
  (``payload_chunks`` with a ``Stagings``), and reads through the reader's (``StagedRows``), GB/s and
  the ratio to the limit (issue 37 asks ≥ 80%);
* a CUDA state dict (bf16 weights, fp32 Adam moments; ``--size-gib``) saved and loaded through
  ``S3StorageWriter``/``S3StorageReader`` on a 1-rank NCCL group, bit-exact: sync with the pinned path,
  sync with the old pageable path (A/B), async (``dcp.async_save``, and torch's ``DefaultStager`` where
  it exists); per save: wall time, time the training stream was held up (a thread keeps matmuls
  queued on it and times them with CUDA events), peak GPU memory added, host RSS added;
* the NCCL path of the planners' collectives: ``collective_device``, ``broadcast_bytes`` (bytes and an
  error), ``share_metadata`` and a ``replica_group`` load on the NCCL group;
* two gloo ranks holding CUDA tensors on the same GPU (saved and loaded bit-exact);
* moto's server, where gpu_check.sh carried it in or it is importable (the local directory takes the same
  staging path).

The target is a local directory (``--dir``; default under ``/dev/shm`` when it has room, so the disk
does not hide the copies): the GPU machine has no S3 server. ``--cpu-smoke`` runs every part that does
not need CUDA, tiny, on CPU and gloo (the test suite runs it: ``tests/storage/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from benchmarks.gpu_check_h2d import RowsRequest, h2d_breakdown
from benchmarks.gpu_fw_common import s3_target
from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._dcp.staging import DeviceStaging, PinnedPool, Stagings, load_pinned_bound, save_pinned_bound
from dcp_s3._dcp.tensor_bytes import StagedRows, payload_chunks
from dcp_s3._objstore.config import TransferConfig
from dcp_s3._planners.sharing import broadcast_bytes, collective_device
from dcp_s3.errors import DcpS3Error

MiB = 1 << 20
GiB = 1 << 30
RESULTS = Path(__file__).resolve().parent / "results"
DEPS = ("boto3", "botocore", "s3transfer", "zstandard", "crc32c", "psutil")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=3.0, help="state dict size (bf16 weights + fp32 Adam)")
    p.add_argument("--copy-gib", type=float, default=1.0, help="tensor size of the copy-rate measurements")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: /dev/shm if it has room, else /tmp)")
    p.add_argument("--out", default=str(RESULTS / "gpu.md"))
    p.add_argument("--cpu-smoke", action="store_true", help="the CPU-only parts, tiny, on gloo (no CUDA needed)")
    p.add_argument("--quick", action="store_true", help="leave out the two-process gloo run and moto")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# What the machine is
# ------------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "missing": [m for m in DEPS if importlib.util.find_spec(m) is None],
        "memlock": _memlock(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = f"{props.name}, {props.total_memory / GiB:.0f} GiB"
    return env


def _memlock() -> str:
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ValueError, OSError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / MiB:.0f} MiB"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
# The state dict
# ------------------------------------------------------------------------------------------------
def make_state(nbytes: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights and fp32 Adam moments (10 bytes per parameter), in 32 layers, random bits."""
    params = max(1024, nbytes // 10)
    layers = 32
    per = max(32, params // layers)
    cols = 1024 if per >= 1024 * 4 else 32
    rows = per // cols
    g = torch.Generator(device=device).manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(layers):
        sd[f"model.layers.{i}.weight"] = torch.randn(rows, cols, generator=g, device=device).to(torch.bfloat16)
        sd[f"optim.state.{i}.exp_avg"] = torch.randn(rows, cols, generator=g, device=device)
        sd[f"optim.state.{i}.exp_avg_sq"] = torch.rand(rows, cols, generator=g, device=device)
    sd["optim.step"] = torch.tensor(1234.0, device=device)
    return sd


def state_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in sd.values())


def bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same keys, dtypes, shapes and bytes (compared as bytes: NaN payloads and -0.0 count)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k])) for k in a
    )


# ------------------------------------------------------------------------------------------------
# Copy rates: torch's limit, and the same copies inside dcp_s3
# ------------------------------------------------------------------------------------------------
def _best(fn: Callable[[], None], device: torch.device, reps: int = 3) -> float:
    fn()  # warm-up (allocations, first pinning)
    synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def torch_copy_rates(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of torch's own copies of ``nbytes``: pinned D2H/H2D (the limit) and pageable D2H."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    return {
        "torch_pinned_d2h": nbytes / _best(lambda: host.copy_(src, non_blocking=True), device) / 1e9,
        "torch_pinned_h2d": nbytes / _best(lambda: src.copy_(host, non_blocking=True), device) / 1e9,
        "torch_pageable_d2h": nbytes / _best(lambda: pageable.copy_(src), device) / 1e9,
    }


def dcp_s3_copy_rates(device: torch.device, nbytes: int, transfer: TransferConfig) -> dict[str, float]:
    """GB/s of the copies dcp_s3 makes: a tensor's bytes through the writer's pinned chunks (views
    only; and copied into a part buffer, as the writer does), and reads through ``StagedRows``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    save = stagings_for(device, *save_pinned_bound(transfer.part_size, 1))
    save.begin()
    staging = save.get(src)
    part = numpy.empty(transfer.part_size, dtype=numpy.uint8)

    def d2h_views() -> None:
        for _ in payload_chunks(src, staging):
            pass

    def d2h_into_parts() -> None:
        for chunk in payload_chunks(src, staging):
            part[: len(chunk)] = numpy.frombuffer(chunk, dtype=numpy.uint8)

    out = {
        "dcp_s3_d2h": nbytes / _best(d2h_views, device) / 1e9,
        "dcp_s3_d2h_into_part_buffers": nbytes / _best(d2h_into_parts, device) / 1e9,
    }
    save.close()
    load = stagings_for(device, *load_pinned_bound(transfer.max_range_size, transfer.max_concurrency))
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = transfer.max_range_size

    def h2d() -> None:
        load.begin()
        staging = load.get(dest)
        staging.stream.wait_current()
        req = RowsRequest(nbytes)
        for r in range(0, nbytes, rows):
            piece = StagedRows(dest, torch.Size([nbytes]), torch.uint8, req, r, min(rows, nbytes - r), staging)  # type: ignore[arg-type]
            piece.open()  # (the network fills it here)
            piece.done()
        staging.pool.drain()

    out["dcp_s3_h2d"] = nbytes / _best(h2d, device) / 1e9
    load.close()
    return out


class _CpuStream:
    """The side stream on CPU (``--cpu-smoke``): copies at once."""

    def wait_current(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return _Done()


class _Done:
    def query(self) -> bool:
        return True


def stagings_for(device: torch.device, count: int, size: int) -> Stagings:
    if device.type == "cuda":
        return Stagings(count, size)
    fake = DeviceStaging(PinnedPool(count, size, lambda n: torch.empty(n, dtype=torch.uint8)), _CpuStream())

    class _All(Stagings):
        def get(self, tensor: torch.Tensor) -> Any:
            return fake

    return _All(count, size)


class _Pageable(Stagings):
    """Today's path before issue 37 (and the fallback): no pinned staging for any tensor."""

    def get(self, tensor: torch.Tensor) -> None:
        return None


# ------------------------------------------------------------------------------------------------
# Measurements around a save
# ------------------------------------------------------------------------------------------------
class StreamProbe:
    """A 'training' thread that keeps matmuls queued on the default stream of ``device`` (four steps
    ahead, so host-side pauses never starve the GPU) and times each step with CUDA events; ``held_ms``
    is how much longer the steps took while something ran than before it (copies queued on the same
    stream, or waits inserted into it, show up there; a side stream's copies do not)."""

    AHEAD = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = device.type == "cuda"
        self.steps: list[tuple[float, float]] = []  # (host time the step was seen done, GPU ms)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline_ms = 0.0

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        a = torch.randn(4096, 4096, device=self.device)
        b = torch.randn(4096, 4096, device=self.device)
        queued: list[tuple[Any, Any]] = []
        while not self._stop.is_set():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            queued.append((start, end))
            if len(queued) > self.AHEAD:
                s, e = queued.pop(0)
                e.synchronize()
                self.steps.append((time.perf_counter(), s.elapsed_time(e)))
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(1.0)  # baseline steps
        self.baseline_ms = statistics.median(ms for _, ms in self.steps) if self.steps else 0.0
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join(30)

    def held_ms(self, t0: float, t1: float) -> float:
        """Sum over the steps seen done in ``[t0, t1]`` of their time beyond the baseline (steps within
        1.2x of it count as noise)."""
        return sum(ms - self.baseline_ms for t, ms in self.steps if t0 <= t <= t1 and ms > 1.2 * self.baseline_ms)


class RssPeak:
    """Peak RSS growth of this process while the block runs (sampled every 5 ms; psutil if present)."""

    def __init__(self) -> None:
        self.growth = 0
        self._psutil = importlib.util.find_spec("psutil") is not None

    def _rss(self) -> int:
        if self._psutil:
            import psutil  # noqa: PLC0415

            return int(psutil.Process().memory_info().rss)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        start = peak = self._rss()
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.wait(0.005):
                peak = max(peak, self._rss())

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(10)
            self.growth = max(peak, self._rss()) - start


def measured(device: torch.device, probe: StreamProbe, fn: Callable[[], Any]) -> dict[str, Any]:
    """Wall time, stream hold-up, peak GPU memory added and RSS added of ``fn()``."""
    synchronize(device)
    rss = RssPeak()
    base = 0
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with rss.watch():
        result = fn()
    t1 = time.perf_counter()
    out: dict[str, Any] = {"seconds": t1 - t0, "rss_added_mib": rss.growth / MiB}
    if isinstance(result, dict):  # what the operation reports of itself (not DCP's Metadata)
        out["result"] = result
    if device.type == "cuda":
        out["gpu_peak_added_mib"] = (torch.cuda.max_memory_allocated(device) - base) / MiB
    if probe.active:
        out["stream_held_ms"] = probe.held_ms(t0, t1 + 0.05)
    return out


# ------------------------------------------------------------------------------------------------
# Save and load through dcp_s3
# ------------------------------------------------------------------------------------------------
def save_load(
    sd: dict[str, torch.Tensor], root: Path, device: torch.device, probe: StreamProbe, group: dist.ProcessGroup
) -> dict[str, Any]:
    """Sync saves and loads on ``group`` (NCCL only, on a GPU); async saves on the default group, which
    has a CPU backend (``dcp.async_save`` requires one)."""
    nbytes = state_bytes(sd)
    rows: dict[str, Any] = {}

    def run_save(name: str, stagings: Stagings | None) -> None:
        writer = S3StorageWriter(root / name)
        if stagings is not None:
            writer._stagings = stagings
        rows[f"save ({name})"] = m = measured(
            device, probe, lambda: dcp.save(sd, storage_writer=writer, process_group=group)
        )
        m["gb_s"] = nbytes / m["seconds"] / 1e9
        writer.close()

    def run_load(name: str, **reader_args: Any) -> None:
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        reader = S3StorageReader(root / name, **reader_args)
        rows[f"load ({name}{', ' + ', '.join(reader_args) if reader_args else ''})"] = m = measured(
            device, probe, lambda: dcp.load(out, storage_reader=reader, process_group=group)
        )
        m["gb_s"] = nbytes / m["seconds"] / 1e9
        m["bit_exact"] = bit_exact(out, sd)
        reader.close()

    run_save("pinned", None if device.type == "cuda" else stagings_for(device, 2, 16 * MiB))
    run_load("pinned")
    run_load("pinned", replica_group=group)  # replicated load: the broadcast path, on NCCL
    run_save("pageable", _Pageable(2, 16 * MiB))
    run_load("pageable")
    shutil.rmtree(root / "pageable", ignore_errors=True)

    # dcp.async_save: DCP's stager copies to host memory (the writer is a BlockingAsyncStager); the
    # writer then sends that copy's own memory (borrowed CPU tensors: no second copy).
    def run_async() -> dict[str, float]:
        writer = S3StorageWriter(root / "async")
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=writer)
        returned = time.perf_counter() - t0  # the staging copy: the part the training loop waits for
        fut.result(600)
        writer.close()
        return {"returned_after_s": round(returned, 3)}

    rows["async_save"] = measured(device, probe, run_async)
    run_load("async")
    shutil.rmtree(root / "async", ignore_errors=True)
    rows.update(default_stager(sd, root, device, probe))
    shutil.rmtree(root / "pinned", ignore_errors=True)
    return rows


def default_stager(sd: dict[str, torch.Tensor], root: Path, device: torch.device, probe: StreamProbe) -> dict[str, Any]:
    """``dcp.async_save`` with torch's ``DefaultStager(StagingOptions(...))`` (pinned, shared memory,
    async staging), where the installed torch has it, in a thread and (torchtitan's
    ``async_with_pinned_mem`` call exactly) in a process; each loaded back bit-exact."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: PLC0415
    except ImportError:
        return {"async_save + DefaultStager": {"result": "not in this torch"}}
    if device.type != "cuda":
        return {"async_save + DefaultStager": {"result": "needs CUDA (asserts on CPU-only hosts)"}}
    rows: dict[str, Any] = {}
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        name = f"async_save + DefaultStager ({kind.value})"
        stager = DefaultStager(StagingOptions(True, True, True, True))
        writer = S3StorageWriter(root / "stager")

        def run(writer: Any = writer, stager: Any = stager, kind: Any = kind) -> dict[str, float]:
            t0 = time.perf_counter()
            resp = dcp.async_save(sd, storage_writer=writer, async_stager=stager, async_checkpointer_type=kind)
            returned = time.perf_counter() - t0
            staged = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            if staged is not None:
                staged.result(600)
            staged_s = time.perf_counter() - t0
            upload.result(600)
            return {"returned_after_s": round(returned, 3), "staged_after_s": round(staged_s, 3)}

        try:
            rows[name] = measured(device, probe, run)
            out = {k: torch.zeros_like(v) for k, v in sd.items()}
            dcp.load(out, storage_reader=S3StorageReader(root / "stager"))
            rows[name]["bit_exact"] = bit_exact(out, sd)
        except Exception as exc:  # reported, not fatal: the rest of the table stands
            rows[name] = {"result": f"{type(exc).__name__}: {exc}"}
        finally:
            stager.close()
            shutil.rmtree(root / "stager", ignore_errors=True)
    return rows


def collectives(root: Path, group: dist.ProcessGroup) -> dict[str, Any]:
    """The planners' collectives on ``group`` (NCCL only on a GPU, gloo in the smoke run)."""
    out: dict[str, Any] = {"backend": str(dist.get_backend(group)), "collective_device": str(collective_device(group))}
    payload = os.urandom(3 * MiB + 17)
    out["broadcast_bytes"] = broadcast_bytes(lambda: payload, 0, group, "probe") == payload

    def fail() -> bytes:
        raise DcpS3Error("probe failure (expected)")

    try:
        broadcast_bytes(fail, 0, group, "probe")
        out["broadcast_error"] = "not raised"
    except DcpS3Error as exc:
        out["broadcast_error"] = "raised on every rank" if "probe failure" in str(exc) else repr(exc)
    sd = {"w": torch.arange(1 << 20, dtype=torch.float32, device=collective_device(group))}
    dcp.save(sd, storage_writer=S3StorageWriter(root / "coll"), process_group=group)
    got = {"w": torch.zeros_like(sd["w"])}
    reader = S3StorageReader(root / "coll", share_metadata=True, replica_group=group)
    dcp.load(got, storage_reader=reader, process_group=group)
    out["share_metadata + replica_group load"] = bit_exact(got, sd)
    shutil.rmtree(root / "coll", ignore_errors=True)
    return out


def _gloo_rank(rank: int, root: str, init: str, device: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        dev = torch.device(device)
        sd = {f"r{rank}.w": torch.randn(1 << 20, device=dev), "shared.b": torch.ones(1000, device=dev)}
        dcp.save(sd, storage_writer=S3StorageWriter(root))
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(got, storage_reader=S3StorageReader(root))
        Path(result, f"rank{rank}").write_text(json.dumps(bit_exact(got, sd)))
    finally:
        dist.destroy_process_group()


def two_gloo_ranks(root: Path, device: torch.device) -> dict[str, Any]:
    """Two gloo ranks, both holding tensors on ``device`` (one GPU: NCCL would refuse two ranks)."""
    result = Path(tempfile.mkdtemp(dir=root))
    init = f"file://{result}/pg"
    ctx = mp.start_processes(
        _gloo_rank,
        args=(str(root / "gloo"), init, str(device), str(result)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            return {"two gloo ranks": "timed out after 180 s"}
    ok = [json.loads((result / f"rank{r}").read_text()) for r in range(2)]
    shutil.rmtree(root / "gloo", ignore_errors=True)
    return {f"two gloo ranks, {device.type} tensors, bit-exact": all(ok)}


def moto_round_trip(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A few CUDA tensors saved to and loaded from moto's server (carried in by gpu_check.sh, or importable)."""
    with s3_target() as target:
        if target is None:
            return {"moto": "moto not here: skipped (the local directory takes the same staging path)"}
        uri = f"{target.root}/ck"
        small = dict(list(sd.items())[:6])
        t0 = time.perf_counter()
        dcp.save(small, storage_writer=S3StorageWriter(uri, **target.options))
        out = {k: torch.zeros_like(v) for k, v in small.items()}
        dcp.load(out, storage_reader=S3StorageReader(uri, **target.options))
        return {
            "moto": {
                "bytes": state_bytes(small),
                "seconds": time.perf_counter() - t0,
                "bit_exact": bit_exact(out, small),
            }
        }


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# Device check (issue 37)",
        "",
        f"Generated by `python -m benchmarks.gpu_check` in "
        f"{results['seconds']:.0f} s on {env.get('gpu', 'CPU only (smoke run)')}, Python {env['python']}, "
        f"torch {env['torch']} (CUDA {env['cuda']}), locked-memory limit {env['memlock']}; "
        f"state dict {results['state_gib']:.2f} GiB; checkpoints in `{results['dir']}`.",
        "",
    ]
    if env["missing"]:
        lines += [f"Not importable here: {', '.join(env['missing'])}.", ""]
    rates = results.get("copy_rates", {})
    if rates:
        lines += ["## Copy rates (GB/s)", "", "| copy | GB/s | of torch's pinned copy_ |", "|---|---:|---:|"]
        for name, value in rates.items():
            limit = rates.get("torch_pinned_h2d" if "h2d" in name else "torch_pinned_d2h", 0.0)
            lines.append(
                f"| {name} | {value:.1f} | {100 * value / limit:.0f}% |" if limit else f"| {name} | {value:.1f} | |"
            )
        lines.append("")
    breakdown = results.get("h2d_breakdown", {})
    if breakdown:
        lines += [
            "### Host→device in pieces (benchmarks/gpu_check_h2d.py)",
            "",
            "| way | GB/s | of torch's pinned copy_ | host CPU per piece (us) |",
            "|---|---:|---:|---|",
        ]
        limit = rates.get("torch_pinned_h2d", 0.0)
        for name, m in breakdown.items():
            share = f"{100 * m['GB/s'] / limit:.0f}%" if limit else ""
            spent = ", ".join(f"{k.split()[0]} {v:.0f}" for k, v in m.items() if k != "GB/s")
            lines.append(f"| {name} | {m['GB/s']:.1f} | {share} | {spent} |")
        lines.append("")
    lines += [
        "## Saves and loads",
        "",
        "| operation | s | GB/s | stream held (ms) | GPU peak added (MiB) | RSS added (MiB) | bit-exact / result |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, m in results.get("save_load", {}).items():

        def f(key: str, fmt: str = "{:.2f}", m: dict[str, Any] = m) -> str:
            return fmt.format(m[key]) if isinstance(m.get(key), (int, float)) else ""

        extra = m.get("bit_exact", m.get("result", ""))
        lines.append(
            f"| {name} | {f('seconds')} | {f('gb_s')} | {f('stream_held_ms', '{:.1f}')} | "
            f"{f('gpu_peak_added_mib', '{:.0f}')} | {f('rss_added_mib', '{:.0f}')} | {'' if extra is None else extra} |"
        )
    lines += ["", "## Collectives and other paths", ""]
    for key in ("collectives", "gloo", "moto"):
        for name, value in results.get(key, {}).items():
            lines.append(f"- {name}: {value}")
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    return "\n".join(lines) + "\n"


def pick_dir(arg: str | None, need: int) -> Path:
    if arg:
        Path(arg).mkdir(parents=True, exist_ok=True)
        return Path(arg)
    for base in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(base) and shutil.disk_usage(base).free > 3 * need + GiB:
            return Path(tempfile.mkdtemp(prefix="dcp_s3-gpu-", dir=base))
    return Path(tempfile.mkdtemp(prefix="dcp_s3-gpu-"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke for the CPU-only parts")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    size = int(args.size_gib * GiB) if cuda else 4 * MiB
    copy_bytes = int(args.copy_gib * GiB) if cuda else 8 * MiB
    root = pick_dir(args.dir, size)
    results: dict[str, Any] = {"environment": environment(device), "dir": str(root), "errors": [], "state_gib": 0.0}

    def attempt(key: str, fn: Callable[[], Any]) -> None:
        try:
            results[key] = fn()
        except Exception as exc:  # one part failing must not hide the others' figures
            results["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    transfer = TransferConfig()
    attempt(
        "copy_rates",
        lambda: {**torch_copy_rates(device, copy_bytes), **dcp_s3_copy_rates(device, copy_bytes, transfer)},
    )
    if cuda:
        torch.cuda.set_device(device)
        piece, count = transfer.max_range_size, transfer.max_concurrency
        attempt("h2d_breakdown", lambda: h2d_breakdown(device, copy_bytes, piece, count))
    rendezvous = Path(tempfile.mkdtemp(dir=root)) / "pg"  # a fresh file: a stale one would hang the rendezvous
    # The default group has a CPU backend (dcp.async_save asserts one); the sync saves, loads and the
    # collectives run on a group of NCCL alone, where collective_device is the GPU.
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo",
        init_method=f"file://{rendezvous}",
        rank=0,
        world_size=1,
        **({"device_id": device} if cuda else {}),
    )
    try:
        group = dist.new_group([0], backend="nccl" if cuda else "gloo")
        sd = make_state(size, device)
        results["state_gib"] = state_bytes(sd) / GiB
        probe = StreamProbe(device)
        with probe.running():
            attempt("save_load", lambda: save_load(sd, root, device, probe, group))
        attempt("collectives", lambda: collectives(root, group))
        if not args.quick:
            attempt("moto", lambda: moto_round_trip(sd))
    finally:
        dist.destroy_process_group()
    if not args.quick:
        attempt("gloo", lambda: two_gloo_ranks(root, device))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    results["seconds"] = time.perf_counter() - t_start
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(results))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    print(out.read_text())
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
