"""Pinned host staging for device (CUDA) tensors: a bounded pool of reused page-locked buffers, and
the order of copies that lets a device→host copy overlap the upload of the chunk before it.

Pageable memory makes the driver copy through a bounce buffer of its own, synchronously with the
calling thread and (for ``Tensor.to("cpu")``) with the current stream: a fraction of what the bus
reaches (roughly 5–10 GB/s against 25–50 GB/s pinned on an H100/H200 host). Here:

* ``PinnedPool`` holds at most ``count`` buffers of ``size`` bytes, allocated on first use by an
  injectable allocator (``torch.empty(..., pin_memory=True)`` on a CUDA host), reused across items and
  saves, dropped by ``close``. ``take`` never waits for another item: a buffer still owned by an item
  is simply not available, and the caller falls back to today's pageable path for that piece (a read
  group can open several pieces before any finishes, so a blocking pool could deadlock). A buffer
  given back with an ``Event`` (its host→device copy still running) is reused only after that event.
  If allocation fails (a container's locked-memory limit, no driver), the pool turns itself off and
  ``warnings.warn`` says so once per process; every later piece takes the pageable path.
* ``SideStream`` is what the ordering needs of CUDA (``wait_current``, ``copy`` returning an
  ``Event``): ``CudaSideStream`` is the thin adapter over ``torch.cuda.Stream``; tests pass a fake that
  records the order of calls. The side stream waits for the work already queued on the current
  (training) stream, never the reverse: the training stream is not blocked by a save or a load.
* ``device_chunks`` yields a device tensor's bytes through the pool, copy of chunk k+1 issued before
  chunk k is handed to the writer (double buffering); the writer copies each chunk into its part
  buffers (``ObjectWriter.write``) before asking for the next, so a buffer is free again then.
* ``Stagings`` (one per writer or reader) makes a ``DeviceStaging`` (a pool and a side stream) per
  CUDA device, at the first CUDA tensor met: CPU tensors never get one, so CPU-only processes take
  exactly the path they took before. Every wait for a queued copy has a deadline (``wait_copy``).

Memory bound (docs/configuration.md, "Memory"): a save holds at most ``2 * files_per_rank * part_size`` pinned bytes
(two buffers per serializer thread) on top of its part buffers; a load at most
``max_concurrency * max_range_size`` (its pageable staging bound, now page-locked instead).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from dcp_s3.errors import DcpS3Error

__all__ = [
    "Event",
    "SideStream",
    "CudaSideStream",
    "PinnedPool",
    "DeviceStaging",
    "device_chunks",
    "Stagings",
    "save_pinned_bound",
    "load_pinned_bound",
    "wait_copy",
    "COPY_TIMEOUT",
]

log = logging.getLogger(__name__)

#: Whether the fallback warning was given in this process (one warning, whatever the number of pools).
_warned = False
_warn_lock = threading.Lock()


#: Longest wait for one queued copy between host and device (a GPU that never finishes one is broken).
COPY_TIMEOUT = 300.0


class Event(Protocol):
    def query(self) -> bool: ...


def wait_copy(event: Event, timeout: float = COPY_TIMEOUT) -> None:
    """Wait until ``event`` (a queued copy) is done, polling with pauses of at most 0.1 ms (under a copy
    of a 16 MiB chunk at PCIe speed), releasing the GIL; ``DcpS3Error`` after ``timeout`` seconds."""
    if event.query():
        return
    deadline = time.monotonic() + timeout
    pause = 0.0
    while not event.query():
        if time.monotonic() > deadline:
            raise DcpS3Error(f"a copy between host and CUDA device did not complete within {timeout:g} s")
        time.sleep(pause)
        pause = min(1e-4, pause + 1e-5)


class SideStream(Protocol):
    def wait_current(self) -> None:
        """Order later copies after the work already queued on the caller's current stream."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue ``dst.copy_(src)`` (non-blocking) on this stream; the event is done when the copy is."""


class CudaSideStream:
    """A side CUDA stream on ``device``: the adapter the ordering logic runs on, on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        #: The training thread's current stream, noted by ``Stagings.begin`` (this thread's is another).
        self.producer: object = None

    def wait_current(self) -> None:
        # The training thread's stream, and this thread's (where a compacting copy of the tensor ran).
        here = torch.cuda.current_stream(self.device)
        producer = self.producer
        if isinstance(producer, torch.cuda.Stream) and producer.device == self.device and producer != here:
            self.stream.wait_stream(producer)
        self.stream.wait_stream(here)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event


def pinned_empty(size: int) -> torch.Tensor:
    """``size`` bytes of page-locked host memory (raises where pinning fails)."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _warn_fallback(error: BaseException) -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"dcp_s3: pinned host memory is unavailable ({type(error).__name__}: {error}); device tensors are "
        "staged through pageable memory, synchronously (slower; check the locked-memory limit, ulimit -l)",
        RuntimeWarning,
        stacklevel=3,
    )


