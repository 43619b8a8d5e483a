"""Codec version 2: its stored layout, its kernels, the frames version 1 wrote, and hostile v2 frames.

The hostile frames are crafted here byte by byte (header, top plane, rest, trailing bytes), the
way a lying bucket could store them behind an honest-looking frame index; every one must be a
``CheckpointFormatError`` naming the frame, never a crash, a wrong result or an allocation the
index did not allow.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_s3._codec import CODEC_NAME, GROUP_FLOAT, Codec, FrameIndex, grouping_for_dtype, stored_span
from dcp_s3._codec.byte_planes import join_top, split_top
from dcp_s3._codec.v2 import HEADER
from dcp_s3.errors import CheckpointFormatError

FAST = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def weights(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy()


def encode(codec: Codec, data: Any, es: int, floating: bool = True) -> tuple[FrameIndex, bytes]:
    parts: list[bytes] = []
    index = codec.encode(data, es, floating, lambda b: parts.append(bytes(b)))
    return index, b"".join(parts)


def decode(index: FrameIndex, stored: bytes, start: int = 0, end: int | None = None) -> bytes:
    end = index.raw_length if end is None else end
    s, e = stored_span(index, start, end)
    out = bytearray(end - start)
    with Codec(threads=2) as c:
        c.decode_into(index, memoryview(stored)[s:e], s, start, end, out)
    return bytes(out)


# ---------------------------------------------------------------- the layout and the kernels


def reference_split(src: bytes, es: int) -> tuple[bytes, bytes]:
    """The documented layout, written the obvious way: top = byte es-1 of each element, rest = the others."""
    ne = len(src) // es
    elements = [src[i * es : (i + 1) * es] for i in range(ne)]
    return bytes(e[es - 1] for e in elements), b"".join(e[: es - 1] for e in elements)


@FAST
@given(
    data=st.binary(max_size=3000),
    es=st.sampled_from([2, 4, 8]),
    ab=st.tuples(st.integers(0, 400), st.integers(0, 400)),
    block=st.sampled_from([1, 3, 64, 1 << 16]),
    shift=st.integers(0, 7),
    src_shift=st.integers(0, 7),
)
def test_split_and_join_match_the_documented_layout(
    data: bytes, es: int, ab: tuple[int, int], block: int, shift: int, src_shift: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_s3._codec import byte_planes

    monkeypatch.setattr(byte_planes, "BLOCK_ELEMENTS", block)  # block edges inside small inputs
    # Any alignment of the source and of the rest (the encoder writes the rest at any offset of the
    # stored frame), and bytes around them that splitting must leave alone.
    src = np.frombuffer(bytes(src_shift) + data, np.uint8)[src_shift:]
    ne = len(data) // es
    top = np.full(ne, 7, np.uint8)
    rest_backing = np.full(ne * (es - 1) + 16, 7, np.uint8)
    rest = rest_backing[shift : shift + ne * (es - 1)]
    split_top(src, es, top, rest)
    assert (top.tobytes(), rest.tobytes()) == reference_split(data, es)
    assert (rest_backing[:shift] == 7).all() and (rest_backing[shift + ne * (es - 1) :] == 7).all()
    top2 = np.full(ne, 9, np.uint8)
    split_top(src, es, top2, None)  # either part alone
    assert top2.tobytes() == top.tobytes()
    rest2 = np.full(ne * (es - 1), 9, np.uint8)
    split_top(src, es, None, rest2)
    assert rest2.tobytes() == rest.tobytes()
    a, b = sorted((min(ab[0], ne), min(ab[1], ne)))
    backing = np.zeros((b - a) * es + 8, np.uint8)
    out = backing[shift : shift + (b - a) * es]  # any alignment
    join_top(top, rest, ne, es, a, b, out)
    assert out.tobytes() == data[a * es : b * es]
    # From read-only stored bytes (a raw rest is read in place).
    ro_top, ro_rest = np.frombuffer(top.tobytes(), np.uint8), np.frombuffer(rest.tobytes(), np.uint8)
    join_top(ro_top, ro_rest, ne, es, a, b, out)
    assert out.tobytes() == data[a * es : b * es]


def test_stored_frame_layout() -> None:
    # The stored bytes of a version 2 float frame, as docs/stored-format.md and codec.format describe them.
    raw = weights(5000).tobytes() + b"xyz"  # 5000 fp32 elements and 3 trailing bytes
    with Codec(threads=1, frame_size=1 << 20) as c:
        index, stored = encode(c, raw, 4)
    assert (index.codec, index.version, index.grouping, index.raw_frames) == (CODEC_NAME, 2, GROUP_FLOAT, 0)
    top_len, rest_len = HEADER.unpack_from(stored)
    assert HEADER.size == 8 and stored[:8] == struct.pack("<II", top_len, rest_len)
    top, rest = reference_split(raw, 4)
    assert 0 < top_len < len(top)  # sign and exponent bytes compress...
    assert zstandard.ZstdDecompressor().decompress(stored[8 : 8 + top_len]) == top
    assert rest_len == len(rest)  # ...the mantissa bytes of weights do not: stored raw, in element order
    assert stored[8 + top_len : 8 + top_len + rest_len] == rest
    assert stored[8 + top_len + rest_len :] == b"xyz"
    assert len(stored) == 8 + top_len + rest_len + 3


def test_compressible_rest_is_zstd_coded() -> None:
    # Small integers as float64: the low mantissa bytes are zero, zstd gains on the rest.
    raw = torch.arange(20_000, dtype=torch.float64).view(torch.uint8).numpy().tobytes()
    with Codec(threads=1, frame_size=1 << 20) as c:
        index, stored = encode(c, raw, 8)
    top_len, rest_len = HEADER.unpack_from(stored)
    assert rest_len < 20_000 * 7
    assert (
        zstandard.ZstdDecompressor().decompress(stored[8 + top_len : 8 + top_len + rest_len])
        == reference_split(raw, 8)[1]
    )
    assert decode(index, stored) == raw
    assert decode(index, stored, 13, 70_001) == raw[13:70_001]


# ---------------------------------------------------------------- the encoder's choices


def _kinds() -> dict[str, tuple[bytes, int]]:
    """Data whose top planes and rests take every path of the encoder: (raw bytes, element size).
    Sizes: one whole default frame and a part of one, odd element counts, trailing bytes."""
    g = torch.Generator().manual_seed(1)
    n = (1 << 20) + 12_345  # fp32 elements: a 4 MiB frame, then more
    grad = torch.randn(n, generator=g) * 1e-3
    adam_sq = (grad * grad).abs() + 1e-12  # exp_avg_sq-like: positive, sign byte constant
    tiled = (torch.randn(4096, generator=g) * 0.02).repeat(n // 4096 + 1)[:n]  # repeats: level 1 wins
    special = torch.randn(n, generator=g) * 0.02
    special[::97], special[1::89], special[2::83] = float("nan"), float("inf"), -0.0
    return {
        "bf16 weights": (weights(2 * n + 1, torch.bfloat16).tobytes() + b"t", 2),
        "fp16 weights": (weights(2 * n + 3, torch.float16).tobytes(), 2),
        "fp32 weights": (weights(n).tobytes() + b"ab", 4),
        "fp64 weights": (weights(n // 2 + 1, torch.float64).tobytes() + b"abcdefg", 8),
        "adam exp_avg": (grad.numpy().tobytes(), 4),
        "adam exp_avg_sq": (adam_sq.numpy().tobytes() + b"xyz", 4),
        "repeating rows": (tiled.numpy().tobytes(), 4),
        "nan, inf, -0": (special.numpy().tobytes(), 4),
        "zeros": (bytes(4 * n + 1), 4),
        "small integers as fp64": (torch.arange(n // 2, dtype=torch.float64).numpy().tobytes(), 8),
        "random bytes": (np.random.default_rng(0).integers(0, 256, 4 * n + 5, dtype=np.uint8).tobytes(), 4),
    }


def test_encoder_round_trips_every_kind_in_whole_frames() -> None:
    # Frames of the default size (4 MiB): the top plane's zstd setting is chosen on a sample, and the
    # rest's layout is written by the overlapping stores of split_top, as saves do it.
    from dcp_s3._codec import v1

    literal = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**v1.LITERAL_PARAMS))
    level_1 = zstandard.ZstdCompressor(level=1)
    settings_seen = set()
    with Codec(threads=2) as c:
        for name, (raw, es) in _kinds().items():
            index, stored = encode(c, raw, es)
            assert (index.version, index.grouping) == (2, GROUP_FLOAT), name
            assert decode(index, stored) == raw, name
            for a, b in ((0, 1), (4095, 3 * es + 4097), (len(raw) - 9, len(raw)), ((4 << 20) - 5, (4 << 20) + 7)):
                assert decode(index, stored, a, b) == raw[a:b], (name, a, b)
            for i in range(index.num_frames):  # each frame: the documented layout, the top plane coded as chosen
                if index.is_raw(i):
                    continue
                f_start, f_end = index.raw_range(i)
                piece = stored[index.stored_range(i)[0] : index.ends[i]]
                top, rest = reference_split(raw[f_start:f_end], es)
                top_len, rest_len = HEADER.unpack_from(piece)
                stored_top = piece[8 : 8 + top_len]
                if top_len < len(top):
                    chosen = {"literal-heavy": literal.compress(top), "level 1": level_1.compress(top)}
                    settings_seen |= {k for k, v in chosen.items() if v == stored_top}
                    assert stored_top in chosen.values(), (name, i)
                if rest_len == len(rest):
                    assert piece[8 + top_len : 8 + top_len + rest_len] == rest, (name, i)
            if name in ("fp32 weights", "random bytes"):
                assert index.raw_frames == (0 if name == "fp32 weights" else 2**index.num_frames - 1), name
    assert settings_seen == {"literal-heavy", "level 1"}  # both settings were chosen somewhere


class _Counting:
    """A real zstd compressor that records how many bytes it was given."""

    def __init__(self, real: zstandard.ZstdCompressor) -> None:
        self.real = real
        self.sizes: list[int] = []

    def compress(self, data: Any) -> bytes:
        self.sizes.append(memoryview(data).nbytes)
        stored: bytes = self.real.compress(data)
        return stored


@pytest.mark.parametrize(
    ("dtype", "rest_packed"), [(torch.float32, False), (torch.bfloat16, False), (torch.float64, True)]
)
def test_encoder_zstd_work_per_frame(dtype: torch.dtype, rest_packed: bool) -> None:
    # What zstd is given per 4 MiB float frame: the top plane once, two samples of it to choose the setting,
    # one sample of the rest, and the rest itself (with two samples of its own) only when that sample shrinks
    # (small integers as float64). The samples stay under 10% of the bytes coded (with version 1's 32 KiB
    # samples an fp32 frame's were 12.5%).
    from dcp_s3._codec import v1, v2

    n = (4 << 20) // dtype.itemsize
    raw = torch.arange(n, dtype=dtype).view(torch.uint8).numpy() if rest_packed else weights(n, dtype)
    es = dtype.itemsize
    local = threading.local()
    local.cctx = _Counting(zstandard.ZstdCompressor(level=1))
    local.literal_cctx = _Counting(
        zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**v1.LITERAL_PARAMS))
    )
    stored, is_raw = v2.encode_frame(local, 1, memoryview(raw), es, GROUP_FLOAT)
    assert not is_raw
    samples = local.cctx.sizes + local.literal_cctx.sizes
    planes = [n, n * (es - 1)] if rest_packed else [n]
    for plane in planes:
        samples.remove(plane)  # each plane given to zstd exactly once
    rest_sample = v2.REST_SAMPLE - v2.REST_SAMPLE % (es - 1)  # whole elements' rests
    assert samples.count(rest_sample) == 1, samples
    assert sum(samples) <= 0.1 * sum(planes), samples
    index = FrameIndex(CODEC_NAME, 2, es, GROUP_FLOAT, len(raw), len(raw), (len(stored),))
    assert decode(index, bytes(stored)) == raw.tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float16])
def test_version_1_frames_still_decode(dtype: torch.dtype) -> None:
    raw = weights(50_000, dtype).tobytes() + b"!"
    es, floating = grouping_for_dtype(dtype)
    with Codec(threads=2, frame_size=64 << 10, version=1) as old:
        index, stored = encode(old, raw, es, floating)
    assert index.version == 1
    assert decode(index, stored) == raw  # a reader with the default (version 2) codec
    assert decode(index, stored, 1001, 77_777) == raw[1001:77_777]
    with Codec(threads=2, frame_size=64 << 10) as new:
        index2, stored2 = encode(new, raw, es, floating)
    assert index2.version == 2 and stored2 != stored


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ratio_within_2_percent_of_version_1_on_weights(dtype: torch.dtype) -> None:
    raw = weights(1 << 20, dtype)
    es, floating = grouping_for_dtype(dtype)
    sizes = []
    for version in (1, 2):
        with Codec(threads=2, version=version) as c:
            sizes.append(encode(c, raw, es, floating)[0].stored_length)
    assert sizes[1] <= 1.02 * sizes[0], sizes


# ---------------------------------------------------------------- hostile frames

NE = 1000  # fp32 elements in the crafted frame: small integers, so that both sections compress
RAW = torch.arange(NE, dtype=torch.float32).view(torch.uint8).numpy().tobytes()
TOP, REST = reference_split(RAW, 4)
ZTOP = zstandard.ZstdCompressor(level=1).compress(TOP)


def crafted(body: bytes, raw_length: int = NE * 4) -> tuple[FrameIndex, bytes]:
    return FrameIndex(CODEC_NAME, 2, 4, GROUP_FLOAT, raw_length, 1 << 20, (len(body),)), body


def frame(top: bytes, rest: bytes, tail: bytes = b"", header: tuple[int, int] | None = None) -> bytes:
    return struct.pack("<II", *(header or (len(top), len(rest)))) + top + rest + tail


def test_crafted_genuine_frames_decode() -> None:
    # The crafted frames below differ from these in one thing each.
    assert decode(*crafted(frame(ZTOP, REST))) == RAW
    assert decode(*crafted(frame(TOP, REST))) == RAW  # a raw top plane
    z = zstandard.ZstdCompressor(level=3)
    assert decode(*crafted(frame(ZTOP, z.compress(REST[:9]) + z.compress(REST[9:])))) == RAW  # zstd rest, 2 frames
    assert decode(*crafted(frame(ZTOP, REST, b"ab"), NE * 4 + 2)) == RAW + b"ab"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "fewer than its 8-byte header"),
        (struct.pack("<I", 5), "fewer than its 8-byte header"),
        (frame(ZTOP, REST, header=(NE + 1, len(REST))), "top plane claims 1001 stored bytes for 1000 raw"),
        (frame(b"", REST), "top plane claims 0 stored bytes"),
        (frame(ZTOP, REST, header=(len(ZTOP), len(REST) + 1)), "rest claims 3001 stored bytes for 3000 raw"),
        (frame(ZTOP, b""), "rest claims 0 stored bytes"),
        (frame(ZTOP, REST, header=(2**32 - 1, 2**32 - 1)), "claims 4294967295 stored bytes"),
        (frame(ZTOP, REST, b"!"), "its header says"),  # one byte too many
        (frame(ZTOP, REST)[:-1], "its header says"),  # one byte short
        (frame(ZTOP, REST, header=(len(ZTOP) - 1, len(REST))), "its header says"),
        (frame(ZTOP[:-3], REST), "frame 0"),  # truncated zstd
        (frame(b"\x28\xb5\x2f\xfd" + b"\0" * 40, REST), "frame 0"),  # zstd magic, then garbage
        (frame(b"\x11" * 40, REST), "frame 0 is not valid zstd"),
        (frame(zstandard.ZstdCompressor().compress(TOP + b"x"), REST), "more than the expected 1000"),
        (frame(zstandard.ZstdCompressor().compress(TOP[:-1]), REST), "decompressed to 999 bytes, expected 1000"),
        (frame(ZTOP, zstandard.ZstdCompressor().compress(REST + REST)[:2999]), "frame 0"),
        (frame(ZTOP, zstandard.ZstdCompressor().compress(REST[:-4])), "decompressed to 2996 bytes, expected 3000"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_hostile_frames_are_format_errors(body: bytes, match: str) -> None:
    index, stored = crafted(body)
    for start, end in ((0, NE * 4), (5, 9), (NE * 4 - 1, NE * 4)):
        with pytest.raises(CheckpointFormatError, match=match):
            decode(index, stored, start, end)


def test_hostile_sizes_allocate_nothing_beyond_the_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    # Section lengths are checked against the frame's raw size (from the index, itself bounded by
    # MAX_FRAME_SIZE) before any buffer is sized: a header claiming 4 GiB sections fails first.
    from dcp_s3._codec import v2

    sized: list[int] = []
    real = v2._scratch
    monkeypatch.setattr(v2, "_scratch", lambda local, name, n: sized.append(n) or real(local, name, n))
    with pytest.raises(CheckpointFormatError):
        decode(*crafted(frame(ZTOP, REST, header=(2**31, 2**31))))
    assert sized == []
    decode(*crafted(frame(ZTOP, REST)))
    assert max(sized) <= NE * 4
