"""Run a function on N real ranks (processes, gloo) and collect results."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as exc:  # report every failure, including CheckpointException
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    # Deliver the result before tearing gloo down: torch 2.7's ProcessGroupGloo destructor can
    # deadlock (it joins a worker thread that waits for the GIL to free a tensor), and
    # run_ranks kills a rank that is still alive 30 s after its result arrived.
    queue.close()
    queue.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    ``fn`` must be a module-level function (it is pickled). Returns the per-rank
    results in rank order; raises ``AssertionError`` with every rank's traceback
    if any rank failed.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(errors.items())))
    return [results[r][1] for r in range(world_size)]


def full(value: Any) -> Any:
    """``value`` with every DTensor gathered to a full tensor (and every tensor cloned), recursively."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full(v) for v in value]
    return value
