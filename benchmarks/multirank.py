"""Multi-rank saves and loads, resharding 2 -> 1, and trainable-only saves of a LoRA-like model.

    python -m benchmarks.multirank                          # 256 MiB, 2 reps, SeaweedFS (~6 min on 2 cores)
    python -m benchmarks.multirank --size-mib 64 --reps 1 --contestants dcp_s3,naive

Three workloads on one loopback SeaweedFS (or ``--endpoint-url``), each measurement in
fresh processes, contestants interleaved per repetition:

1. **2-rank save and load**: the transformer training state (``common.make_workload``)
   row-sharded over 2 real ranks (torch.multiprocessing spawn, gloo): every tensor with a
   dimension is a ``DTensor`` with ``Shard(0)`` on a 2-rank CPU ``DeviceMesh``, built with
   ``DTensor.from_local`` from this rank's rows (what FSDP2's ``fully_shard`` holds);
   AdamW's scalar ``step`` tensors and the non-tensor values are replicated plain values,
   which DCP writes once. Each rank times ``dcp.save``/``dcp.load`` after a barrier;
   the run's time is the slower rank's.
2. **Resharding load 2 -> 1**: one process loads the 2-rank checkpoint into full tensors
   (``benchmarks.worker``'s ``load``, ``no_dist=True``).
3. **Trainable-only save**: a LoRA-like model (frozen bf16 base weights, trainable fp32
   ``lora_a``/``lora_b`` adapters) saved in one process with dcp_s3 +
   ``TrainableOnlySavePlanner``, dcp_s3 with ``DefaultSavePlanner``, and the best
   alternative (fastest 2-rank save above, unless ``--lora-alternative``) with its default.

Bytes and requests are SeaweedFS' per-bucket counters read around each job; bytes stored
and objects come from listing the checkpoint's prefix. Medians of ``--reps``; writes
``results/multirank.json`` (every run) and ``results/multirank.md``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import queue
import signal
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402
from benchmarks.contestants import Target, get  # noqa: E402

WORLD = 2
DEFAULT_CONTESTANTS = ["dcp_s3", "fsspec_s3fs", "s3torchconnector", "naive"]
TRAINABLE_ONLY = "dcp_s3 + TrainableOnlySavePlanner"
JOB_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------------------------
# Rank side (runs in spawned processes).
# --------------------------------------------------------------------------------------------
def _use_env(env: dict[str, str]) -> None:
    """The same client environment ``common.run_child`` gives a worker."""
    os.environ.update(env)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    os.environ.pop("AWS_PROFILE", None)


def _row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """This rank's rows under ``Shard(0)`` (torch.chunk sizes: ceil(rows / world), the last may be short)."""
    chunk = math.ceil(rows / world)
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


