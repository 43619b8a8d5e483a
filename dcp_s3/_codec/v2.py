"""Version 2 of the ``dcp_s3.zstd-frames`` codec: encode and decode one frame (format in :mod:`dcp_s3._codec.format`).

Why a version 2: version 1 splits every byte of a float element into planes and zstd-codes all
of them; decoding then pays one numpy pass per plane plus the undoing of a bit rotation, and on
Adam's ``exp_avg_sq`` a Huffman decode of a plane that entropy coding shrinks by only 1/8. Here
only the top byte of each element (sign and the high exponent bits: the part that compresses)
gets a plane; the other bytes stay together, in element order, and are stored raw unless a
sample shows zstd gains at least :data:`REST_MIN_GAIN` on them. A raw rest is read straight
from the stored bytes while joining (no copy), in cache-sized blocks
(:func:`~dcp_s3._codec.byte_planes.join_top`). Non-float frames and raw frames are as in
version 1.

Encoding is mostly zstd on the top plane (Huffman coding of its literals, and on Adam states the
match finder): the plane gets whichever of the literal-heavy setting and level ``level`` wins on a
:data:`SAMPLE_BYTES` sample of it; the rest is written straight into the stored frame
(:func:`~dcp_s3._codec.byte_planes.split_top`, ~memcpy speed), after a sample of it decided whether
zstd codes it too.

Runs on the codec's pool threads; each thread keeps its zstd compressors, its decompressor and
scratch buffers in a ``threading.local``.
"""

from __future__ import annotations

import struct
import threading
from typing import Final

import numpy as np
import zstandard

from dcp_s3._codec import v1
from dcp_s3._codec.byte_planes import join_top, split_top
from dcp_s3._codec.format import DEFAULT_FRAME_SIZE, GROUP_FLOAT, FrameIndex
from dcp_s3.errors import CheckpointFormatError

__all__ = ["HEADER", "REST_MIN_GAIN", "check_index", "encode_frame", "decode_frame", "sections"]

#: A grouped frame starts with the stored lengths of its top plane and of its rest (little-endian uint32 each).
HEADER: Final = struct.Struct("<II")
#: The rest is zstd-coded only if a sample of it shrinks by at least this fraction.
REST_MIN_GAIN: Final = 1 / 32
REST_SAMPLE: Final = 64 << 10
#: Bytes of a plane on which both zstd settings are tried (:func:`_compress`). Version 1 tries 32 KiB;
#: 16 KiB picks the same setting for every frame of the benchmark's data at half the cost.
SAMPLE_BYTES: Final = 16 << 10

check_index = v1.check_index


