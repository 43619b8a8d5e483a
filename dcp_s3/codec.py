"""Byte-grouped, frame-indexed, parallel zstd codec for checkpoint items.

An item's raw bytes are cut into independent *frames* of ``frame_size`` raw bytes
(a multiple of the element size; the last frame may be shorter). Each frame is
compressed on its own, so a reader fetches and decompresses only the frames a
ranged read touches, and frames (de)compress in parallel on a thread pool
(python-zstandard, cramjam and numpy release the GIL).

Floating-point frames are *byte grouped* first: every element is rotated left by
one bit (the sign moves next to the mantissa, so the top byte is the whole
exponent for bf16/fp32/fp64-like layouts) and its bytes are split into planes,
most significant plane first. The exponent plane is low-entropy; the mantissa
planes are near-random and zstd stores them as raw blocks at memcpy speed. A
frame whose zstd output does not shrink is stored raw (not grouped).

Stored format of frame ``i`` (codec version 1), ``n`` its raw length, ``es`` the
element size and ``ne = n // es``:

- raw frame (bit ``i`` of ``FrameIndex.raw_frames``): the ``n`` raw bytes;
- ``GROUP_NONE``: one or more concatenated zstd frames decompressing to the raw bytes;
- ``GROUP_FLOAT``: one or more concatenated zstd frames decompressing to ``es``
  planes of ``ne`` bytes, plane ``p`` holding byte ``es - 1 - p`` (little-endian) of
  each element rotated left by one bit, then the ``n - ne * es`` trailing raw bytes.
  (This encoder writes one zstd frame; readers accept several.)

Everything a reader needs is in a :class:`FrameIndex` that the writer stores in
the checkpoint metadata; :func:`stored_span` maps a raw byte range to the frame
aligned stored span to fetch and :meth:`Codec.decode_into` decodes it. Decoders
are looked up by ``(codec, version)``; an unknown pair raises
:class:`~dcp_s3.errors.CheckpointFormatError`.

This module does not import torch.
"""

from __future__ import annotations

import copyreg
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Final, Union

import cramjam
import numpy as np
import zstandard

from dcp_s3.errors import CheckpointFormatError

__all__ = [
    "CODEC_NAME",
    "CODEC_VERSION",
    "GROUP_NONE",
    "GROUP_FLOAT",
    "FrameIndex",
    "Codec",
    "stored_span",
    "grouping_for_dtype",
]

CODEC_NAME: Final = "dcp_s3.zstd-frames"
CODEC_VERSION: Final = 1
GROUP_NONE: Final = 0
"""Frames hold plain zstd of the raw bytes."""
GROUP_FLOAT: Final = 1
"""Frames hold zstd of the byte planes of the elements rotated left by one bit."""

DEFAULT_FRAME_SIZE: Final = 4 << 20
#: Largest frame a reader accepts: bounds the scratch memory a (lying) frame index can ask for.
MAX_FRAME_SIZE: Final = 64 << 20
_BLOCK_ELEMENTS: Final = 1 << 16  # shuffle block: keeps temporaries in L2 cache
_SAMPLE_BYTES: Final = 32 << 10  # exponent-plane sample used to pick zstd parameters
# Literal-heavy zstd parameters: min_match 7 with a tiny hash table finds few
# matches, so zstd mostly Huffman-codes literals. On exponent planes of weights
# this is ~2x faster than level 1 and closer to the order-0 entropy; on planes
# with long-range structure (Adam exp_avg_sq) level 1 wins, hence the sampling.
_LITERAL_PARAMS: Final = dict(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)
_UINT: Final[dict[int, Any]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}

Chunk = Union[bytes, bytearray, memoryview, np.ndarray]