class PinnedPool:
    """At most ``count`` reusable host buffers of ``size`` bytes (uint8 tensors), made by ``allocate``."""

    def __init__(self, count: int, size: int, allocate: Callable[[int], torch.Tensor] = pinned_empty) -> None:
        self.count = count
        self.size = size
        self._allocate = allocate
        self._lock = threading.Lock()
        self._free: list[tuple[torch.Tensor, Event | None]] = []
        self._taken: dict[int, torch.Tensor] = {}  # id -> buffer, for each one handed out and not given back
        self._made = 0  # buffers that exist (free or taken)
        self.disabled = False  # allocation failed once: no more attempts
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._made * self.size

    def take(self, n: int = 1, size: int | None = None) -> list[torch.Tensor]:
        """Up to ``n`` free buffers (fewer, or none, when the others are taken, ``size`` exceeds the
        pool's, or pinning failed). Never waits for another item. A free buffer whose host→device copy
        is still running is taken last: after the idle ones and after new ones while the pool is under
        its count (else every read would wait for the read before it: one copy on the bus at a time);
        then its copy is waited for (``wait_copy``: a queued copy, not another item's work)."""
        if self.disabled or (size is not None and size > self.size):
            return []
        got: list[torch.Tensor] = []
        pending: list[Event] = []
        with self._lock:
            idle: list[int] = []
            for i, (_, event) in enumerate(self._free):
                if len(idle) == n:
                    break
                if event is None or event.query():
                    idle.append(i)
            for i in reversed(idle):
                got.append(self._free.pop(i)[0])
            new = min(n - len(got), self.count - self._made)
            self._made += new
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            while len(got) + new < n and self._free:  # at its count: the oldest busy ones (the likeliest done)
                buf, event = self._free.pop(0)
                got.append(buf)
                if event is not None:
                    pending.append(event)
            self._taken.update((id(b), b) for b in got)
        for event in pending:
            wait_copy(event)
        for i in range(new):
            try:
                buf = self._allocate(self.size)
            except (RuntimeError, OSError, MemoryError) as exc:
                with self._lock:
                    self._made -= new - i
                    self.disabled = True
                log.debug("pinned allocation of %d bytes failed: %r", self.size, exc)
                _warn_fallback(exc)
                break
            with self._lock:
                self._taken[id(buf)] = buf
            got.append(buf)
        return got

    def give_back(self, bufs: list[torch.Tensor], event: Event | None = None) -> None:
        """Return buffers; ``event``: they are still read by a queued copy until it completes.

        Each buffer must be one this pool handed out and not yet got back: another (a buffer given back
        twice would be handed to two takers, each overwriting the other's bytes) is a ``DcpS3Error`` naming
        it, and none of ``bufs`` is taken back then."""
        with self._lock:
            ids = [id(b) for b in bufs]
            for i, buf in enumerate(bufs):
                if self._taken.get(ids[i]) is not buf or ids[i] in ids[:i]:
                    raise DcpS3Error(
                        f"pinned pool of {self.count} x {self.size} bytes: buffer at 0x{buf.data_ptr():x} "
                        f"({buf.numel() * buf.element_size()} bytes) given back but not taken (given back twice?)"
                    )
            for i in ids:
                del self._taken[i]
            self._free.extend((b, event) for b in bufs)

    def drain(self) -> None:
        """Wait for every copy still reading a free buffer."""
        with self._lock:
            pending = [(b, e) for b, e in self._free if e is not None]
            self._free = [(b, None) for b, _ in self._free]
        for _, event in pending:
            wait_copy(event)

    def close(self) -> None:
        """Drop the free buffers (taken ones are dropped when given back after this)."""
        self.drain()
        with self._lock:
            self._made -= len(self._free)
            self._free.clear()


def device_chunks(flat: torch.Tensor, pool: PinnedPool, stream: SideStream) -> Iterator[memoryview] | None:
    """The bytes of ``flat`` (a 1-D uint8 device tensor) as host views, each valid until the next is
    asked for, copied on ``stream`` through two pooled buffers; None when the pool has no buffer (the
    caller then copies as before)."""
    bufs = pool.take(2)
    if not bufs:
        return None
    return _pipelined(flat, bufs, pool, stream)


