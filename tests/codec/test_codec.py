"""Tests of dcp_s3._codec: round trips, ranged decode, index format, pipelining."""

from __future__ import annotations

import bisect
import dataclasses
import io
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_s3._codec import (
    CODEC_NAME,
    CODEC_VERSION,
    GROUP_FLOAT,
    GROUP_NONE,
    Codec,
    FrameIndex,
    grouping_for_dtype,
    stored_span,
)
from dcp_s3.errors import CheckpointFormatError

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]
FAST = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def codec() -> Iterator[Codec]:
    with Codec(threads=2, frame_size=4096) as c:
        yield c


def encode(codec: Codec, data: Any, element_size: int = 1, floating: bool = False) -> tuple[FrameIndex, bytes]:
    parts: list[bytes] = []
    index = codec.encode(data, element_size, floating, lambda b: parts.append(bytes(b)))
    stored = b"".join(parts)
    assert len(stored) == index.stored_length
    return index, stored


def decode(codec: Codec, index: FrameIndex, stored: bytes, start: int = 0, end: int | None = None) -> bytes:
    end = index.raw_length if end is None else end
    s, e = stored_span(index, start, end)
    out = bytearray(end - start)
    codec.decode_into(index, memoryview(stored)[s:e], s, start, end, out)
    return bytes(out)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def weights(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 3000))
    if draw(st.booleans()) or not (dtype.is_floating_point or dtype.is_complex):
        raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return (
        weights(n * (2 if dtype.is_complex else 1), torch.float32, draw(st.integers(0, 9)))
        .view(torch.complex64)
        .to(dtype)
        if dtype.is_complex
        else weights(n, dtype, draw(st.integers(0, 9)))
    )


# ---------------------------------------------------------------- round trips


@FAST
@given(
    t=tensors(),
    frame_size=st.sampled_from([1, 8, 100, 1000, 4096, 1 << 16]),
    threads=st.sampled_from([1, 3]),
    version=st.sampled_from([1, 2]),
)
def test_round_trip_every_dtype(t: torch.Tensor, frame_size: int, threads: int, version: int) -> None:
    es, floating = grouping_for_dtype(t.dtype)
    raw = tensor_bytes(t)
    with Codec(threads=threads, frame_size=frame_size, version=version) as c:
        index, stored = encode(c, raw.data, es, floating)
        assert index.version == version
        assert index.raw_length == len(raw)
        assert index.frame_size % es == 0
        assert index.grouping == (GROUP_FLOAT if floating and es > 1 else GROUP_NONE)
        assert decode(c, index, stored) == raw.tobytes()
        back = torch.frombuffer(bytearray(decode(c, index, stored)), dtype=torch.uint8) if len(raw) else None
        if back is not None:
            assert torch.equal(back.view(t.dtype).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@FAST
@given(
    data=st.binary(max_size=20000),
    es=st.sampled_from([1, 2, 3, 4, 8, 16]),
    floating=st.booleans(),
    version=st.sampled_from([1, 2]),
)
def test_round_trip_random_bytes_any_length(codec: Codec, data: bytes, es: int, floating: bool, version: int) -> None:
    # Lengths need not be multiples of the element size: the tail is stored ungrouped.
    with Codec(threads=2, frame_size=4096, version=version) as writer:
        index, stored = encode(writer, data, es, floating)
    assert index.version == version
    assert decode(codec, index, stored) == data  # the default codec reads every version


@FAST
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64, torch.int32]),
    n=st.integers(0, 5000),
)
def test_chunked_input_matches_single_buffer(codec: Codec, data: st.DataObject, dtype: torch.dtype, n: int) -> None:
    raw = tensor_bytes(weights(n, dtype) if dtype.is_floating_point else torch.arange(n, dtype=dtype))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    es, floating = grouping_for_dtype(dtype)
    want = encode(codec, raw, es, floating)
    assert encode(codec, iter(chunks), es, floating) == want
    parts: list[bytes] = []
    index = codec.encode(iter(chunks), es, floating, lambda b: parts.append(bytes(b)), stable_chunks=True)
    assert (index, b"".join(parts)) == want


