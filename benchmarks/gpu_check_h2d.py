"""Where a load's host→device copies lose against torch's one pinned ``copy_`` (benchmarks/gpu_check.py).

The same bytes (``nbytes``, in pieces of ``piece`` bytes) copied host→device five ways, each timed from the first
copy to the device's last (best of three):

* ``one_buffer``: slices of one pinned buffer, queued on a side stream: the cost of cutting the copy in pieces;
* ``pool_events``: ``count`` pinned buffers in turn, each reused after its copy's event: the pool's order;
* ``side_stream``: the same through ``CudaSideStream.copy`` and ``PinnedPool`` (dcp_s3's objects, no reader);
* ``staged_rows``: ``StagedRows`` as the reader opens and finishes them (the ``dcp_s3_h2d`` figure);
* ``staged_rows_4x``: the same with pieces (and pool buffers) four times larger.

With each: the host CPU microseconds per piece spent queueing a copy (a copy that blocks the host shows as
about the piece's time on the bus) and in ``StagedRows.open`` (the wait for a free buffer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dcp_s3._dcp.staging import CudaSideStream, DeviceStaging, PinnedPool, wait_copy
from dcp_s3._dcp.tensor_bytes import StagedRows


class RowsRequest:
    """What ``StagedRows`` reads of a ReadItem: the offsets and lengths of a 1-D whole read."""

    def __init__(self, n: int) -> None:
        self.storage_offsets = [0]
        self.lengths = [n]


def _timed(fn: Callable[[dict[str, float]], None], device: torch.device, nbytes: int, pieces: int) -> dict[str, Any]:
    spent: dict[str, float] = {}
    fn(spent)  # warm-up: allocations, first pinning
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        spent.clear()
        t0 = time.perf_counter()
        fn(spent)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    out: dict[str, Any] = {"GB/s": nbytes / best / 1e9}
    out.update({f"{k} us/piece": v / pieces * 1e6 for k, v in spent.items()})
    return out


def h2d_breakdown(device: torch.device, nbytes: int, piece: int, count: int) -> dict[str, dict[str, Any]]:
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    starts = list(range(0, nbytes, piece))
    stream = torch.cuda.Stream(device=device)
    out: dict[str, dict[str, Any]] = {}

    def one_buffer(spent: dict[str, float]) -> None:
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            for s in starts:
                dest[s : s + piece].copy_(host[s : s + piece], non_blocking=True)
        spent["queue"] = time.perf_counter() - t

    out["one_buffer"] = _timed(one_buffer, device, nbytes, len(starts))

    bufs = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    events: list[Any] = [None] * count

    def pool_events(spent: dict[str, float]) -> None:
        queue = wait = 0.0
        for k, s in enumerate(starts):
            i = k % count
            t = time.perf_counter()
            if events[i] is not None:
                wait_copy(events[i])
            t1 = time.perf_counter()
            n = min(piece, nbytes - s)
            with torch.cuda.stream(stream):
                dest[s : s + n].copy_(bufs[i][:n], non_blocking=True)
                events[i] = torch.cuda.Event()
                events[i].record(stream)
            t2 = time.perf_counter()
            wait, queue = wait + t1 - t, queue + t2 - t1
        spent["wait"], spent["queue"] = wait, queue

    out["pool_events"] = _timed(pool_events, device, nbytes, len(starts))
    side = CudaSideStream(device)
    pool = PinnedPool(count, piece)

    def side_stream(spent: dict[str, float]) -> None:
        queue = wait = 0.0
        for s in starts:
            t = time.perf_counter()
            got = pool.take(1)
            t1 = time.perf_counter()
            n = min(piece, nbytes - s)
            event = side.copy(dest[s : s + n], got[0][:n])
            pool.give_back(got, event)
            t2 = time.perf_counter()
            wait, queue = wait + t1 - t, queue + t2 - t1
        pool.drain()
        spent["take"], spent["queue"] = wait, queue

    out["side_stream"] = _timed(side_stream, device, nbytes, len(starts))
    pool.close()
    for name, size in (("staged_rows", piece), ("staged_rows_4x", 4 * piece)):
        out[name] = _staged_rows(device, dest, nbytes, size, count)
    return out


def _staged_rows(device: torch.device, dest: torch.Tensor, nbytes: int, piece: int, count: int) -> dict[str, Any]:
    staging = DeviceStaging(PinnedPool(count, piece), CudaSideStream(device))
    starts = list(range(0, nbytes, piece))
    req = RowsRequest(nbytes)

    def rows(spent: dict[str, float]) -> None:
        opened = done = 0.0
        staging.stream.wait_current()
        for s in starts:
            n = min(piece, nbytes - s)
            row = StagedRows(dest, torch.Size([nbytes]), torch.uint8, req, s, n, staging)  # type: ignore[arg-type]
            t = time.perf_counter()
            row.open()  # (the network fills it here)
            t1 = time.perf_counter()
            row.done()
            t2 = time.perf_counter()
            opened, done = opened + t1 - t, done + t2 - t1
        staging.pool.drain()
        spent["open"], spent["done"] = opened, done

    try:
        return _timed(rows, device, nbytes, len(starts))
    finally:
        staging.close()