def _pipelined(
    flat: torch.Tensor, bufs: list[torch.Tensor], pool: PinnedPool, stream: SideStream
) -> Iterator[memoryview]:
    chunk = pool.size
    total = flat.numel()
    starts = list(range(0, total, chunk))
    queued: deque[tuple[torch.Tensor, int, Event]] = deque()

    def issue(k: int) -> None:
        buf, start = bufs[k % len(bufs)], starts[k]
        n = min(chunk, total - start)
        queued.append((buf, n, stream.copy(buf[:n], flat[start : start + n])))

    try:
        stream.wait_current()  # the tensor may still be being written by the training stream
        for k in range(min(len(bufs), len(starts))):
            issue(k)
        for k in range(len(starts)):
            buf, n, event = queued.popleft()
            wait_copy(event)
            yield buf[:n].numpy().data
            # The writer copied chunk k: its buffer takes chunk k + len(bufs), while k + 1 is on its way.
            if k + len(bufs) < len(starts):
                issue(k + len(bufs))
    finally:
        try:
            for _, _, event in queued:  # abandoned (an error downstream): no copy may still write
                wait_copy(event)
        finally:
            pool.give_back(bufs)


class DeviceStaging:
    """A pinned pool and a side stream for one device; ``close`` releases the pool."""

    def __init__(self, pool: PinnedPool, stream: SideStream) -> None:
        self.pool = pool
        self.stream = stream

    def close(self) -> None:
        self.pool.close()


def save_pinned_bound(part_size: int, files_per_rank: int) -> tuple[int, int]:
    """(count, size) of a save's pinned pool: two buffers of a part per serializer thread."""
    return 2 * files_per_rank, part_size


def load_pinned_bound(max_range_size: int, max_concurrency: int) -> tuple[int, int]:
    """(count, size) of a load's pinned pool: one range per concurrent GET."""
    return max_concurrency, max_range_size


class Stagings:
    """The staging of one writer or reader: a ``DeviceStaging`` per CUDA device met, made by ``make``
    (pool size from the memory bound), kept across items and saves until ``close``.

    ``begin`` runs on the thread that called ``write_data``/``read_data`` (the training thread): CUDA's
    current stream is per thread, so that is where the stream producing (or about to use) the tensors is
    found; the serializer and I/O threads copy on a side stream ordered after it."""

    def __init__(
        self, count: int, size: int, make: Callable[[torch.device, int, int, object], DeviceStaging] | None = None
    ) -> None:
        self.count, self.size = count, size
        self._make = make or _cuda_staging
        self._by_device: dict[torch.device, DeviceStaging] = {}
        self._lock = threading.Lock()
        self._producer: object = None

    def __getstate__(self) -> dict[str, object]:
        return {"count": self.count, "size": self.size}  # a copy (an async save's process) starts empty

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["count"], state["size"])  # type: ignore[misc, arg-type]

    def begin(self) -> None:
        """Note the caller's current CUDA stream (only where CUDA is already in use: never initialises it)."""
        self._producer = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._producer = torch.cuda.current_stream()
        for staging in self._by_device.values():
            staging.stream.producer = self._producer  # type: ignore[attr-defined]

    def get(self, tensor: torch.Tensor) -> DeviceStaging | None:
        """The staging for ``tensor``: None unless it is a CUDA tensor (every other tensor takes the path
        it always took)."""
        if not tensor.is_cuda:
            return None
        with self._lock:
            staging = self._by_device.get(tensor.device)
            if staging is None:
                staging = self._by_device[tensor.device] = self._make(
                    tensor.device, self.count, self.size, self._producer
                )
            return staging

    def all(self) -> list[DeviceStaging]:
        with self._lock:
            return list(self._by_device.values())

    def wait_current(self) -> None:
        """Order the side streams' copies after what the caller queued so far (its destinations' allocation)."""
        for staging in self.all():
            staging.stream.wait_current()

    def drain(self) -> None:
        """Wait for every queued copy (before DCP sees a tensor a load filled)."""
        for staging in self.all():
            staging.pool.drain()

    def close(self) -> None:
        """Release every pinned buffer (a later save or load makes new ones)."""
        with self._lock:
            stagings, self._by_device = list(self._by_device.values()), {}
        for staging in stagings:
            staging.close()
        if any(isinstance(s.stream, CudaSideStream) for s in stagings):
            # torch keeps freed pinned blocks cached for reuse: hand them back to the system (a public
            # call where torch has it, torch.accelerator.empty_host_cache; older releases keep the cache).
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if empty is not None:
                empty()


def _cuda_staging(device: torch.device, count: int, size: int, producer: object) -> DeviceStaging:
    stream = CudaSideStream(device)
    stream.producer = producer
    return DeviceStaging(PinnedPool(count, size), stream)