def test_chunk_buffer_may_be_reused_after_next_is_requested(codec: Codec) -> None:
    raw = tensor_bytes(weights(50_000, torch.bfloat16))
    buf = bytearray(3 * 4096 + 100)  # chunks span frames and frame boundaries

    def reused() -> Iterator[memoryview]:
        for pos in range(0, len(raw), len(buf)):
            piece = raw[pos : pos + len(buf)]
            buf[: len(piece)] = piece.tobytes()
            yield memoryview(buf)[: len(piece)]
            buf[:] = b"\xff" * len(buf)  # the producer scribbles over the old chunk

    index, stored = encode(codec, reused(), 2, True)
    assert decode(codec, index, stored) == raw.tobytes()


def test_empty_and_single_element(codec: Codec) -> None:
    calls: list[Any] = []
    index = codec.encode(b"", 4, True, calls.append)
    assert calls == [] and index.num_frames == 0 and index.stored_length == 0
    assert stored_span(index, 0, 0) == (0, 0)
    codec.decode_into(index, b"", 0, 0, 0, bytearray())
    assert encode(codec, iter([]), 2, True)[0] == index.__class__(
        CODEC_NAME, CODEC_VERSION, 2, GROUP_FLOAT, 0, 4096, (), 0
    )
    one = tensor_bytes(torch.tensor([1.5], dtype=torch.bfloat16))
    index, stored = encode(codec, one, 2, True)
    assert index.num_frames == 1 and decode(codec, index, stored) == one.tobytes()


# ---------------------------------------------------------------- ranged reads


@pytest.fixture(scope="module")
def encoded_items(codec: Codec) -> dict[str, tuple[np.ndarray, FrameIndex, bytes]]:
    items = {}
    for name, t in {
        "bf16": weights(30_000, torch.bfloat16),
        "fp32": weights(20_000),
        "f64": weights(9_001, torch.float64),
        "int": torch.arange(10_000, dtype=torch.int64),
    }.items():
        raw = tensor_bytes(t)
        es, floating = grouping_for_dtype(t.dtype)
        items[name] = (raw, *encode(codec, raw, es, floating))
        with Codec(threads=2, frame_size=4096, version=1) as v1_codec:  # what 0.2-0.3 wrote
            items[f"v1 {name}"] = (raw, *encode(v1_codec, raw, es, floating))
    return items


