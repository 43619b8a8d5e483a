"""Part buffers: the memory bound of uploads, and the part-size rule that keeps objects under S3's part limit."""

from __future__ import annotations

import threading

__all__ = ["BufferPool", "fit_part_size", "MAX_PARTS", "MIN_PART_SIZE"]

#: S3 limits: at most 10,000 parts per multipart upload, parts of at least 5 MiB (but the last).
MAX_PARTS = 10_000
MIN_PART_SIZE = 5 << 20


def fit_part_size(part_size: int, expected_size: int | None) -> int:
    """The part size to use so an object of ``expected_size`` bytes needs at most 10,000 parts."""
    size = max(part_size, MIN_PART_SIZE)
    if expected_size is not None:
        while -(-expected_size // size) > MAX_PARTS:
            size *= 2
    return size


class BufferPool:
    """A fixed number of reusable part buffers; ``acquire`` blocks while all are in use.

    This is the memory bound of uploads: at most ``count`` buffers exist at once, each of
    the pool's ``size`` or of the (enlarged) part size asked for, so the bytes held never
    exceed ``count * largest part size`` (``peak_bytes`` records the most held at once).
    Buffers are allocated on first use and dropped by ``clear``.
    """

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size
        self._free: list[bytearray] = []
        self._available = threading.Semaphore(count)
        self._lock = threading.Lock()
        self._held = 0  # bytes of every buffer that exists (in use or free)
        self.peak_bytes = 0

    def acquire(self, size: int | None = None) -> bytearray:
        need = size or self.size
        self._available.acquire()
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) >= need:
                    return buf
                self._held -= len(buf)  # too small for this part: dropped
            self._held += need
            self.peak_bytes = max(self.peak_bytes, self._held)
        return bytearray(need)

    def release(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
        self._available.release()

    def clear(self) -> None:
        with self._lock:
            self._held -= sum(len(b) for b in self._free)
            self._free.clear()