@dataclass(frozen=True, slots=True)
class FrameIndex:
    """Where each frame of one encoded item is stored. Picklable and compact.

    Frame ``i`` covers raw bytes ``[i * frame_size, min((i + 1) * frame_size,
    raw_length))`` and stored bytes ``[ends[i - 1] (0 for i == 0), ends[i])``,
    both relative to the item start.
    """

    codec: str
    version: int
    element_size: int
    grouping: int
    """``GROUP_NONE`` or ``GROUP_FLOAT``."""
    raw_length: int
    frame_size: int
    ends: tuple[int, ...]
    """Stored end offset of every frame (end exclusive, relative to the item start)."""
    raw_frames: int = 0
    """Bit mask: bit ``i`` set means frame ``i`` is stored raw (uncompressed, ungrouped)."""

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        # Values come from checkpoint metadata: check types first (bool is not an int here).
        ints = (self.version, self.element_size, self.grouping, self.raw_length, self.frame_size, self.raw_frames)
        if type(self.codec) is not str or any(type(v) is not int for v in ints) or type(self.ends) is not tuple:
            raise CheckpointFormatError("bad frame index: a field has the wrong type")
        if not 1 <= self.element_size <= self.frame_size <= MAX_FRAME_SIZE or self.frame_size % self.element_size:
            raise CheckpointFormatError(
                f"bad frame index: frame_size {self.frame_size} must be a multiple of element_size "
                f"{self.element_size} and at most {MAX_FRAME_SIZE}"
            )
        if self.raw_length < 0 or len(self.ends) != -(-self.raw_length // self.frame_size):
            raise CheckpointFormatError(
                f"bad frame index: {len(self.ends)} frames for {self.raw_length} raw bytes "
                f"in frames of {self.frame_size}"
            )
        if any(type(e) is not int for e in self.ends):
            raise CheckpointFormatError("bad frame index: a stored offset is not an integer")
        if any(b < a for a, b in zip((0,) + self.ends, self.ends)) or self.raw_frames < 0 or self.raw_frames >> len(self.ends):
            raise CheckpointFormatError("bad frame index: stored offsets decrease or raw_frames has extra bits")

    # Pickled as the class plus a state tuple, so a restricted unpickler only has
    # to allow ``dcp_s3.codec.FrameIndex``, and an index written by a newer codec
    # (with other fields) fails with a message naming that codec.
    def __reduce__(self) -> tuple[Any, ...]:
        state = tuple(getattr(self, f) for f in _FIELDS)
        return (copyreg.__newobj__, (type(self),), state)  # type: ignore[attr-defined]

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        if not isinstance(state, tuple) or len(state) != len(_FIELDS):
            codec, version = (state[0], state[1]) if isinstance(state, tuple) and len(state) > 1 else ("?", "?")
            codec = codec if isinstance(codec, str) and len(codec) <= 60 else "?"
            version = version if type(version) is int and abs(version) < 1 << 32 else "?"
            raise CheckpointFormatError(
                f"cannot read the frame index of codec {codec!r} version {version}: this dcp_s3 reads {_supported()}"
            )
        for name, value in zip(_FIELDS, state):
            object.__setattr__(self, name, value)
        self._validate()

    @property
    def num_frames(self) -> int:
        return len(self.ends)

    @property
    def stored_length(self) -> int:
        """Total stored bytes of the item."""
        return self.ends[-1] if self.ends else 0

    def is_raw(self, i: int) -> bool:
        return bool(self.raw_frames >> i & 1)

    def stored_range(self, i: int) -> tuple[int, int]:
        """Stored bytes ``[start, end)`` of frame ``i``."""
        return (self.ends[i - 1] if i else 0, self.ends[i])

    def raw_range(self, i: int) -> tuple[int, int]:
        """Raw bytes ``[start, end)`` of frame ``i``."""
        start = i * self.frame_size
        return (start, min(start + self.frame_size, self.raw_length))


_FIELDS: Final = tuple(f.name for f in fields(FrameIndex))


def stored_span(index: FrameIndex, raw_start: int, raw_end: int) -> tuple[int, int]:
    """The frame-aligned stored byte span ``[start, end)`` holding raw ``[raw_start, raw_end)``.

    Offsets are relative to the item start; an empty range gives ``(0, 0)``.
    """
    first, last = _frame_range(index, raw_start, raw_end)
    if first > last:
        return (0, 0)
    return (index.stored_range(first)[0], index.ends[last])


def grouping_for_dtype(dtype: Any) -> tuple[int, bool]:
    """``(element_size, floating)`` to pass to :meth:`Codec.encode` for a torch (or numpy) dtype.

    Complex dtypes are grouped per real component; 1-byte types (bool, int8,
    fp8) are not grouped. Does not import torch.
    """
    itemsize = int(dtype.itemsize)
    if isinstance(dtype, np.dtype):
        floating, complex_ = dtype.kind == "f", dtype.kind == "c"
    else:
        floating, complex_ = bool(dtype.is_floating_point), bool(dtype.is_complex)
    if complex_:
        return (itemsize // 2, True)
    return (itemsize, floating and itemsize in _UINT)


class Codec:
    """Encoder/decoder owning a thread pool and per-thread zstd contexts.

    One instance may be shared by many threads. It pickles as its settings
    (the pool and contexts are recreated lazily). Call :meth:`close` (or use it
    as a context manager) to stop the pool.
    """

    def __init__(self, level: int = 1, threads: int = 2, frame_size: int = DEFAULT_FRAME_SIZE,
                 max_in_flight: int | None = None) -> None:
        """``level``: zstd level of plain frames, and one of the two candidates tried on
        grouped frames (the other is a literal-heavy setting). ``threads``: pool size.
        ``frame_size``: raw bytes per frame (rounded down to a multiple of the element
        size). ``max_in_flight``: frames being compressed or awaiting the sink per
        :meth:`encode` call (default ``2 * threads``); bounds encode memory to about
        ``(max_in_flight + threads) * frame_size``.
        """
        if threads < 1 or not 1 <= frame_size <= MAX_FRAME_SIZE or (max_in_flight is not None and max_in_flight < 1):
            raise ValueError(f"threads and max_in_flight must be positive, frame_size in [1, {MAX_FRAME_SIZE}]")
        zstandard.ZstdCompressor(level=level)  # validates the level
        self.level, self.threads, self.frame_size = level, threads, frame_size
        self.max_in_flight = max_in_flight or 2 * threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def __getstate__(self) -> tuple[int, int, int, int]:
        return (self.level, self.threads, self.frame_size, self.max_in_flight)

    def __setstate__(self, state: tuple[int, int, int, int]) -> None:
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

    def encode(self, data: Chunk | Iterable[Chunk], element_size: int, floating: bool,
               sink: Callable[[bytes | memoryview], object], *, stable_chunks: bool = False) -> FrameIndex:
        """Compress ``data`` frame by frame and pass the stored frames to ``sink`` in order.

        ``data`` is one buffer (bytes, memoryview, numpy array...) or an iterable of
        C-contiguous buffers of any sizes whose concatenation is the item; a chunk may
        be reused by its producer once the next one is requested, so ``encode`` lets the
        frames in flight finish at each chunk boundary; ``stable_chunks=True`` says each
        chunk stays valid and unchanged until ``encode`` returns (e.g. fresh host copies)
        and skips that wait. ``sink`` runs in the
        calling thread and receives the stored frames in order, one call per frame; the
        buffer is valid only during the call (a ``memoryview`` is a raw-stored frame
        pointing into ``data``), so copy it to keep it. ``element_size``
        and ``floating`` come from :func:`grouping_for_dtype`; ``floating`` with an
        element size of 2, 4 or 8 selects byte grouping. Returns the item's index.
        """
        if element_size < 1:
            raise ValueError(f"element_size must be positive, got {element_size}")
        es = element_size
        grouping = GROUP_FLOAT if floating and es in _UINT else GROUP_NONE
        fs = self.frame_size_for(es)
        ends: list[int] = []
        raw_mask = 0
        raw_length = 0
        # (future, assembly buffer to recycle once the frame is emitted, or None)
        inflight: deque[tuple[Future[tuple[bytes | memoryview, bool]], bytearray | None]] = deque()
        spare: list[bytearray] = []  # assembly buffers for frames that span chunks
        pool = self._executor()

        def emit_one() -> None:
            nonlocal raw_mask
            fut, owned = inflight.popleft()
            payload, raw = fut.result()
            if raw:
                raw_mask |= 1 << len(ends)
            ends.append((ends[-1] if ends else 0) + len(payload))
            sink(payload)
            if owned is not None:
                spare.append(owned)

        def submit(frame: memoryview, owned: bytearray | None = None) -> None:
            nonlocal raw_length
            while len(inflight) >= self.max_in_flight:
                emit_one()
            raw_length += len(frame)
            inflight.append((pool.submit(self._encode_frame, frame, es, grouping), owned))

        try:
            single = _as_bytes_view(data)
            if single is not None:
                for pos in range(0, len(single), fs):
                    submit(single[pos:pos + fs])
            else:
                partial, fill = None, 0
                for chunk in data:  # type: ignore[union-attr,unused-ignore]
                    view = _as_bytes_view(chunk)
                    if view is None:
                        raise TypeError(f"encode needs buffers, got a chunk of type {type(chunk).__name__}")
                    pos = 0
                    if partial is not None:
                        pos = min(fs - fill, len(view))
                        partial[fill:fill + pos] = view[:pos]
                        fill += pos
                        if fill == fs:
                            submit(memoryview(partial), partial)
                            partial, fill = None, 0
                    referenced = len(view) - pos >= fs
                    while len(view) - pos >= fs:
                        submit(view[pos:pos + fs])
                        pos += fs
                    if pos < len(view):  # copy the start of a frame that spans chunks
                        partial = spare.pop() if spare else bytearray(fs)
                        fill = len(view) - pos
                        partial[:fill] = view[pos:]
                    if referenced and not stable_chunks:  # the producer may reuse the chunk once we ask for the next
                        while inflight:
                            emit_one()
                if partial is not None:
                    submit(memoryview(partial)[:fill], partial)
            while inflight:
                emit_one()
        except BaseException:
            for fut, _ in inflight:
                fut.cancel()
            for fut, _ in inflight:
                if not fut.cancelled():
                    fut.exception()  # wait; the error being raised wins
            raise
        return FrameIndex(CODEC_NAME, CODEC_VERSION, es, grouping, raw_length, fs, tuple(ends), raw_mask)

    def _encode_frame(self, frame: memoryview, es: int, grouping: int) -> tuple[bytes | memoryview, bool]:
        """The stored bytes of one frame and whether they are the raw bytes."""
        local = self._local
        cctx = getattr(local, "cctx", None)
        if cctx is None:
            cctx = local.cctx = zstandard.ZstdCompressor(level=self.level)
            local.literal_cctx = zstandard.ZstdCompressor(
                compression_params=zstandard.ZstdCompressionParameters(**_LITERAL_PARAMS))
        src = frame
        if grouping == GROUP_FLOAT:
            planes = _scratch(local, len(frame))
            _group(np.frombuffer(frame, np.uint8), es, planes)
            src = planes.data
            # Pick the zstd setting that wins on a sample of the exponent plane (the
            # mantissa planes cost the same under both).
            if len(frame) // es >= 2 * _SAMPLE_BYTES:
                sample = src[:_SAMPLE_BYTES]
                if len(local.literal_cctx.compress(sample)) <= len(cctx.compress(sample)):
                    cctx = local.literal_cctx
            else:
                cctx = local.literal_cctx
        out = cctx.compress(src)
        if len(out) >= len(frame):
            return frame, True
        return out, False

    # ------------------------------------------------------------------ decode

    def decode_into(self, index: FrameIndex, stored: Chunk, stored_start: int,
                    raw_start: int, raw_end: int, out: Chunk) -> None:
        """Write raw bytes ``[raw_start, raw_end)`` of the item into ``out``.

        ``stored`` holds the item's stored bytes from offset ``stored_start`` on and
        must cover :func:`stored_span` of the range; ``out`` is a writable buffer of
        exactly ``raw_end - raw_start`` bytes. Frames decode in parallel on the pool;
        plain frames fully inside the range decompress straight into ``out``. Safe to
        call from many threads at once, but not from a task running on this codec's pool.
        Raises ``CheckpointFormatError`` for an unknown codec/version or corrupt data.
        """
        decode_frame = _DECODERS.get((index.codec, index.version))
        if decode_frame is None:
            raise CheckpointFormatError(
                f"unknown codec {index.codec!r} version {index.version}: this dcp_s3 reads {_supported()}"
            )
        if index.grouping not in (GROUP_NONE, GROUP_FLOAT) or (
                index.grouping == GROUP_FLOAT and index.element_size not in _UINT):
            raise CheckpointFormatError(
                f"unknown grouping {index.grouping} for element size {index.element_size} "
                f"in codec {index.codec!r} version {index.version}")
        src = _as_bytes_view(stored)
        dst = _as_bytes_view(out)
        if src is None or dst is None or dst.readonly:
            raise TypeError("stored must be a buffer and out a writable buffer")
        if len(dst) != raw_end - raw_start:
            raise ValueError(
                f"out has {len(dst)} bytes, the range [{raw_start}, {raw_end}) needs {raw_end - raw_start}")
        first, last = _frame_range(index, raw_start, raw_end)
        if first > last:
            return
        span = (index.stored_range(first)[0], index.ends[last])
        if stored_start > span[0] or stored_start + len(src) < span[1]:
            raise ValueError(
                f"stored bytes [{stored_start}, {stored_start + len(src)}) do not cover the "
                f"needed span [{span[0]}, {span[1]})"
            )
        tasks = []
        for i in range(first, last + 1):
            f_start, f_end = index.raw_range(i)
            s_start, s_end = index.stored_range(i)
            lo, hi = max(raw_start, f_start), min(raw_end, f_end)
            tasks.append((index, i, src[s_start - stored_start:s_end - stored_start],
                          lo - f_start, hi - f_start, dst[lo - raw_start:hi - raw_start]))
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


def _decode_frame_v1(local: threading.local, index: FrameIndex, i: int, piece: memoryview,
                     lo: int, hi: int, dst: memoryview) -> None:
    """Decode raw bytes ``[lo, hi)`` (relative to the frame) of frame ``i`` into ``dst``."""
    f_start, f_end = index.raw_range(i)
    n = f_end - f_start
    if index.is_raw(i):
        if len(piece) != n:
            raise CheckpointFormatError(f"raw frame {i} has {len(piece)} stored bytes, expected {n}")
        dst[:] = piece[lo:hi]
        return
    if index.grouping == GROUP_NONE and lo == 0 and hi == n:
        _decompress_into(piece, dst, i)
        return
    buf = _scratch(local, n)
    _decompress_into(piece, buf.data, i)
    if index.grouping == GROUP_NONE:
        dst[:] = buf.data[lo:hi]
        return
    es = index.element_size
    ne = n // es
    out = np.frombuffer(dst, np.uint8)
    a, b = -(-lo // es), min(hi // es, ne)  # whole elements inside [lo, hi)
    if a <= b:
        if a < b:
            _ungroup(buf, ne, es, a, b, out[a * es - lo:b * es - lo])
        pieces: tuple[tuple[int, int], ...] = ((lo, a * es), (b * es, hi))
    else:
        pieces = ((lo, hi),)
    for s, e in pieces:  # partial elements and the ungrouped tail bytes, if any
        while s < e:
            if s >= ne * es:
                out[s - lo:e - lo] = buf[s:e]
                break
            el = s // es
            stop = min(e, (el + 1) * es)
            tmp = np.empty(es, np.uint8)
            _ungroup(buf, ne, es, el, el + 1, tmp)
            out[s - lo:stop - lo] = tmp[s - el * es:stop - el * es]
            s = stop


_DECODERS: Final[Mapping[tuple[str, int], Callable[..., None]]] = MappingProxyType({
    (CODEC_NAME, 1): _decode_frame_v1,
})


def _supported() -> str:
    return ", ".join(f"{name!r} version {v}" for name, v in sorted(_DECODERS))


def _decompress_into(piece: memoryview, dst: memoryview, i: int) -> None:
    """Decompress the zstd frame(s) in ``piece`` into exactly fill ``dst``.

    cramjam decompresses straight into the caller's buffer with the GIL released:
    twice as fast here as python-zstandard, whose one-shot API allocates the output
    (page faults on every frame) and whose streaming API copies through a window.
    """
    try:
        got = cramjam.zstd.decompress_into(piece, dst)
    except cramjam.DecompressionError as e:
        raise CheckpointFormatError(
            f"frame {i} is not valid zstd data or decompresses to more than the expected {len(dst)} bytes ({e})"
        ) from e
    if got != len(dst):
        raise CheckpointFormatError(f"frame {i} decompressed to {got} bytes, expected {len(dst)}")


def _frame_range(index: FrameIndex, raw_start: int, raw_end: int) -> tuple[int, int]:
    if not 0 <= raw_start <= raw_end <= index.raw_length:
        raise ValueError(f"raw range [{raw_start}, {raw_end}) is outside the item's {index.raw_length} bytes")
    if raw_start == raw_end:
        return (1, 0)
    return (raw_start // index.frame_size, (raw_end - 1) // index.frame_size)


def _as_bytes_view(obj: Any) -> memoryview | None:
    """A flat byte view of a buffer, or None if ``obj`` is not a buffer."""
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    if not view.c_contiguous:
        raise ValueError("buffers must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _scratch(local: threading.local, n: int) -> np.ndarray:
    buf = getattr(local, "scratch", None)
    if buf is None or len(buf) < n:
        buf = local.scratch = np.empty(max(n, DEFAULT_FRAME_SIZE), np.uint8)
    return buf[:n]


def _group(src: np.ndarray, es: int, out: np.ndarray) -> None:
    """Byte-group ``src`` into ``out``: rotate each element left by 1 bit, then plane ``p``
    (byte ``es - 1 - p`` of the little-endian element) at ``out[p * ne:(p + 1) * ne]``.
    Trailing bytes that do not make a whole element are copied unchanged after the planes."""
    dt = _UINT[es]
    ne = len(src) // es
    x_all = src[:ne * es].view(dt)
    bits = dt(8 * es - 1)
    one = dt(1)
    block = max(1, min(ne, _BLOCK_ELEMENTS))
    t1, t2 = np.empty(block, dt), np.empty(block, dt)
    for s in range(0, ne, block):
        e = min(ne, s + block)
        x, r, t = x_all[s:e], t1[:e - s], t2[:e - s]
        np.left_shift(x, one, out=r)
        np.right_shift(x, bits, out=t)
        np.bitwise_or(r, t, out=r)
        if es == 8:  # strided copies beat shift+cast for 8 planes
            r8 = r.view(np.uint8).reshape(-1, es)
            for p in range(es):
                out[p * ne + s:p * ne + e] = r8[:, es - 1 - p]
            continue
        for p in range(es):
            shift = 8 * (es - 1 - p)
            if shift:
                np.right_shift(r, dt(shift), out=t)
                np.copyto(out[p * ne + s:p * ne + e], t, casting="unsafe")
            else:
                np.copyto(out[p * ne + s:p * ne + e], r, casting="unsafe")
    out[ne * es:len(src)] = src[ne * es:]


def _ungroup(planes: np.ndarray, ne: int, es: int, a: int, b: int, out: np.ndarray) -> None:
    """Inverse of :func:`_group` for elements ``[a, b)`` of a frame of ``ne`` elements,
    written to ``out`` (``(b - a) * es`` bytes)."""
    dt = _UINT[es]
    bits = dt(8 * es - 1)
    one = dt(1)
    o_all = out.view(dt) if out.ctypes.data % es == 0 else None
    block = min(b - a, _BLOCK_ELEMENTS)
    t1, t2 = np.empty(block, dt), np.empty(block, dt)
    eight = dt(8)
    for s in range(a, b, block):
        e = min(b, s + block)
        r, t = t1[:e - s], t2[:e - s]
        if es == 8:
            r8 = r.view(np.uint8).reshape(-1, es)
            for p in range(es):
                r8[:, es - 1 - p] = planes[p * ne + s:p * ne + e]
        else:
            np.copyto(r, planes[s:e])
            for p in range(1, es):
                np.left_shift(r, eight, out=r)
                np.copyto(t, planes[p * ne + s:p * ne + e])
                np.bitwise_or(r, t, out=r)
        np.left_shift(r, bits, out=t)
        np.right_shift(r, one, out=r)
        if o_all is not None:
            np.bitwise_or(r, t, out=o_all[s - a:e - a])
        else:  # unaligned destination: combine in place, then copy bytes
            np.bitwise_or(r, t, out=r)
            out[(s - a) * es:(e - a) * es] = r.view(np.uint8)
