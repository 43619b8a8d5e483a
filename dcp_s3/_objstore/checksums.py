"""CRC32C combination: ``crc(A‖B)`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, without the bytes.

A save needs two CRC32Cs of the same bytes: one per item (kept in ``.metadata``, checked by loads) and one
per multipart part (sent as ``x-amz-checksum-crc32c``, checked by the server). Items and parts cut the
object at different places, so the writer hashes each segment (the intersection of one write and one
part) once and derives both from the segments' CRCs with :func:`crc32c_combine`: every byte is hashed
once, not twice.

The standard method (zlib's ``crc32_combine``, for the Castagnoli polynomial): appending ``n`` bytes to
``A`` multiplies its CRC register by ``x^(8n)`` modulo the polynomial (in GF(2), bit-reflected), and the
CRC of ``B`` is added. ``x^(8n)`` comes from a table of ``x^(2^k)``; each multiplication is 32 steps.
"""

from __future__ import annotations

import functools

from dcp_s3.errors import ConfigError

__all__ = ["crc32c_combine"]

_POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
_ONE = 1 << 31  # the polynomial 1 (x^0), bit-reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (both bit-reflected)."""
    m = _ONE
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    """``x^(2^k)`` modulo the polynomial, k = 0..63 (no wrap-around at 32: unlike zlib's CRC-32 polynomial,
    x^(2^32) is not x modulo this one; checked against awscrt up to 2^45-byte lengths in the tests)."""
    p = _ONE >> 1  # x^1
    table = [p]
    for _ in range(63):
        p = _multmodp(p, p)
        table.append(p)
    return tuple(table)


_X2N = _x2n_table()


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial (cached: parts and chunks come in a few sizes)."""
    p = _ONE
    k = 3  # 8 = 2^3 bits per byte
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k], p)
        nbytes >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``A‖B`` from ``crc_a`` (of ``A``), ``crc_b`` (of ``B``) and ``len_b = len(B)``."""
    if not 0 <= len_b < 1 << 60:
        raise ConfigError(f"crc32c_combine: len_b={len_b} must be >= 0 and < 2**60")
    if len_b == 0 or crc_a == 0:  # crc32c(b"") == 0: nothing to shift
        return crc_b if len_b else crc_a
    return _multmodp(_shift(len_b), crc_a) ^ crc_b