def encode_frame(
    local: threading.local, level: int, frame: memoryview, es: int, grouping: int
) -> tuple[bytes | bytearray | memoryview, bool]:
    """The stored bytes of one frame and whether they are the raw bytes."""
    if grouping != GROUP_FLOAT:
        return v1.encode_frame(local, level, frame, es, grouping)
    if getattr(local, "literal_cctx", None) is None:
        local.cctx = zstandard.ZstdCompressor(level=level)
        local.literal_cctx = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**v1.LITERAL_PARAMS)
        )
    n = len(frame)
    ne = n // es
    src = np.frombuffer(frame, np.uint8)
    top = _scratch(local, "top", ne)
    split_top(src, es, top, None)
    top_stored: bytes | memoryview = _compress(local, top) if ne else b""
    if len(top_stored) >= ne:
        top_stored = top.data
    # Whether zstd gains enough on the rest, judged on a sample of it.
    rest_len = ne * (es - 1)
    sample_elements = min(ne, REST_SAMPLE // (es - 1))  # whole elements: no stale scratch bytes
    sample = _scratch(local, "sample", sample_elements * (es - 1))
    split_top(src[: sample_elements * es], es, None, sample)
    pack_rest = bool(rest_len) and len(local.literal_cctx.compress(sample.data)) <= (1 - REST_MIN_GAIN) * len(sample)
    if not pack_rest and len(top_stored) == ne:  # nothing shrinks: the frame is stored raw
        return frame, True
    # The rest goes straight to its place in the stored frame (numpy's buffer: not zero-filled first).
    tail = np.frombuffer(frame[ne * es :], np.uint8)
    at = HEADER.size + len(top_stored)
    out = np.empty(at + rest_len + len(tail), np.uint8)
    rest = out[at : at + rest_len]
    split_top(src, es, None, rest)
    if pack_rest:
        packed = _compress(local, rest)
        if len(packed) < rest_len:
            out = np.empty(at + len(packed) + len(tail), np.uint8)
            out[at : at + len(packed)] = np.frombuffer(packed, np.uint8)
            rest_len = len(packed)
    if len(out) >= n:
        return frame, True
    HEADER.pack_into(out.data, 0, len(top_stored), rest_len)
    out[HEADER.size : at] = np.frombuffer(top_stored, np.uint8)
    out[at + rest_len :] = tail
    return out.data, False


def _compress(local: threading.local, plane: np.ndarray) -> bytes:
    """``plane`` zstd-coded with whichever of level ``level`` and the literal-heavy setting wins on its
    first :data:`SAMPLE_BYTES` (for planes too small to sample: the literal-heavy one)."""
    cctx = local.literal_cctx
    if len(plane) >= 2 * SAMPLE_BYTES:
        sample = plane.data[:SAMPLE_BYTES]
        if len(local.cctx.compress(sample)) < len(cctx.compress(sample)):
            cctx = local.cctx
    stored: bytes = cctx.compress(plane.data)
    return stored


def sections(index: FrameIndex, i: int, piece: memoryview) -> tuple[memoryview, memoryview, memoryview]:
    """The stored top plane, rest and trailing bytes of grouped frame ``i`` (``piece``: its stored
    bytes), after checking the header against the frame's sizes: each section is either exactly
    its raw size (stored raw) or between 1 byte and its raw size (zstd)."""
    f_start, f_end = index.raw_range(i)
    n = f_end - f_start
    es = index.element_size
    ne = n // es
    if len(piece) < HEADER.size:
        raise CheckpointFormatError(
            f"frame {i} has {len(piece)} stored bytes, fewer than its {HEADER.size}-byte header"
        )
    top_len, rest_len = HEADER.unpack_from(piece)
    for what, got, raw in (("top plane", top_len, ne), ("rest", rest_len, ne * (es - 1))):
        if not (got == raw or 0 < got < raw):
            raise CheckpointFormatError(f"frame {i}: its {what} claims {got} stored bytes for {raw} raw bytes")
    if HEADER.size + top_len + rest_len + n - ne * es != len(piece):
        raise CheckpointFormatError(
            f"frame {i} has {len(piece)} stored bytes, its header says {HEADER.size + top_len + rest_len + n - ne * es}"
        )
    a = HEADER.size + top_len
    return piece[HEADER.size : a], piece[a : a + rest_len], piece[a + rest_len :]


def decode_frame(
    local: threading.local, index: FrameIndex, i: int, piece: memoryview, lo: int, hi: int, dst: memoryview
) -> None:
    """Decode raw bytes ``[lo, hi)`` (relative to the frame) of frame ``i`` into ``dst``."""
    if index.is_raw(i) or index.grouping != GROUP_FLOAT:
        v1.decode_frame(local, index, i, piece, lo, hi, dst)
        return
    f_start, f_end = index.raw_range(i)
    n = f_end - f_start
    es = index.element_size
    ne = n // es
    top_s, rest_s, tail = sections(index, i, piece)
    top, rest = np.frombuffer(top_s, np.uint8), np.frombuffer(rest_s, np.uint8)
    if len(top) != ne:
        top = _scratch(local, "top", ne)
        v1.decompress_into(local, top_s, top.data, i)
    if len(rest) != ne * (es - 1):
        rest = _scratch(local, "rest", ne * (es - 1))
        v1.decompress_into(local, rest_s, rest.data, i)
    out = np.frombuffer(dst, np.uint8)
    a, b = -(-lo // es), min(hi // es, ne)  # whole elements inside [lo, hi)
    if a < b:
        join_top(top, rest, ne, es, a, b, out[a * es - lo : b * es - lo])
        pieces: tuple[tuple[int, int], ...] = ((lo, a * es), (b * es, hi))
    else:
        pieces = ((lo, hi),)
    element = np.empty(es, np.uint8)
    for s, e in pieces:  # partial elements and the trailing bytes, if any
        while s < e:
            if s >= ne * es:
                out[s - lo : e - lo] = np.frombuffer(tail, np.uint8)[s - ne * es : e - ne * es]
                break
            el = s // es
            stop = min(e, (el + 1) * es)
            join_top(top, rest, ne, es, el, el + 1, element)
            out[s - lo : stop - lo] = element[s - el * es : stop - el * es]
            s = stop


def _scratch(local: threading.local, name: str, n: int) -> np.ndarray:
    buf = getattr(local, f"v2_{name}", None)
    if buf is None or len(buf) < n:
        buf = np.empty(max(n, DEFAULT_FRAME_SIZE // 2), np.uint8)
        setattr(local, f"v2_{name}", buf)
    return buf[:n]
