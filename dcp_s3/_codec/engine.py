"""The :class:`Codec`: encode and decode items frame by frame on a thread pool (format in :mod:`dcp_s3._codec.format`).

This module does not import torch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zstandard

from dcp_s3._codec.byte_planes import UINT
from dcp_s3._codec.format import (
    CODEC_NAME,
    CODEC_VERSION,
    DECODERS,
    DEFAULT_FRAME_SIZE,
    GROUP_FLOAT,
    GROUP_NONE,
    MAX_FRAME_SIZE,
    FrameIndex,
    decoder_for,
    frame_range,
    supported,
)
from dcp_s3.errors import CheckpointFormatError, ConfigError, InvalidTypeError

__all__ = ["Codec", "Chunk"]

Chunk = bytes | bytearray | memoryview | np.ndarray


class Codec:
    """Encoder/decoder owning a thread pool and per-thread zstd contexts.

    One instance may be shared by many threads. It pickles as its settings
    (the pool and contexts are recreated lazily). Call :meth:`close` (or use it
    as a context manager) to stop the pool.
    """

    def __init__(
        self,
        level: int = 1,
        threads: int = 2,
        frame_size: int = DEFAULT_FRAME_SIZE,
        max_in_flight: int | None = None,
        version: int = CODEC_VERSION,
    ) -> None:
        """``level``: zstd level of plain frames, and one of the two candidates tried on
        grouped frames (the other is a literal-heavy setting). ``threads``: pool size.
        ``frame_size``: raw bytes per frame (rounded down to a multiple of the element
        size). ``max_in_flight``: frames being compressed or awaiting the sink per
        :meth:`encode` call (default ``2 * threads``); bounds encode memory to about
        ``(max_in_flight + threads) * frame_size``. ``version``: the codec version
        :meth:`encode` writes (default :data:`CODEC_VERSION`; every version reads).
        """
        if threads < 1 or not 1 <= frame_size <= MAX_FRAME_SIZE or (max_in_flight is not None and max_in_flight < 1):
            raise ConfigError(
                f"Codec(threads={threads}, frame_size={frame_size}, max_in_flight={max_in_flight}): threads and "
                f"max_in_flight must be positive, frame_size in [1, {MAX_FRAME_SIZE}]"
            )
        zstandard.ZstdCompressor(level=level)  # validates the level
        if (CODEC_NAME, version) not in DECODERS or type(version) is not int:
            raise ConfigError(f"Codec(version={version!r}): this dcp_s3 writes {supported()}")
        self._impl = decoder_for(FrameIndex(CODEC_NAME, version, 1, GROUP_NONE, 0, 1, ()))
        self.level, self.threads, self.frame_size, self.version = level, threads, frame_size, version
        self.max_in_flight = max_in_flight or 2 * threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def __getstate__(self) -> tuple[int, int, int, int, int]:
        return (self.level, self.threads, self.frame_size, self.max_in_flight, self.version)

    def __setstate__(self, state: tuple[int, int, int, int, int]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def __enter__(self) -> Codec:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread pool (waiting for running tasks). The codec stays usable."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dcp_s3-codec")
            return self._pool

    def frame_size_for(self, element_size: int) -> int:
        """Raw bytes per frame for elements of ``element_size`` bytes (whole elements per frame)."""
        return max(element_size, self.frame_size - self.frame_size % element_size)

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        data: Chunk | Iterable[Chunk],
        element_size: int,
        floating: bool,
        sink: Callable[[bytes | memoryview], object],
        *,
        stable_chunks: bool = False,
    ) -> FrameIndex:
        """Compress ``data`` frame by frame and pass the stored frames to ``sink`` in order.

        ``data`` is one buffer (bytes, memoryview, numpy array...) or an iterable of
        C-contiguous buffers of any sizes whose concatenation is the item; a chunk may
        be reused by its producer once the next one is requested, so ``encode`` lets the
        frames in flight finish at each chunk boundary; ``stable_chunks=True`` says each
        chunk stays valid and unchanged until ``encode`` returns (e.g. fresh host copies)
        and skips that wait. ``sink`` runs in the
        calling thread and receives the stored frames in order, one call per frame; the
        buffer is valid only during the call (a raw-stored frame is a ``memoryview``
        pointing into ``data``), so copy it to keep it. ``element_size``
        and ``floating`` come from :func:`grouping_for_dtype`; ``floating`` with an
        element size of 2, 4 or 8 selects byte grouping. Returns the item's index.
        """
        if element_size < 1:
            raise ConfigError(f"encode: element_size must be positive, got {element_size}")
        grouping = GROUP_FLOAT if floating and element_size in UINT else GROUP_NONE
        fs = self.frame_size_for(element_size)
        frames = _Frames(self, element_size, grouping, sink)
        try:
            single = as_bytes_view(data)
            if single is not None:
                for pos in range(0, len(single), fs):
                    frames.submit(single[pos : pos + fs])
            else:
                frames.cut(data, fs, stable_chunks)  # type: ignore[arg-type,unused-ignore]
            frames.drain()
        except BaseException:
            frames.cancel()
            raise
        return FrameIndex(
            CODEC_NAME, self.version, element_size, grouping, frames.raw_length, fs, tuple(frames.ends), frames.raw_mask
        )

    def _encode_frame(self, frame: memoryview, es: int, grouping: int) -> tuple[bytes | memoryview, bool]:
        """The stored bytes of one frame and whether they are the raw bytes (runs on the pool)."""
        result: tuple[bytes | memoryview, bool] = self._impl.encode_frame(self._local, self.level, frame, es, grouping)
        return result

    # ------------------------------------------------------------------ decode

    def decode_into(
        self, index: FrameIndex, stored: Chunk, stored_start: int, raw_start: int, raw_end: int, out: Chunk
    ) -> None:
        """Write raw bytes ``[raw_start, raw_end)`` of the item into ``out``.

        ``stored`` holds the item's stored bytes from offset ``stored_start`` on and
        must cover :func:`stored_span` of the range; ``out`` is a writable buffer of
        exactly ``raw_end - raw_start`` bytes. Frames decode in parallel on the pool;
        plain frames fully inside the range decompress straight into ``out``. Safe to
        call from many threads at once, but not from a task running on this codec's pool.
        Raises ``CheckpointFormatError`` for an unknown codec/version or corrupt data.
        """
        impl = decoder_for(index)
        impl.check_index(index)
        decode_frame: Callable[..., None] = impl.decode_frame
        src = as_bytes_view(stored)
        dst = as_bytes_view(out)
        if src is None or dst is None or dst.readonly:
            raise InvalidTypeError("decode_into: stored must be a buffer and out a writable buffer")
        if len(dst) != raw_end - raw_start:
            raise ConfigError(
                f"decode_into: out has {len(dst)} bytes, the range [{raw_start}, {raw_end}) needs {raw_end - raw_start}"
            )
        first, last = frame_range(index, raw_start, raw_end)
        if first > last:
            return
        span = (index.stored_range(first)[0], index.ends[last])
        if stored_start > span[0] or stored_start + len(src) < span[1]:
            raise CheckpointFormatError(
                f"decode_into: stored bytes [{stored_start}, {stored_start + len(src)}) do not cover the "
                f"needed span [{span[0]}, {span[1]})"
            )
        tasks = []
        for i in range(first, last + 1):
            f_start, f_end = index.raw_range(i)
            s_start, s_end = index.stored_range(i)
            lo, hi = max(raw_start, f_start), min(raw_end, f_end)
            tasks.append(
                (
                    index,
                    i,
                    src[s_start - stored_start : s_end - stored_start],
                    lo - f_start,
                    hi - f_start,
                    dst[lo - raw_start : hi - raw_start],
                )
            )
        if len(tasks) == 1 or self.threads == 1:
            for t in tasks:
                decode_frame(self._local, *t)
            return
        pool = self._executor()
        futures = [pool.submit(decode_frame, self._local, *t) for t in tasks]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            for fut in futures:
                if not fut.cancelled():
                    fut.exception()
            raise


class _Frames:
    """The frames of one :meth:`Codec.encode` call: submitted to the pool in order, at most ``max_in_flight``
    at once, and passed to ``sink`` in order as they finish; the frame index's ends and raw bits as they go."""

    def __init__(self, codec: Codec, es: int, grouping: int, sink: Callable[[bytes | memoryview], object]) -> None:
        self.codec, self.es, self.grouping, self.sink = codec, es, grouping, sink
        self.pool = codec._executor()
        self.ends: list[int] = []
        self.raw_mask = 0
        self.raw_length = 0
        # (future, assembly buffer to recycle once the frame is emitted, or None)
        self.inflight: deque[tuple[Future[tuple[bytes | memoryview, bool]], bytearray | None]] = deque()
        self.spare: list[bytearray] = []  # assembly buffers for frames that span chunks

    def emit_one(self) -> None:
        fut, owned = self.inflight.popleft()
        payload, raw = fut.result()
        if raw:
            self.raw_mask |= 1 << len(self.ends)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(payload))
        self.sink(payload)
        if owned is not None:
            self.spare.append(owned)

    def submit(self, frame: memoryview, owned: bytearray | None = None) -> None:
        while len(self.inflight) >= self.codec.max_in_flight:
            self.emit_one()
        self.raw_length += len(frame)
        self.inflight.append((self.pool.submit(self.codec._encode_frame, frame, self.es, self.grouping), owned))

    def drain(self) -> None:
        while self.inflight:
            self.emit_one()

    def cancel(self) -> None:
        """Cancel the frames not started and wait for the running ones (the error being raised wins)."""
        for fut, _ in self.inflight:
            fut.cancel()
        for fut, _ in self.inflight:
            if not fut.cancelled():
                fut.exception()

    def cut(self, data: Iterable[Chunk], fs: int, stable_chunks: bool) -> None:
        """Submit the frames of ``fs`` bytes of the concatenation of the buffers ``data`` yields: a frame within
        one buffer by reference, one spanning buffers copied (assembled) first."""
        partial, fill = None, 0
        for chunk in data:
            view = as_bytes_view(chunk)
            if view is None:
                raise InvalidTypeError(f"encode: data must be buffers, got a chunk of type {type(chunk).__name__}")
            pos = 0
            if partial is not None:
                pos = min(fs - fill, len(view))
                partial[fill : fill + pos] = view[:pos]
                fill += pos
                if fill == fs:
                    self.submit(memoryview(partial), partial)
                    partial, fill = None, 0
            referenced = len(view) - pos >= fs
            while len(view) - pos >= fs:
                self.submit(view[pos : pos + fs])
                pos += fs
            if pos < len(view):  # copy the start of a frame that spans chunks
                partial = self.spare.pop() if self.spare else bytearray(fs)
                fill = len(view) - pos
                partial[:fill] = view[pos:]
            if referenced and not stable_chunks:  # the producer may reuse the chunk once we ask for the next
                self.drain()
        if partial is not None:
            self.submit(memoryview(partial)[:fill], partial)


def as_bytes_view(obj: Any) -> memoryview | None:
    """A flat byte view of a buffer, or None if ``obj`` is not a buffer."""
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    if not view.c_contiguous:
        raise ConfigError("buffers must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