def sharded_state_dict(workload: common.Workload, mesh: Any, *, fill: str) -> dict[str, Any]:
    """Row-sharded DTensors for every tensor with a dimension, plain replicated scalars and extras.

    ``fill="random"``: this rank's rows of ``common.fill_tensor`` (same bits as the 1-process
    workload, so a resharded load verifies against it); ``fill="zeros"``: resident zeros.
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard

    rank, world = mesh.get_local_rank(), mesh.size()
    sd: dict[str, Any] = {}
    for i, spec in enumerate(workload.tensors):
        dtype = common._torch_dtype(spec.dtype)
        if not spec.shape:
            t = common.fill_tensor(spec, i) if fill == "random" else torch.zeros((), dtype=dtype)
            sd[spec.key] = t
            continue
        lo, hi = _row_range(spec.shape[0], rank, world)
        if fill == "random":
            local = common.fill_tensor(spec, i)[lo:hi].clone()
        else:
            local = torch.empty((hi - lo, *spec.shape[1:]), dtype=dtype)
            local.view(common._int_dtype(dtype)).fill_(0)
        sd[spec.key] = DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(spec.shape),
            stride=_contiguous_stride(spec.shape),
        )
    sd.update(workload.extras)
    return sd


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def verify_shards(workload: common.Workload, sd: dict[str, Any], rank: int, world: int, sample: int = 6) -> bool:
    """Bit-compare this rank's rows of a sample of loaded tensors with their expected content."""
    import torch
    from torch.distributed.tensor import DTensor

    specs = [(i, s) for i, s in enumerate(workload.tensors) if s.shape]
    step = max(1, len(specs) // sample)
    for i, spec in specs[::step][:sample] + [specs[-1]]:
        got = sd[spec.key]
        got = got.to_local() if isinstance(got, DTensor) else got
        lo, hi = _row_range(spec.shape[0], rank, world)
        want = common.fill_tensor(spec, i)[lo:hi]
        it = common._int_dtype(want.dtype)
        if not torch.equal(got.view(it), want.view(it)):
            return False
    return True


def lora_model(size_mib: int, rank: int = 8, d: int = 2048) -> Any:
    """``size_mib`` of frozen bf16 ``d x d`` base weights, each with trainable fp32 rank-``rank`` adapters.

    Built on the meta device, then materialized with random bits (no initializer cost);
    the default (``rank=8``, ``d=2048``) adapters are 1.6% of the base's bytes.
    """
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(d, d, bias=False, dtype=torch.bfloat16)
            self.base.weight.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.empty(rank, d))
            self.lora_b = nn.Parameter(torch.empty(d, rank))

    n_layers = max(1, size_mib * common.MiB // (d * d * 2))
    with torch.device("meta"):
        model = nn.ModuleDict({"layers": nn.ModuleList(LoRALinear() for _ in range(n_layers))})
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.view(common._int_dtype(p.dtype)).random_(generator=gen)
    return model


def _rank_job(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's part of a measurement: build the state, then time one ``dcp.save``/``dcp.load``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks.worker import _preimport

    contestant = get(spec["contestant"])
    _preimport(contestant.name)
    target = Target(**spec["target"])
    op = spec["op"]
    planner = None
    workload: common.Workload | None = None
    if op == "lora_save":
        model = lora_model(int(spec["size_mib"]), int(spec["lora_rank"]))
        sd: dict[str, Any] = dict(model.state_dict())
        logical = sum(t.numel() * t.element_size() for t in sd.values())
        if spec.get("trainable_only"):
            from dcp_s3 import TrainableOnlySavePlanner

            planner = TrainableOnlySavePlanner(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        workload = common.make_workload("transformer", int(spec["size_mib"]))
        mesh = init_device_mesh("cpu", (world,))
        sd = sharded_state_dict(workload, mesh, fill="random" if op == "save" else "zeros")
        logical = workload.nbytes
    distributed = dist.is_initialized()
    gc.collect()
    gc.disable()  # no collector pauses inside the timed block
    if distributed:
        dist.barrier()
    cpu0 = common.cpu_seconds()
    with common.PeakRSS() as rss:
        t0 = time.perf_counter()
        if op == "load":
            dcp.load(sd, storage_reader=contestant.reader(target), no_dist=not distributed)
        else:
            dcp.save(sd, storage_writer=contestant.writer(target), planner=planner, no_dist=not distributed)
        seconds = time.perf_counter() - t0
    cpu = common.cpu_seconds() - cpu0
    gc.enable()
    verified = verify_shards(workload, sd, rank, world) if workload is not None and op == "load" else None
    return {
        "rank": rank,
        "seconds": seconds,
        "logical_bytes": logical,
        "cpu_s": cpu,
        "peak_rss_growth_mib": rss.growth / common.MiB,
        "verified": verified,
    }


def _rank_entry(rank: int, world: int, port: int, spec: dict[str, Any], env: dict[str, str], out: Any) -> None:
    """Spawned process: join the gloo group (when ``world`` > 1), run ``_rank_job``, report on ``out``."""
    _use_env(env)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # the 1-process LoRA saves
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        import torch.distributed as dist

        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            result = _rank_job(rank, world, spec)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException as exc:  # report every failure to the parent
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


# --------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    spec: dict[str, Any], world: int, env: dict[str, str], timeout: float = JOB_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Run one measurement on ``world`` fresh spawned processes; every rank's result, or ``RuntimeError``.

    The processes are killed on any failure, timeout or interrupt, so none outlives the call.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, spec, env, out), daemon=True) for r in range(world)]
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < world:
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:  # e.g. killed by the OOM killer: it never reports
                    errors.append(f"a rank exited with code {dead[0].exitcode} without reporting")
                    break
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f} s")
                    break
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
                break  # the other ranks may wait forever in a collective
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 2)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
    if errors:
        raise RuntimeError("; ".join(errors))
    return [results[r] for r in range(world)]


