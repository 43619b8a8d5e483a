"""Byte grouping of fixed-size elements (numpy, no torch): the transform before zstd of float frames.

Every element is rotated left by one bit (the sign moves next to the mantissa, so the top
byte is the whole exponent for bf16/fp32/fp64-like layouts) and its bytes are split into
planes, most significant plane first.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

__all__ = ["UINT", "group", "ungroup"]

#: Element sizes that are grouped, and the unsigned integer type of each.
UINT: Final[dict[int, Any]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}
BLOCK_ELEMENTS: Final = 1 << 16  # shuffle block: keeps temporaries in L2 cache


def group(src: np.ndarray, es: int, out: np.ndarray) -> None:
    """Byte-group ``src`` into ``out``: rotate each element left by 1 bit, then plane ``p``
    (byte ``es - 1 - p`` of the little-endian element) at ``out[p * ne:(p + 1) * ne]``.
    Trailing bytes that do not make a whole element are copied unchanged after the planes."""
    dt = UINT[es]
    ne = len(src) // es
    x_all = src[:ne * es].view(dt)
    bits = dt(8 * es - 1)
    one = dt(1)
    block = max(1, min(ne, BLOCK_ELEMENTS))
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


def ungroup(planes: np.ndarray, ne: int, es: int, a: int, b: int, out: np.ndarray) -> None:
    """Inverse of :func:`group` for elements ``[a, b)`` of a frame of ``ne`` elements,
    written to ``out`` (``(b - a) * es`` bytes)."""
    if b <= a:
        return
    dt = UINT[es]
    bits = dt(8 * es - 1)
    one = dt(1)
    o_all = out.view(dt) if out.ctypes.data % es == 0 else None
    block = min(b - a, BLOCK_ELEMENTS)
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
