"""Version 1 of the ``dcp_s3.zstd-frames`` codec: encode and decode one frame (format in :mod:`dcp_s3._codec.format`).

Runs on the codec's pool threads; each thread keeps its zstd compressors, its decompressor and a scratch buffer
in a ``threading.local``.
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import zstandard

from dcp_s3._codec.byte_planes import UINT, group, ungroup
from dcp_s3._codec.format import DEFAULT_FRAME_SIZE, GROUP_FLOAT, GROUP_NONE, MAX_FRAME_SIZE, FrameIndex
from dcp_s3.errors import CheckpointFormatError

__all__ = ["LITERAL_PARAMS", "check_index", "encode_frame", "decode_frame"]

SAMPLE_BYTES: Final = 32 << 10  # exponent-plane sample used to pick zstd parameters
# Literal-heavy zstd parameters: min_match 7 with a tiny hash table finds few
# matches, so zstd mostly Huffman-codes literals. On exponent planes of weights
# this is ~2x faster than level 1 and closer to the order-0 entropy; on planes
# with long-range structure (Adam exp_avg_sq) level 1 wins, hence the sampling.
LITERAL_PARAMS: Final = dict(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)


def check_index(index: FrameIndex) -> None:
    """``CheckpointFormatError`` unless ``index`` has a grouping this version defines for its element size."""
    if index.grouping not in (GROUP_NONE, GROUP_FLOAT) or (
        index.grouping == GROUP_FLOAT and index.element_size not in UINT
    ):
        raise CheckpointFormatError(
            f"unknown grouping {index.grouping} for element size {index.element_size} "
            f"in codec {index.codec!r} version {index.version}"
        )


def encode_frame(
    local: threading.local, level: int, frame: memoryview, es: int, grouping: int
) -> tuple[bytes | memoryview, bool]:
    """The stored bytes of one frame and whether they are the raw bytes (zstd ``level`` for
    plain frames; ``local`` keeps this thread's compressors and scratch buffer)."""
    cctx = getattr(local, "cctx", None)
    if cctx is None:
        cctx = local.cctx = zstandard.ZstdCompressor(level=level)
        local.literal_cctx = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**LITERAL_PARAMS)
        )
    src = frame
    if grouping == GROUP_FLOAT:
        planes = scratch(local, len(frame))
        group(np.frombuffer(frame, np.uint8), es, planes)
        src = planes.data
        # Pick the zstd setting that wins on a sample of the exponent plane (the
        # mantissa planes cost the same under both).
        if len(frame) // es >= 2 * SAMPLE_BYTES:
            sample = src[:SAMPLE_BYTES]
            if len(local.literal_cctx.compress(sample)) <= len(cctx.compress(sample)):
                cctx = local.literal_cctx
        else:
            cctx = local.literal_cctx
    out = cctx.compress(src)
    if len(out) >= len(frame):
        return frame, True
    return out, False


def decode_frame(
    local: threading.local, index: FrameIndex, i: int, piece: memoryview, lo: int, hi: int, dst: memoryview
) -> None:
    """Decode raw bytes ``[lo, hi)`` (relative to the frame) of frame ``i`` into ``dst``."""
    f_start, f_end = index.raw_range(i)
    n = f_end - f_start
    if index.is_raw(i):
        if len(piece) != n:
            raise CheckpointFormatError(f"raw frame {i} has {len(piece)} stored bytes, expected {n}")
        dst[:] = piece[lo:hi]
        return
    if index.grouping == GROUP_NONE and lo == 0 and hi == n:
        decompress_into(local, piece, dst, i)
        return
    buf = scratch(local, n)
    decompress_into(local, piece, buf.data, i)
    if index.grouping == GROUP_NONE:
        dst[:] = buf.data[lo:hi]
        return
    es = index.element_size
    ne = n // es
    out = np.frombuffer(dst, np.uint8)
    a, b = -(-lo // es), min(hi // es, ne)  # whole elements inside [lo, hi)
    if a <= b:
        if a < b:
            ungroup(buf, ne, es, a, b, out[a * es - lo : b * es - lo])
        pieces: tuple[tuple[int, int], ...] = ((lo, a * es), (b * es, hi))
    else:
        pieces = ((lo, hi),)
    for s, e in pieces:  # partial elements and the ungrouped tail bytes, if any
        while s < e:
            if s >= ne * es:
                out[s - lo : e - lo] = buf[s:e]
                break
            el = s // es
            stop = min(e, (el + 1) * es)
            tmp = np.empty(es, np.uint8)
            ungroup(buf, ne, es, el, el + 1, tmp)
            out[s - lo : stop - lo] = tmp[s - el * es : stop - el * es]
            s = stop


def decompress_into(local: threading.local, piece: memoryview, dst: memoryview, i: int) -> None:
    """Decompress the zstd frame(s) in ``piece`` into exactly fill ``dst``.

    python-zstandard's stream reader, fed the whole piece at once, takes zstd's single-pass
    path: each frame whose header records its content size (every frame this codec writes)
    decodes straight into ``dst`` with the GIL released, using the bundled libzstd's
    assembly Huffman decoder, and stored (raw) zstd blocks cost a memcpy. That is 1.3-1.4x
    faster than cramjam's ``zstd.decompress_into`` on Huffman-coded planes here and ~10x on
    raw ones (``benchmarks/compression/README.md``). ``local`` keeps this thread's decompressor.
    """
    dctx = getattr(local, "dctx", None)
    if dctx is None:
        # A frame needs no window larger than the largest frame a reader accepts.
        dctx = local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_FRAME_SIZE)
    try:
        reader = dctx.stream_reader(piece, read_size=max(1, len(piece)), read_across_frames=True)
        got = 0
        while got < len(dst):
            step = reader.readinto(dst[got:])
            if not step:
                break
            got += step
        more = got == len(dst) and reader.read(1)
    except zstandard.ZstdError as e:
        raise CheckpointFormatError(f"frame {i} is not valid zstd data ({e})") from e
    if more:
        raise CheckpointFormatError(f"frame {i} decompresses to more than the expected {len(dst)} bytes")
    if got != len(dst):
        raise CheckpointFormatError(f"frame {i} decompressed to {got} bytes, expected {len(dst)}")


def scratch(local: threading.local, n: int) -> np.ndarray:
    buf = getattr(local, "scratch", None)
    if buf is None or len(buf) < n:
        buf = local.scratch = np.empty(max(n, DEFAULT_FRAME_SIZE), np.uint8)
    return buf[:n]
