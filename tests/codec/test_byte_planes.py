"""The byte-grouping kernels (dcp_s3._codec.byte_planes) against a frozen reference.

The stored layout of codec version 1 is a contract (golden checkpoints), so any kernel in the
package (today's numpy passes, or a faster one later) must produce exactly the bytes of the
numpy implementation every release so far shipped, kept here as ``old_group`` /
``old_ungroup``. The property tests compare them on random bytes and float-like elements of
every grouped element size, odd lengths, sizes across the block lengths, partial element
ranges ``[a, b)`` and unaligned destinations, directly and through ``Codec.decode_into``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_s3._codec import Codec, grouping_for_dtype, stored_span
from dcp_s3._codec.byte_planes import UINT, group, ungroup

FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
BLOCK_ELEMENTS = 1 << 16  # the old implementation's block


def old_group(src: np.ndarray, es: int, out: np.ndarray) -> None:
    """Byte-group ``src`` into ``out``: rotate each element left by 1 bit, then plane ``p``
    (byte ``es - 1 - p`` of the little-endian element) at ``out[p * ne:(p + 1) * ne]``.
    Trailing bytes that do not make a whole element are copied unchanged after the planes."""
    dt = UINT[es]
    ne = len(src) // es
    x_all = src[: ne * es].view(dt)
    bits = dt(8 * es - 1)
    one = dt(1)
    block = max(1, min(ne, BLOCK_ELEMENTS))
    t1, t2 = np.empty(block, dt), np.empty(block, dt)
    for s in range(0, ne, block):
        e = min(ne, s + block)
        x, r, t = x_all[s:e], t1[: e - s], t2[: e - s]
        np.left_shift(x, one, out=r)
        np.right_shift(x, bits, out=t)
        np.bitwise_or(r, t, out=r)
        if es == 8:  # strided copies beat shift+cast for 8 planes
            r8 = r.view(np.uint8).reshape(-1, es)
            for p in range(es):
                out[p * ne + s : p * ne + e] = r8[:, es - 1 - p]
            continue
        for p in range(es):
            shift = 8 * (es - 1 - p)
            if shift:
                np.right_shift(r, dt(shift), out=t)
                np.copyto(out[p * ne + s : p * ne + e], t, casting="unsafe")
            else:
                np.copyto(out[p * ne + s : p * ne + e], r, casting="unsafe")
    out[ne * es : len(src)] = src[ne * es :]


def old_ungroup(planes: np.ndarray, ne: int, es: int, a: int, b: int, out: np.ndarray) -> None:
    """Inverse of :func:`group` for elements ``[a, b)`` of a frame of ``ne`` elements,
    written to ``out`` (``(b - a) * es`` bytes)."""
    dt = UINT[es]
    bits = dt(8 * es - 1)
    one = dt(1)
    o_all = out.view(dt) if out.ctypes.data % es == 0 else None
    block = min(b - a, BLOCK_ELEMENTS)
    t1, t2 = np.empty(block, dt), np.empty(block, dt)
    eight = dt(8)
    for s in range(a, b, block):
        e = min(b, s + block)
        r, t = t1[: e - s], t2[: e - s]
        if es == 8:
            r8 = r.view(np.uint8).reshape(-1, es)
            for p in range(es):
                r8[:, es - 1 - p] = planes[p * ne + s : p * ne + e]
        else:
            np.copyto(r, planes[s:e])
            for p in range(1, es):
                np.left_shift(r, eight, out=r)
                np.copyto(t, planes[p * ne + s : p * ne + e])
                np.bitwise_or(r, t, out=r)
        np.left_shift(r, bits, out=t)
        np.right_shift(r, one, out=r)
        if o_all is not None:
            np.bitwise_or(r, t, out=o_all[s - a : e - a])
        else:  # unaligned destination: combine in place, then copy bytes
            np.bitwise_or(r, t, out=r)
            out[(s - a) * es : (e - a) * es] = r.view(np.uint8)


def frame_bytes(draw: st.DrawFn, es: int, max_elements: int) -> np.ndarray:
    """Random bytes, or float-like elements of random magnitudes and signs, plus 0..es-1 trailing bytes."""
    ne = draw(st.integers(0, max_elements))
    tail = draw(st.integers(0, es - 1))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        return rng.integers(0, 256, ne * es + tail, dtype=np.uint8)
    dtype = {2: np.float16, 4: np.float32, 8: np.float64}[es]
    values = (rng.standard_normal(ne) * 10.0 ** rng.integers(-6, 3)).astype(dtype)
    return np.concatenate([values.view(np.uint8), rng.integers(0, 256, tail, dtype=np.uint8)])


@FAST
@given(data=st.data(), es=st.sampled_from(sorted(UINT)))
def test_group_produces_exactly_the_old_bytes(data: st.DataObject, es: int) -> None:
    # Sizes around the block lengths of both implementations (blocks of 2**15 and 2**16 elements).
    src = data.draw(st.composite(lambda draw: frame_bytes(draw, es, 70_000))())
    old, new = np.empty(len(src), np.uint8), np.empty(len(src), np.uint8)
    old_group(src, es, old)
    group(src, es, new)
    assert new.tobytes() == old.tobytes()


@FAST
@given(data=st.data(), es=st.sampled_from(sorted(UINT)), offset=st.integers(0, 7))
def test_ungroup_ranges_into_unaligned_destinations(data: st.DataObject, es: int, offset: int) -> None:
    src = data.draw(st.composite(lambda draw: frame_bytes(draw, es, 70_000))())
    ne = len(src) // es
    planes = np.empty(len(src), np.uint8)
    old_group(src, es, planes)
    a = data.draw(st.integers(0, ne))
    b = data.draw(st.integers(a, ne))
    backing = np.full((b - a) * es + offset + 1, 0xAB, np.uint8)
    out = backing[offset : offset + (b - a) * es]  # misaligned for every offset % es != 0
    ungroup(planes, ne, es, a, b, out)
    assert out.tobytes() == src[a * es : b * es].tobytes()
    assert backing[:offset].tobytes() == b"\xab" * offset and backing[-1] == 0xAB  # nothing written outside
    if a < b:  # (the old function needed a non-empty range)
        ref = np.empty((b - a) * es, np.uint8)
        old_ungroup(planes, ne, es, a, b, ref)
        assert ref.tobytes() == out.tobytes()


@pytest.mark.parametrize("es", sorted(UINT))
def test_special_values_survive(es: int) -> None:
    dtype = {2: np.float16, 4: np.float32, 8: np.float64}[es]
    values = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, np.finfo(dtype).tiny, -np.finfo(dtype).max], dtype
    )
    raw = np.concatenate([values.view(np.uint8), np.arange(256, dtype=np.uint8).view(np.uint8)])
    raw = raw[: len(raw) // es * es]
    planes = np.empty(len(raw), np.uint8)
    group(raw, es, planes)
    old = np.empty(len(raw), np.uint8)
    old_group(raw, es, old)
    assert planes.tobytes() == old.tobytes()
    out = np.empty(len(raw), np.uint8)
    ungroup(planes, len(raw) // es, es, 0, len(raw) // es, out)
    assert out.tobytes() == raw.tobytes()


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64]),
    frame_size=st.sampled_from([64, 1000, 4096, 1 << 17]),
    offset=st.integers(0, 7),
)
def test_codec_partial_ranges_into_unaligned_destinations(
    data: st.DataObject, dtype: torch.dtype, frame_size: int, offset: int
) -> None:
    # Through the codec: the reader decodes sub-ranges [a, b) that start and end inside elements and frames.
    n = data.draw(st.integers(1, 40_000))
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(dtype)
    raw = t.reshape(-1).view(torch.uint8).numpy()
    es, floating = grouping_for_dtype(dtype)
    with Codec(threads=2, frame_size=frame_size) as codec:
        parts: list[bytes] = []
        index = codec.encode(raw, es, floating, lambda b: parts.append(bytes(b)))
        stored = b"".join(parts)
        a = data.draw(st.integers(0, len(raw)))
        b = data.draw(st.integers(a, len(raw)))
        s, e = stored_span(index, a, b)
        backing = bytearray(b - a + offset)
        codec.decode_into(index, memoryview(stored)[s:e], s, a, b, memoryview(backing)[offset:])
        assert bytes(backing[offset:]) == raw[a:b].tobytes()
