"""Megatron-core 0.16.1 on a GPU, through :mod:`dcp_s3.integrations.megatron` (a part of :mod:`benchmarks.gpu_frameworks`).

CUDA ``ShardedTensor``s (bf16 weights, fp32 optimizer state, a replicated bias), a ``ShardedObject`` and common state,
on a 1-rank NCCL group, saved and loaded back bit-exact: sync, then async scheduled by Megatron's own
``AsyncCallsQueue`` (its forked ``TemporalAsyncCaller``) and by ``AsyncCallsQueue(persistent=True)`` (its spawned
worker, which receives the request, CUDA tensors included, pickled). Nothing of Megatron is patched on a GPU; the
tensors change right after each async save is scheduled (training goes on), and the load must return the values of
when it was scheduled, with nothing committed before the finalize step.

``--cpu-smoke`` runs the same on CPU and gloo, where Megatron's queue needs its two CUDA calls made no-ops (as
``tests/integrations/test_megatron.py`` does) and the persistent worker cannot start (it calls
``torch.cuda.set_device``): that check is recorded as skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import megatron.core
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from benchmarks.gpu_fw_common import Record, init_group, same_state
from dcp_s3._dcp import open_store
from dcp_s3._layout import METADATA_KEY
from dcp_s3.integrations.megatron import load, save

MiB = 1 << 20


def _values(nbytes: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """About ``nbytes`` of tensors on ``device``: bf16 weight (1/3), fp32 exp_avg (2/3), a small fp32 bias."""
    cols = 1024
    rows = max(2, nbytes // (3 * 2 * cols))
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "weight": torch.randn(rows, cols, generator=g, device=device).to(torch.bfloat16),
        "exp_avg": torch.randn(rows, cols, generator=g, device=device),
        "bias": torch.randn(cols, generator=g, device=device),
    }


def _sharded(values: dict[str, torch.Tensor], seed: int | None) -> dict[str, Any]:
    """Megatron's sharded state dict on one rank (``seed`` None: a load's request, without object data)."""
    return {
        "decoder": {
            "weight": ShardedTensor.from_rank_offsets("decoder.weight", values["weight"], (0, 0, 1)),
            "bias": ShardedTensor.from_rank_offsets("decoder.bias", values["bias"], replica_id=0),
        },
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", values["exp_avg"], (1, 0, 1))},
        "rng": ShardedObject("rng_state", None if seed is None else {"seed": seed}, (1,), (0,), replica_id=0),
        **({} if seed is None else {"iteration": seed}),
    }


def _expected(values: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
    return {**{k: v.clone() for k, v in values.items()}, "rng": {"seed": seed}, "iteration": seed}


def _loaded(location: str, like: dict[str, torch.Tensor]) -> tuple[dict[str, Any], str]:
    """Megatron's ``load`` of ``location`` into fresh zero tensors like ``like``; (flat result, devices seen)."""
    request = _sharded({k: torch.zeros_like(v) for k, v in like.items()}, None)
    got = load(request, location)
    flat = {
        "weight": got["decoder"]["weight"],
        "bias": got["decoder"]["bias"],
        "exp_avg": got["optimizer"]["exp_avg"],
        "rng": got["rng"],
        "iteration": got["iteration"],
    }
    devices = sorted({str(v.device) for v in flat.values() if isinstance(v, torch.Tensor)})
    return flat, ",".join(devices)


def _committed(location: str) -> bool:
    return open_store(location).size(METADATA_KEY) is not None


def _cpu_queue_patches() -> None:
    """CPU smoke only: the two CUDA calls of Megatron's queue as no-ops (on a GPU nothing is patched)."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _async_save(rec: Record, name: str, location: str, nbytes: int, device: torch.device, persistent: bool) -> None:
    with rec.check(name) as out:
        seed = 20 + int(persistent)
        values = _values(nbytes, device, seed)
        want = _expected(values, seed)
        calls = AsyncCallsQueue(persistent=persistent)
        try:
            request = save(_sharded(values, seed), location, async_sharded_save=True)
            assert request is not None, "save(async_sharded_save=True) returned no AsyncRequest"
            t0 = time.perf_counter()
            calls.schedule_async_request(request)
            scheduled_s = time.perf_counter() - t0
            for tensor in values.values():  # training goes on: the save holds the values of when it was scheduled
                tensor.add_(1000)
            before = _committed(location)
            calls.maybe_finalize_async_calls(blocking=True)
            finished_s = time.perf_counter() - t0
        finally:
            calls.close()
        got, devices = _loaded(location, values)
        out["ok"] = same_state(got, want) and not before and _committed(location)
        out["note"] = (
            f"{nbytes / MiB:.0f} MiB; schedule returned after {scheduled_s:.2f} s, finalized after {finished_s:.2f} s; "
            f"committed before finalize: {before}; loaded onto {devices}; bit-exact: {same_state(got, want)}"
        )


def run(rec: Record, root: Path, cuda: bool, mib: float) -> None:
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    nbytes = int(mib * MiB)
    rec.fact("megatron-core", megatron.core.__version__)
    init_group(root, cuda, "nccl" if cuda else "gloo")
    try:
        rec.fact("backend", str(dist.get_backend()))
        if not cuda:
            _cpu_queue_patches()
            rec.fact("patched", "torch.cuda.synchronize, torch.cuda.current_device (CPU smoke only)")
        location = str(root / "megatron" / "sync")
        with rec.check("sync save + load, bit-exact") as out:
            values = _values(nbytes, device, seed=10)
            t0 = time.perf_counter()
            save(_sharded(values, 10), location)
            saved_s = time.perf_counter() - t0
            got, devices = _loaded(location, values)
            out["ok"] = same_state(got, _expected(values, 10))
            out["note"] = (
                f"{nbytes / MiB:.0f} MiB; save {saved_s:.2f} s, load {time.perf_counter() - t0 - saved_s:.2f} s; "
                f"loaded onto {devices}"
            )
        _async_save(
            rec, "async: AsyncCallsQueue() (forked worker)", str(root / "megatron" / "async"), nbytes, device, False
        )
        if cuda:
            _async_save(
                rec,
                "async: AsyncCallsQueue(persistent=True) (spawned worker)",
                str(root / "megatron" / "persistent"),
                nbytes,
                device,
                True,
            )
        else:
            rec.skip(
                "async: AsyncCallsQueue(persistent=True) (spawned worker)",
                "needs CUDA: the worker calls torch.cuda.set_device(rank % torch.cuda.device_count())",
            )
    finally:
        dist.destroy_process_group()