def _requests(srv: dict[str, float] | None) -> float | None:
    return sum(v for k, v in srv.items() if k.isupper()) if srv else None


def _stored(endpoint: common.Endpoint, bucket: str, prefix: str) -> tuple[int, int]:
    """(bytes, objects) under ``prefix``."""
    pages = endpoint.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    objs = [o for page in pages for o in page.get("Contents", [])]
    return sum(int(o["Size"]) for o in objs), len(objs)


class Bench:
    """Owns the endpoint, the bucket and every run's raw result."""

    def __init__(self, endpoint: common.Endpoint, args: argparse.Namespace) -> None:
        self.endpoint, self.args = endpoint, args
        self.bucket = endpoint.create_bucket(common.new_bucket_name("multirank"))
        self.runs: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def target(self, prefix: str) -> dict[str, str]:
        return {
            "bucket": self.bucket,
            "prefix": prefix,
            "endpoint_url": self.endpoint.endpoint_url,
            "region": self.endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1"),
            "local_dir": "/nonexistent",
        }

    def record(self, name: str, op: str, res: dict[str, Any]) -> dict[str, Any]:
        self.runs.setdefault(name, {}).setdefault(op, []).append(res)
        return res

    def ranks(self, name: str, op: str, spec: dict[str, Any], world: int) -> dict[str, Any]:
        """A measurement on ``world`` ranks, summarized over ranks (time and RSS of the worst rank)."""
        before = self.endpoint.counters(self.bucket)
        try:
            per_rank = run_ranks(spec, world, self.endpoint.env)
        except RuntimeError as exc:
            res = {"ok": False, "error": str(exc)[:3000]}
        else:
            secs = max(r["seconds"] for r in per_rank)
            logical = (
                per_rank[0]["logical_bytes"]
                if spec["op"] == "lora_save"
                else common.make_workload("transformer", int(spec["size_mib"])).nbytes
            )
            res = {
                "ok": True,
                "seconds": secs,
                "logical_bytes": logical,
                "gbps": logical / secs / 1e9,
                "peak_rss_growth_mib": max(r["peak_rss_growth_mib"] for r in per_rank),
                "cpu_s": sum(r["cpu_s"] for r in per_rank),
                "verified": None if spec["op"] != "load" else all(r["verified"] for r in per_rank),
                "per_rank": per_rank,
            }
        res["server"] = common.counter_delta(before, self.endpoint.counters(self.bucket))
        return self.record(name, op, res)

    def reshard_load(self, name: str, target: dict[str, str]) -> dict[str, Any]:
        """Load the 2-rank checkpoint into full tensors in one fresh process (``benchmarks.worker``)."""
        before = self.endpoint.counters(self.bucket)
        res = common.run_child(
            {
                "contestant": name,
                "op": "load",
                "workload": "transformer",
                "size_mib": self.args.size_mib,
                "target": target,
            },
            self.endpoint.env,
        )
        res["server"] = common.counter_delta(before, self.endpoint.counters(self.bucket))
        return self.record(name, "reshard_load", res)

    def cleanup(self, prefix: str) -> None:
        try:
            self.endpoint.delete_prefix(self.bucket, prefix + "/")
        except Exception as exc:  # cleanup only
            print(f"  (could not delete {prefix}: {exc})", flush=True)