@FAST
@given(
    name=st.sampled_from(["bf16", "fp32", "f64", "int"]),
    a=st.integers(0, 100_000),
    b=st.integers(0, 100_000),
    slack=st.integers(0, 5000),
    version=st.sampled_from(["", "v1 "]),
)
def test_ranged_decode_equals_slice(
    codec: Codec, encoded_items: dict[str, Any], name: str, a: int, b: int, slack: int, version: str
) -> None:
    raw, index, stored = encoded_items[version + name]
    assert index.version == (1 if version else 2)
    a, b = sorted((a % (len(raw) + 1), b % (len(raw) + 1)))
    s, e = stored_span(index, a, b)
    if a < b:  # the span is frame aligned and minimal
        assert s == index.stored_range(a // index.frame_size)[0]
        assert e == index.ends[(b - 1) // index.frame_size]
    assert decode(codec, index, stored, a, b) == raw[a:b].tobytes()
    # A larger fetched window (for example a coalesced GET) works too.
    s0 = max(0, s - slack)
    out = bytearray(b - a)
    codec.decode_into(index, stored[s0 : e + slack], s0, a, b, out)
    assert out == raw[a:b].tobytes()


def test_ranged_decode_into_numpy_and_unaligned_views(codec: Codec, encoded_items: dict[str, Any]) -> None:
    raw, index, stored = encoded_items["fp32"]
    target = np.zeros(len(raw) + 1, np.uint8)
    codec.decode_into(index, stored, 0, 0, len(raw), target.data[1:])  # odd address
    assert target[1:].tobytes() == raw.tobytes()
    dst = torch.empty(len(raw) // 4, dtype=torch.float32)
    codec.decode_into(index, stored, 0, 0, len(raw), dst.numpy())
    assert dst.view(torch.uint8).numpy().tobytes() == raw.tobytes()


def test_decode_argument_errors(codec: Codec, encoded_items: dict[str, Any]) -> None:
    raw, index, stored = encoded_items["bf16"]
    with pytest.raises(ValueError, match="outside"):
        stored_span(index, 0, len(raw) + 1)
    with pytest.raises(ValueError, match="out has"):
        codec.decode_into(index, stored, 0, 0, 10, bytearray(9))
    with pytest.raises(ValueError, match="do not cover"):
        codec.decode_into(index, stored[1:], 1, 0, 10, bytearray(10))
    with pytest.raises(TypeError):
        codec.decode_into(index, stored, 0, 0, 10, b"0123456789")


def test_corrupt_frame_is_a_format_error(codec: Codec) -> None:
    # Version 1 frames (version 2's hostile frames: test_codec_v2.py).
    # (Bit flips inside zstd literals are not detected here: stored bytes are
    # checksummed by the transport.)
    with Codec(threads=2, frame_size=4096, version=1) as v1_codec:
        index, stored = encode(v1_codec, tensor_bytes(weights(20_000)), 4, True)
    assert index.version == 1
    assert not index.is_raw(0)
    truncated = dataclasses.replace(index, ends=tuple(e - 5 for e in index.ends))
    with pytest.raises(CheckpointFormatError, match="frame 0"):
        codec.decode_into(truncated, stored, 0, 0, 100, bytearray(100))
    s, e = index.stored_range(0)
    with pytest.raises(CheckpointFormatError, match="frame 0"):
        codec.decode_into(index, b"\0" * (e - s), s, 0, 100, bytearray(100))
    longer = dataclasses.replace(index, ends=(index.ends[0] + index.ends[1],), raw_length=index.frame_size)
    with pytest.raises(CheckpointFormatError, match="more than"):
        codec.decode_into(longer, stored + stored, 0, 0, 100, bytearray(100))


# ---------------------------------------------------------------- raw frames, compression


def test_incompressible_frames_are_stored_raw(codec: Codec) -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 3 * 4096 + 10, dtype=np.uint8)
    index, stored = encode(codec, noise, 4, True)
    assert index.raw_frames == (1 << index.num_frames) - 1
    assert stored == noise.tobytes()
    assert index.ends == (4096, 8192, 12288, 12298)
    # Mixed: frames alternate between zeros and noise.
    mixed = noise.copy()
    mixed[4096:8192] = 0
    index, stored = encode(codec, mixed, 4, True)
    assert [index.is_raw(i) for i in range(4)] == [True, False, True, True]
    assert len(stored) < len(mixed) - 4000
    assert decode(codec, index, stored) == mixed.tobytes()
    assert decode(codec, index, stored, 4000, 8200) == mixed[4000:8200].tobytes()


def test_byte_grouping_beats_plain_zstd_on_weights() -> None:
    with Codec(threads=2) as c:
        for dtype, limit in ((torch.bfloat16, 0.72), (torch.float32, 0.87)):
            raw = tensor_bytes(weights(1 << 20, dtype))
            index, stored = encode(c, raw, *grouping_for_dtype(dtype))
            plain, _ = encode(c, raw, 1, False)
            assert index.stored_length / len(raw) < limit
            assert index.stored_length < 0.95 * plain.stored_length
            assert index.raw_frames == 0


def test_output_is_deterministic_across_thread_counts() -> None:
    raw = tensor_bytes(weights(200_000))
    results = []
    for threads in (1, 2, 4):
        with Codec(threads=threads, frame_size=64 << 10) as c:
            results.append(encode(c, raw, 4, True))
    assert results[0] == results[1] == results[2]


# ---------------------------------------------------------------- index format, registry


def test_frame_index_pickles_and_is_frozen(encoded_items: dict[str, Any]) -> None:
    _, index, _ = encoded_items["bf16"]
    back = pickle.loads(pickle.dumps(index))
    assert back == index and hash(back) == hash(index)
    assert len(pickle.dumps(index)) < 200 + 5 * index.num_frames
    with pytest.raises(dataclasses.FrozenInstanceError):
        index.raw_length = 3  # type: ignore[misc,unused-ignore]
    assert not hasattr(index, "__dict__")


@pytest.mark.parametrize("change", [{"codec": "lz4-frames"}, {"version": 99}])
def test_unknown_codec_or_version_names_it(codec: Codec, encoded_items: dict[str, Any], change: dict[str, Any]) -> None:
    raw, index, stored = encoded_items["int"]
    bad = dataclasses.replace(index, **change)
    with pytest.raises(CheckpointFormatError) as info:
        codec.decode_into(bad, stored, 0, 0, 10, bytearray(10))
    assert repr(bad.codec) in str(info.value) and f"version {bad.version}" in str(info.value)
    assert repr(CODEC_NAME) in str(info.value)  # says what it can read
    assert isinstance(info.value, ValueError)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


def test_index_from_a_newer_codec_fails_clearly_on_unpickle(
    encoded_items: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, index, _ = encoded_items["int"]
    fn, args, state = index.__reduce__()
    newer = ("zstd-frames-next", 2, *state[2:], "a new field")
    with monkeypatch.context() as m:
        m.setattr(FrameIndex, "__reduce__", lambda self: (fn, args, newer))
        blob = pickle.dumps(index)
    with pytest.raises(CheckpointFormatError, match="'zstd-frames-next' version 2"):
        pickle.loads(blob)


def test_pickle_references_only_the_frame_index_class(encoded_items: dict[str, Any]) -> None:
    # dcp_s3._layout unpickles metadata with an allow-list of classes.
    _, index, _ = encoded_items["bf16"]

    class Strict(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            assert (module, name) == ("dcp_s3.codec", "FrameIndex")
            return super().find_class(module, name)

    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert Strict(io.BytesIO(pickle.dumps(index, protocol))).load() == index


def test_frame_index_validates_structure() -> None:
    with pytest.raises(CheckpointFormatError, match="frames"):
        FrameIndex(CODEC_NAME, 1, 4, GROUP_FLOAT, 100, 64, (10,))
    with pytest.raises(CheckpointFormatError, match="multiple"):
        FrameIndex(CODEC_NAME, 1, 4, GROUP_FLOAT, 100, 66, (10, 20))
    with pytest.raises(CheckpointFormatError, match="decrease"):
        FrameIndex(CODEC_NAME, 1, 4, GROUP_FLOAT, 100, 64, (30, 20))
    bad = FrameIndex(CODEC_NAME, 1, 3, GROUP_FLOAT, 9, 9, (9,), 0)
    with pytest.raises(CheckpointFormatError, match="grouping"):
        Codec().decode_into(bad, bytes(9), 0, 0, 9, bytearray(9))


def test_grouping_for_dtype() -> None:
    assert grouping_for_dtype(torch.bfloat16) == (2, True)
    assert grouping_for_dtype(torch.float16) == (2, True)
    assert grouping_for_dtype(torch.float32) == (4, True)
    assert grouping_for_dtype(torch.float64) == (8, True)
    assert grouping_for_dtype(torch.complex64) == (4, True)
    assert grouping_for_dtype(torch.complex128) == (8, True)
    assert grouping_for_dtype(torch.float8_e4m3fn) == (1, False)
    assert grouping_for_dtype(torch.int64) == (8, False)
    assert grouping_for_dtype(torch.bool) == (1, False)
    assert grouping_for_dtype(np.dtype(np.float32)) == (4, True)
    assert grouping_for_dtype(np.dtype(np.int16)) == (2, False)


def test_codec_pickles_and_does_not_import_torch() -> None:
    c = pickle.loads(pickle.dumps(Codec(level=3, threads=3, frame_size=1000, max_in_flight=5, version=1)))
    assert (c.level, c.threads, c.frame_size, c.max_in_flight, c.version) == (3, 3, 1000, 5, 1)
    assert Codec().version == CODEC_VERSION == 2  # new saves write version 2
    index, stored = encode(c, b"abc" * 1000)
    assert decode(c, index, stored) == b"abc" * 1000
    c.close()
    code = (
        "import sys, dcp_s3\n"
        "if 'torch' in sys.modules: sys.exit(0)  # the package itself may need torch\n"
        "import dcp_s3._codec\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Codec(threads=0)
    with pytest.raises(ValueError):
        Codec(frame_size=0)
    with pytest.raises(ValueError):
        Codec(level=1000)
    with pytest.raises(ValueError):
        Codec().encode(b"x", 0, False, print)
    for version in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="writes"):
            Codec(version=version)  # type: ignore[arg-type]


# ---------------------------------------------------------------- pipelining


class _SlowCodec(Codec):
    """Counts frames handed to workers; later frames finish first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = 0
        self.count_lock = threading.Lock()

    def _encode_frame(self, frame: memoryview, es: int, grouping: int) -> Any:
        with self.count_lock:
            self.started += 1
            k = self.started
        time.sleep(0.004 * (k % 3 == 1))
        return super()._encode_frame(frame, es, grouping)


@pytest.mark.parametrize("chunked", [False, True])
def test_frames_emitted_in_order_with_bounded_in_flight(chunked: bool) -> None:
    raw = tensor_bytes(weights(60_000))
    c = _SlowCodec(threads=3, frame_size=4096, max_in_flight=4)
    calls: list[tuple[int, int]] = []  # (frames started, stored bytes emitted before this piece)
    parts: list[bytes] = []

    def sink(b: Any) -> None:
        calls.append((c.started, sum(map(len, parts))))
        parts.append(bytes(b))
        time.sleep(0.001)

    pulls: list[tuple[int, int]] = []  # (raw bytes pulled, stored bytes emitted)

    def chunks() -> Iterator[np.ndarray]:
        for pos in range(0, len(raw), 40_000):
            pulls.append((pos, sum(map(len, parts))))
            yield raw[pos : pos + 40_000]

    with c:
        index = c.encode(chunks() if chunked else raw.data, 4, True, sink)
        assert c.started == index.num_frames
        stored = b"".join(parts)
        assert decode(c, index, stored) == raw.tobytes()
        # Frames still being compressed or waiting, counting the one being emitted.
        outstanding = [started - bisect.bisect_right(index.ends, before) for started, before in calls]
        assert 1 <= max(outstanding) <= 4
        for pos, emitted in pulls:  # input is pulled lazily: at most a chunk and the in-flight frames ahead
            assert pos - bisect.bisect_right(index.ends, emitted) * 4096 <= 40_000 + 4 * 4096


def test_sink_error_propagates_and_codec_stays_usable(codec: Codec) -> None:
    def sink(_: Any) -> None:
        raise OSError("upload failed")

    with pytest.raises(OSError, match="upload failed"):
        codec.encode(bytes(100_000), 1, False, sink)
    index, stored = encode(codec, bytes(100_000))
    assert decode(codec, index, stored) == bytes(100_000)


def test_one_codec_shared_by_many_threads() -> None:
    raws = [
        tensor_bytes(weights(30_000 + 1000 * i, dtype, seed=i))
        for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float64, torch.float16] * 2)
    ]
    errors: list[BaseException] = []
    with Codec(threads=2, frame_size=8192) as c:

        def work(raw: np.ndarray) -> None:
            try:
                es, floating = grouping_for_dtype(torch.float32 if len(raw) % 4 == 0 else torch.bfloat16)
                for _ in range(3):
                    index, stored = encode(c, raw, es, floating)
                    assert decode(c, index, stored) == raw.tobytes()
                    assert decode(c, index, stored, 5, len(raw) - 7) == raw[5:-7].tobytes()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(raw,)) for raw in raws]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_reader_accepts_a_frame_made_of_several_zstd_frames(codec: Codec) -> None:
    import zstandard

    a, b = b"first part " * 300, bytes(range(256)) * 20
    cctx = zstandard.ZstdCompressor(level=3)
    stored = cctx.compress(a) + cctx.compress(b)
    index = FrameIndex(CODEC_NAME, CODEC_VERSION, 1, GROUP_NONE, len(a + b), 1 << 20, (len(stored),))
    assert decode(codec, index, stored) == a + b
    assert decode(codec, index, stored, 3000, 3500) == (a + b)[3000:3500]


def test_the_registry_decides_what_a_reader_accepts(
    encoded_items: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_s3._codec import format as codec_module

    _, index, _ = encoded_items["int"]
    descriptor = f"{CODEC_NAME}/{CODEC_VERSION}"
    assert codec_module.accepts([descriptor], index)
    assert not codec_module.accepts([descriptor, descriptor], index)  # exactly the one transform
    assert not codec_module.accepts(["torch.ZStandard"], index)
    newer = dataclasses.replace(index, version=CODEC_VERSION + 1)
    assert not codec_module.accepts([f"{CODEC_NAME}/{CODEC_VERSION + 1}"], newer)  # not in the registry
    assert not codec_module.accepts([descriptor], newer)  # descriptors must name the index's codec
    # A decoder registered for a new version is accepted with no other change (no second list).
    monkeypatch.setattr(
        codec_module, "DECODERS", {**codec_module.DECODERS, (CODEC_NAME, CODEC_VERSION + 1): "dcp_s3._codec.v2"}
    )
    assert codec_module.accepts([f"{CODEC_NAME}/{CODEC_VERSION + 1}"], newer)
    assert f"{CODEC_NAME!r} version {CODEC_VERSION + 1}" in codec_module.supported()
    # Both versions this dcp_s3 wrote are read.
    for version in (1, 2):
        assert codec_module.accepts([f"{CODEC_NAME}/{version}"], dataclasses.replace(index, version=version))


def test_reader_decodes_frames_without_a_content_size(codec: Codec) -> None:
    # Frames written by a streaming compressor record no content size: the decoder cannot take
    # zstd's single-pass path and streams them into the destination instead.
    import zstandard

    raw = tensor_bytes(weights(3000)).tobytes()
    stream = io.BytesIO()
    with zstandard.ZstdCompressor(level=1, write_content_size=False).stream_writer(stream, closefd=False) as w:
        w.write(raw[:5000])
    first = stream.getvalue()
    assert zstandard.get_frame_parameters(first).content_size == zstandard.CONTENTSIZE_UNKNOWN
    stored = first + zstandard.ZstdCompressor(level=3).compress(raw[5000:])
    index = FrameIndex(CODEC_NAME, CODEC_VERSION, 1, GROUP_NONE, len(raw), 1 << 20, (len(stored),))
    assert decode(codec, index, stored) == raw
    assert decode(codec, index, stored, 4990, 5010) == raw[4990:5010]
    short = FrameIndex(CODEC_NAME, CODEC_VERSION, 1, GROUP_NONE, len(raw) + 1, 1 << 20, (len(stored),))
    with pytest.raises(CheckpointFormatError, match="decompressed to"):
        decode(codec, short, stored)
    with pytest.raises(CheckpointFormatError, match="frame 0"):
        decode(codec, index, b"garbage" + stored[7:])
