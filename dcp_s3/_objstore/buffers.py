"""Part buffers: the memory bound of uploads, and the part-size rule that keeps objects under S3's part limit."""

from __future__ import annotations

import bisect
import io
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy

__all__ = ["BufferPool", "BufferReader", "fit_part_size", "MAX_PARTS", "MIN_PART_SIZE"]

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
    Buffers are allocated on first use and dropped by ``clear``. ``direct_size``: the largest part made
    only of views of the caller's memory (it holds no buffer, so it may be larger than ``size``; never
    smaller).
    """

    def __init__(self, count: int, size: int, direct_size: int | None = None) -> None:
        self.count = count
        self.size = size
        self.direct_size = max(size, direct_size or size)
        self._free: list[memoryview] = []
        self._available = threading.Semaphore(count)
        self._lock = threading.Lock()
        self._held = 0  # bytes of every buffer that exists (in use or free)
        self.peak_bytes = 0

    def acquire(self, size: int | None = None) -> memoryview:
        """A buffer of at least ``size`` bytes (the pool's size by default), waiting for a free one."""
        self.reserve()
        return self.buffer(size)

    def reserve(self) -> None:
        """Take one of the ``count`` places without a buffer yet (a part that may need none, its bytes
        being views of memory the caller keeps); ``buffer`` fills it, ``release`` gives it back."""
        self._available.acquire()

    def buffer(self, size: int | None = None) -> memoryview:
        """The buffer of a place taken by ``reserve`` (never waits)."""
        need = size or self.size
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) >= need:
                    return buf
                self._held -= len(buf)  # too small for this part: dropped
            self._held += need
            self.peak_bytes = max(self.peak_bytes, self._held)
        # Not bytearray(need), which zero-fills (touches) every page: a part whose bytes are mostly
        # borrowed views copies a few KiB into it, and only those pages become resident.
        return numpy.empty(need, dtype=numpy.uint8).data

    def release(self, buf: memoryview | None) -> None:
        """Give back a place, and its buffer if it had one."""
        if buf is not None:
            with self._lock:
                self._free.append(buf)
        self._available.release()

    def clear(self) -> None:
        with self._lock:
            self._held -= sum(len(b) for b in self._free)
            self._free.clear()


class BufferReader(io.RawIOBase):
    """A read-only, seekable file over the first ``size`` bytes of ``buf`` (or, ``BufferReader.of(views)``,
    over several buffers one after the other), without copying them: the body of an upload, so that
    the bytes sent are the part's own and nothing else's.

    botocore copies a bytes-like body whole where it needs a stream: its CRT signer (used whenever
    ``awscrt`` is importable, ``botocore.crt.auth``) into an ``io.BytesIO`` on every request, and its
    trailing checksums (HTTPS) likewise. Each copy is as large as the part and freed soon after, but
    glibc, having raised its mmap threshold when the first was freed, serves the later ones from
    per-thread arenas that keep them resident: RSS outgrew the part buffers' bound by about a part
    per upload thread (403 against 181 MiB for a 256 MiB save). A file botocore reads in pieces
    (checksum, then the send), measures with ``seek``/``tell`` and rewinds with ``seek(0)`` for a
    retry; ``read`` hands out views, not copies, never across two buffers. ``close`` releases the views.
    """

    def __init__(self, buf: Any, size: int | None = None) -> None:
        super().__init__()
        view = memoryview(buf).cast("B")
        self._views = [view if size is None else view[:size]]
        self._starts = [0]
        self._size = len(self._views[0])
        self._pos = 0
        self._index = 0  # the view that holds ``_pos`` (or the last one)
        self._min_read = 0

    #: Fewest bytes a read of an upload body returns (``of(..., send_block=True)``), buffer ends aside.
    SEND_BLOCK = 1 << 20

    @classmethod
    def of(cls, views: Sequence[Any], *, send_block: bool = False) -> BufferReader:
        """A file over ``views`` (buffers, read one after the other).

        ``send_block``: reads of fewer than ``SEND_BLOCK`` bytes return up to ``SEND_BLOCK`` — for a body
        only senders read, which take what they get: urllib3 reads a file body 16 KiB at a time and
        sends each piece, 1,000 sends and Python calls a 16 MiB part, which cost 0.3 s of CPU per GB.
        """
        reader = cls(b"")
        reader._min_read = cls.SEND_BLOCK if send_block else 0
        reader._views = [memoryview(v).cast("B") for v in views] or reader._views
        reader._starts = list(itertools.accumulate((len(v) for v in reader._views[:-1]), initial=0))
        reader._size = sum(len(v) for v in reader._views)
        return reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _take(self, size: int | None) -> memoryview:
        self._checkClosed()  # io's own ValueError, as any closed file raises
        if self._pos >= self._size:
            return self._views[-1][:0]
        while self._pos >= self._starts[self._index] + len(self._views[self._index]):
            self._index += 1
        view, offset = self._views[self._index], self._pos - self._starts[self._index]
        end = len(view) if size is None or size < 0 else min(len(view), offset + size)
        self._pos += end - offset
        return view[offset:end]

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        """The next bytes, at most ``size`` (all that are left of the current buffer if ``size`` is negative
        or None), as a read-only view, not a copy: botocore hashes and sends what it reads, and both take
        any bytes-like object, so a part is never copied on its way out (copies of 1 MiB pieces would
        again be kept resident by the allocator, one set per upload thread). Shorter than ``size`` only
        at the end of a buffer; ``b""``-like (empty) at the end of the file."""
        if size is not None and 0 <= size < self._min_read:
            size = self._min_read
        return self._take(size).toreadonly()

    def readall(self) -> memoryview:  # type: ignore[override]
        if len(self._views) == 1:
            return self.read()
        return memoryview(b"".join(iter(lambda: self.read(), memoryview(b""))))  # not used for uploads

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out):
            chunk = self._take(len(out) - n)
            if not chunk:
                break
            out[n : n + len(chunk)] = chunk
            n += len(chunk)
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` from the start, the current position or the end (``whence``); a position
        before the start is the start."""
        self._checkClosed()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        self._index = max(0, bisect.bisect_right(self._starts, self._pos) - 1)
        return self._pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def close(self) -> None:
        if not self.closed:
            super().close()
            for view in self._views:
                view.release()