def _show(rep: int, name: str, op: str, res: dict[str, Any]) -> None:
    if not res.get("ok"):
        print(f"  rep {rep} {name:>34} {op:>12}: FAILED {str(res.get('error'))[:600]}", flush=True)
        return
    srv = res.get("server") or {}
    extra = f"  stored {res['stored_bytes'] / 1e6:.1f} MB in {res['objects']} objects" if "objects" in res else ""
    print(
        f"  rep {rep} {name:>34} {op:>12}: {res['seconds']:6.2f} s  {res.get('gbps') or 0:.3f} GB/s  "
        f"server sent {srv.get('sent', 0) / 1e6:.1f} MB, received {srv.get('received', 0) / 1e6:.1f} MB, "
        f"{_requests(srv) or 0:.0f} req{extra}" + ("" if res.get("verified") in (None, True) else "  VERIFY FAILED"),
        flush=True,
    )


def multirank_round(bench: Bench, name: str, rep: int) -> str | None:
    """2-rank save, 2-rank load, 1-process load of one contestant; a skip reason, or None."""
    reason = get(name).unavailable()
    if reason:
        return reason
    prefix = f"multirank/{name}/rep{rep}"
    target = bench.target(prefix)
    spec = {"contestant": name, "size_mib": bench.args.size_mib, "target": target}
    try:
        res = bench.ranks(name, "save", {**spec, "op": "save"}, WORLD)
        res["stored_bytes"], res["objects"] = _stored(bench.endpoint, bench.bucket, prefix)
        _show(rep, name, "2-rank save", res)
        if not res["ok"]:
            return None
        _show(rep, name, "2-rank load", bench.ranks(name, "load", {**spec, "op": "load"}, WORLD))
        _show(rep, name, "load 2 -> 1", bench.reshard_load(name, target))
    finally:
        bench.cleanup(prefix)
    return None


def lora_round(bench: Bench, label: str, contestant: str, trainable_only: bool, rep: int) -> None:
    prefix = f"lora/{contestant}{'_trainable' if trainable_only else ''}/rep{rep}"
    spec = {
        "contestant": contestant,
        "op": "lora_save",
        "size_mib": bench.args.lora_size_mib,
        "lora_rank": bench.args.lora_rank,
        "trainable_only": trainable_only,
        "target": bench.target(prefix),
    }
    try:
        res = bench.ranks(label, "lora_save", spec, 1)
        res["stored_bytes"], res["objects"] = _stored(bench.endpoint, bench.bucket, prefix)
        _show(rep, label, "save", res)
    finally:
        bench.cleanup(prefix)


# --------------------------------------------------------------------------------------------
# Summaries and tables.
# --------------------------------------------------------------------------------------------
def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r.get("ok")]
    failures = [r.get("error") for r in results if not r.get("ok")]
    if not ok:
        return {"n": 0, "failures": failures}
    srv = [r.get("server") or {} for r in ok]
    m = common.median
    return {
        "n": len(ok),
        "seconds": m([r["seconds"] for r in ok]),
        "gbps": m([r.get("gbps") for r in ok]),
        "logical_bytes": ok[0]["logical_bytes"],
        "peak_rss_growth_mib": m([r.get("peak_rss_growth_mib") for r in ok]),
        "server_sent": m([s.get("sent") for s in srv]),
        "server_received": m([s.get("received") for s in srv]),
        "requests": m([_requests(s) for s in srv]),
        "put_requests": m([s.get("PUT") for s in srv]),
        "get_requests": m([s.get("GET") for s in srv]),
        "stored_bytes": m([r.get("stored_bytes") for r in ok]),
        "objects": m([r.get("objects") for r in ok]),
        "verified": all(r.get("verified") in (None, True) for r in ok),
        "failures": failures,
    }


def _mb(v: float | None) -> str:
    return common.fmt(v / 1e6 if v is not None else None, 1)


def _ratio(s: dict[str, Any]) -> str:
    """Server bytes sent / tensor bytes loaded."""
    sent, logical = s.get("server_sent"), s.get("logical_bytes")
    return common.fmt(sent / logical if sent is not None and logical else None, 2)


