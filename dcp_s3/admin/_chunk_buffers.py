"""The chunk buffers of a streaming copy (:mod:`dcp_s3.admin._streaming`): at most ``count`` buffers of
``size`` bytes, each allocated once (on first need) and reused for chunk after chunk.

Why a pool and not a fresh tensor per chunk: a writer sends a chunk's bytes from the chunk's own memory
(``ObjectWriter.write_stable`` borrows views of at least 256 KiB until their part is uploaded), so up to
``parts in flight × part size`` bytes of chunks are alive at once, and each chunk is freed on an upload
thread. glibc then keeps freed chunks of 32 MiB in its heap (its mmap threshold rises to the largest chunk
freed), and the process's RSS grows past what is ever held at once (+160 MiB of a 353 MiB figure, measured).
A pool allocated once holds its bytes whatever the allocator does.

When is a buffer free again: when nothing refers to its memory any more. Each lease is a NumPy view of the
buffer handed to ``torch.from_numpy``: the tensor's storage keeps the view alive, and so do every view of
that tensor and every ``memoryview`` of them a writer borrows; a finalizer on the view gives the buffer back
once the last of them is gone. No writer needs to say when it is done.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import torch

__all__ = ["ChunkBuffers"]

logger = logging.getLogger(__name__)

#: Seconds ``take`` waits for a buffer before it collects garbage and, if still none is free, allocates one
#: past ``count`` (and logs a warning): liveness over the bound if a writer holds more than it was sized for.
STALL_SECONDS = 60.0


class ChunkBuffers:
    """``count`` reusable buffers of ``size`` bytes (a chunk larger than ``size`` gets a buffer of its own
    size, reused as the others). ``take`` waits while every buffer is leased. ``peak_bytes``: the most
    bytes of buffers that existed at once; ``made``: buffers allocated."""

    def __init__(self, count: int, size: int, *, stall_seconds: float = STALL_SECONDS) -> None:
        self.count, self.size, self.stall_seconds = max(1, count), size, stall_seconds
        self._free: list[torch.Tensor] = []
        self._leased = 0
        self._held = 0  # bytes of every buffer that exists
        self.peak_bytes = 0
        self.made = 0
        self._cond = threading.Condition()

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor of ``shape`` and ``dtype`` in one of the pool's buffers (its bytes are left as they
        were): the buffer is the pool's again once nothing refers to the tensor's memory."""
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        buf = self._acquire(nbytes)
        lease = buf.numpy()[:nbytes]
        weakref.finalize(lease, self._give_back, buf)
        tensor = torch.from_numpy(lease)
        del lease  # the tensor's storage holds it now
        return tensor.view(dtype).view(shape)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        with self._cond:
            full = not self._free and self._leased >= self.count
            if full and not self._cond.wait_for(lambda: bool(self._free), timeout=self.stall_seconds):
                self._cond.release()
                try:
                    gc.collect()  # views held only by a reference cycle
                finally:
                    self._cond.acquire()
                if not self._free:
                    logger.warning(
                        "streaming copy: all %d chunk buffers still held by the writer after %.0f s; "
                        "allocating one more",
                        self.count,
                        self.stall_seconds,
                    )
            self._leased += 1
            if self._free:
                buf = self._free.pop()
                if buf.numel() >= nbytes:
                    return buf
                self._held -= buf.numel()  # too small for this chunk: dropped
            need = max(nbytes, self.size)
            self._held += need
            self.peak_bytes = max(self.peak_bytes, self._held)
            self.made += 1
        return torch.empty(need, dtype=torch.uint8)

    def _give_back(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._leased -= 1
            self._free.append(buf)
            self._cond.notify()