def render_tables(
    summary: dict[str, dict[str, Any]],
    lora: dict[str, dict[str, Any]],
    workload: common.Workload,
    args: argparse.Namespace,
    lora_desc: str,
) -> str:
    f = common.fmt
    names = list(summary)
    rows = []
    for n in names:
        s, ld = summary[n].get("save", {}), summary[n].get("load", {})
        rows.append(
            [
                n,
                f(s.get("seconds")),
                f(s.get("gbps"), 3),
                f(ld.get("seconds")),
                f(ld.get("gbps"), 3),
                f(s.get("requests"), 0),
                _mb(s.get("server_received")),
                f(s.get("objects"), 0),
                f(ld.get("requests"), 0),
                _mb(ld.get("server_sent")),
                _ratio(ld),
                f(s.get("peak_rss_growth_mib"), 0),
                f(ld.get("peak_rss_growth_mib"), 0),
                "yes" if ld.get("verified") and ld.get("n") else "—",
            ]
        )
    t1 = common.markdown_table(
        [
            "contestant",
            "save s",
            "save GB/s",
            "load s",
            "load GB/s",
            "save requests",
            "save MB received",
            "objects",
            "load requests",
            "load MB sent",
            "load read / needed",
            "save RSS +MiB (worst rank)",
            "load RSS +MiB (worst rank)",
            "load verified",
        ],
        rows,
    )
    rows = []
    for n in names:
        r = summary[n].get("reshard_load", {})
        rows.append(
            [
                n,
                f(r.get("seconds")),
                f(r.get("gbps"), 3),
                _mb(r.get("server_sent")),
                _ratio(r),
                f(r.get("requests"), 0),
                f(r.get("peak_rss_growth_mib"), 0),
                "yes" if r.get("verified") and r.get("n") else "—",
            ]
        )
    t2 = common.markdown_table(
        ["contestant", "load s", "load GB/s", "MB read", "read / needed", "requests", "RSS +MiB", "verified"], rows
    )
    base = lora.get(TRAINABLE_ONLY, {})
    rows = []
    for label, s in lora.items():
        secs, stored = s.get("seconds"), s.get("stored_bytes")
        rows.append(
            [
                label,
                f(secs),
                _mb(stored),
                f(s.get("objects"), 0),
                f(s.get("requests"), 0),
                _mb(s.get("server_received")),
                f(secs / base["seconds"], 1) + "x" if secs and base.get("seconds") else "—",
                f(stored / base["stored_bytes"], 0) + "x" if stored and base.get("stored_bytes") else "—",
            ]
        )
    t3 = common.markdown_table(
        [
            "variant",
            "save s",
            "MB stored",
            "objects",
            "requests",
            "MB received by server",
            "s vs trainable-only",
            "bytes vs trainable-only",
        ],
        rows,
    )
    server = "external S3" if args.endpoint_url else args.server
    return "\n".join(
        [
            f"Server: {server}; median of {args.reps} runs, each in fresh processes; GB = 1e9 bytes of tensor data.",
            "",
            f"**2-rank save and load** of {workload.nbytes / common.MiB:.0f} MiB ({workload.description}), every "
            "tensor with a dimension row-sharded (DTensor `Shard(0)` on a 2-rank CPU mesh, gloo), scalars and "
            "extras replicated; time = slower rank; requests and bytes from the server's counters:",
            "",
            t1,
            "",
            "**Resharding load 2 -> 1**: the 2-rank checkpoint loaded into full tensors by one process "
            "(`dcp.load(..., no_dist=True)`); MB read = server's bytes sent, needed = tensor bytes:",
            "",
            t2,
            "",
            f"**Trainable-only save** of a LoRA-like model, one process: {lora_desc}:",
            "",
            t3,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256, help="transformer state, all ranks together (default 256)")
    ap.add_argument("--lora-size-mib", type=int, default=256, help="frozen base weights of the LoRA model (256)")
    ap.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (default 8: adapters 1.6%% of the base)")
    ap.add_argument(
        "--lora-alternative",
        default="auto",
        help="contestant for the LoRA comparison (default: the fastest non-dcp_s3 2-rank save)",
    )
    ap.add_argument("--reps", type=int, default=2, help="repetitions; medians are reported (default 2)")
    ap.add_argument(
        "--contestants",
        default=",".join(DEFAULT_CONTESTANTS),
        help=f"comma-separated DCP contestants (default {','.join(DEFAULT_CONTESTANTS)})",
    )
    ap.add_argument("--server", choices=list(servers.KINDS), default="seaweedfs")
    ap.add_argument("--endpoint-url", help="use this S3 endpoint instead of starting a server")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "multirank.json")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the server and the ranks

    names = [n.strip() for n in args.contestants.split(",") if n.strip()]
    for n in names:
        if get(n).writer is None:
            raise SystemExit(f"{n!r} has no DCP writer/reader factory (see benchmarks/contestants)")
    workload = common.make_workload("transformer", args.size_mib)
    n_layers = max(1, args.lora_size_mib * common.MiB // (2048 * 2048 * 2))  # as lora_model builds it
    adapter_bytes = n_layers * 2 * 2048 * args.lora_rank * 4
    base_bytes = n_layers * 2048 * 2048 * 2
    lora_desc = (
        f"{n_layers} frozen bf16 2048x2048 base weights ({base_bytes / common.MiB:.0f} MiB) + fp32 "
        f"rank-{args.lora_rank} adapters ({adapter_bytes / common.MiB:.1f} MiB, "
        f"{100 * adapter_bytes / base_bytes:.1f}% of the base)"
    )
    print(f"workload: {workload.description}; {workload.nbytes / common.MiB:.0f} MiB on {WORLD} ranks", flush=True)
    print(f"LoRA: {lora_desc}", flush=True)

    info = common.machine_info()
    t_start = time.time()
    skipped: dict[str, str] = {}
    lora_labels: dict[str, tuple[str, bool]] = {}
    endpoint = common.open_endpoint(args.server, args.endpoint_url)
    try:
        bench = Bench(endpoint, args)
        for rep in range(args.reps):
            for name in names:
                if name not in skipped and (why := multirank_round(bench, name, rep)):
                    skipped[name] = why
                    print(f"  {name}: skipped — {why}", flush=True)
        alt = args.lora_alternative
        if alt == "auto":
            saves = {
                n: summarize(bench.runs.get(n, {}).get("save", [])).get("seconds")
                for n in names
                if not n.startswith("dcp_s3")
            }
            timed = {n: s for n, s in saves.items() if s is not None}
            alt = min(timed, key=lambda n: timed[n]) if timed else "s3torchconnector"
        lora_labels = {
            TRAINABLE_ONLY: ("dcp_s3", True),
            "dcp_s3 (DefaultSavePlanner)": ("dcp_s3", False),
            f"{alt} (DefaultSavePlanner)": (alt, False),
        }
        if why := get(alt).unavailable():
            print(f"  LoRA alternative {alt}: skipped — {why}", flush=True)
            lora_labels.pop(f"{alt} (DefaultSavePlanner)")
        for rep in range(args.reps):
            for label, (contestant, trainable_only) in lora_labels.items():
                lora_round(bench, label, contestant, trainable_only, rep)
    finally:
        endpoint.stop()

    summary = {n: {op: summarize(rs) for op, rs in bench.runs.get(n, {}).items()} for n in names if n not in skipped}
    lora = {label: summarize(bench.runs.get(label, {}).get("lora_save", [])) for label in lora_labels}
    tables = render_tables(summary, lora, workload, args, lora_desc)
    print()
    print(tables)
    for n, why in skipped.items():
        print(f"\nskipped {n}: {why}")
    payload = {
        "benchmark": "multirank",
        "workload": workload.description,
        "size_mib": args.size_mib,
        "world_size": WORLD,
        "lora": lora_desc,
        "reps": args.reps,
        "server": "external" if args.endpoint_url else args.server,
        "machine": info,
        "elapsed_s": time.time() - t_start,
        "skipped": skipped,
        "summary": summary,
        "lora_summary": lora,
        "runs": bench.runs,
        "tables_markdown": tables,
    }
    common.write_json(args.out, payload)
    args.out.with_suffix(".md").write_text(tables + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')} in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
