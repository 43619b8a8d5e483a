"""Checking the raw bytes of a tensor item that a load reads, whatever part of it and however they travel.

A raw tensor item saved with block checksums (``ItemLocation.block_size``, format ``dcp_s3/2``) is checked
block by block: the bytes a read plan needs, ``[lo, hi)`` of the payload, are widened to whole blocks (two
small extra reads, of at most a block each, for the edges), every read hashes its bytes as they arrive
(``RangeRead.received``, while they are in cache) in fragments cut at block boundaries, and once all of
them are in each block's fragments combine (``crc32c_combine``) into its CRC32C and are compared with the
stored one, before the planner sees the tensor. It does not matter whether the bytes went straight into
the destination or through staging (a cast, a non-contiguous or device destination): what is hashed is
what arrived. An item saved before (only the whole payload's ``crc32c``) is one block: a read of all of it
is checked the same way, a read of part of it is widened to the whole item when that is at most
``OLD_ITEM_WIDEN`` bytes, and left unchecked otherwise (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crc32c import crc32c

from dcp_s3._layout import payload_blocks
from dcp_s3._objstore.base import RangeRead
from dcp_s3._objstore.checksums import crc32c_combine
from dcp_s3.errors import CheckpointFormatError

__all__ = ["BlockLedger", "OLD_ITEM_WIDEN", "ledger_for"]

#: Largest item saved without block checksums that a partial read reads whole, to check it.
OLD_ITEM_WIDEN = 16 << 20


def ledger_for(info: Any, nbytes: int, lo: int, hi: int, where: Callable[[int, int], str]) -> BlockLedger | None:
    """The ledger that checks a read of payload bytes ``[lo, hi)`` of a raw item of ``nbytes`` payload bytes,
    or None where nothing can check it (no checksum; an old item's part, the item over ``OLD_ITEM_WIDEN``)."""
    blocks = payload_blocks(info, nbytes)
    if blocks is None:
        crc = getattr(info, "crc32c", None)
        if crc is None or ((lo, hi) != (0, nbytes) and nbytes > OLD_ITEM_WIDEN):
            return None
        blocks = (max(1, nbytes), (crc,))
    return BlockLedger(blocks[0], blocks[1], nbytes, lo, hi, where)


class BlockLedger:
    """The fragments of payload blocks ``[lo, hi)`` touches (widened to whole blocks) that reads have hashed,
    and the check of each block against its stored CRC32C (module doc). ``where(a, b)`` names payload bytes
    ``[a, b)`` (object and byte range) for errors."""

    def __init__(
        self, block: int, crcs: tuple[int, ...], nbytes: int, lo: int, hi: int, where: Callable[[int, int], str]
    ) -> None:
        self.block, self.crcs, self.nbytes, self.where = block, crcs, nbytes, where
        self.lo, self.hi = lo, hi
        self.first = lo // block
        self.last = max(self.first, (hi - 1) // block)
        self.wide_lo = self.first * block
        self.wide_hi = min(nbytes, (self.last + 1) * block)
        if len(crcs) != -(-nbytes // block) and nbytes:
            raise CheckpointFormatError(f"{where(0, nbytes)}: {len(crcs)} block checksums for {nbytes} bytes")
        # (start, end, crc32c) in payload offsets, appended by the reading threads (``list.append`` is atomic)
        self._fragments: list[tuple[int, int, int]] = []

    def edge_reads(self, key: str, start: int) -> list[RangeRead]:
        """Reads of the bytes the blocks hold outside ``[lo, hi)`` (object offset of payload byte 0:
        ``start``), hashed into fragments and dropped."""
        reads = []
        for a, b in ((self.wide_lo, self.lo), (self.hi, self.wide_hi)):
            if a < b:
                held: dict[str, bytearray] = {}

                def open_edge(held: dict[str, bytearray] = held, n: int = b - a) -> memoryview:
                    held["buf"] = bytearray(n)
                    return memoryview(held["buf"])

                def hash_edge(held: dict[str, bytearray] = held, a: int = a, b: int = b) -> None:
                    self.add(a, b, crc32c(held.pop("buf")))

                reads.append(RangeRead(key, start + a, start + b, open_edge, hash_edge))
        return reads

    def add(self, a: int, b: int, crc: int) -> None:
        """Payload bytes ``[a, b)`` (within one block) arrived with CRC32C ``crc``."""
        self._fragments.append((a, b, crc))

    def hasher(self, a: int, b: int) -> _ReadHasher:
        """What hashes the bytes of one read of payload bytes ``[a, b)`` as they arrive."""
        return _ReadHasher(self, a, b)

    def check(self) -> None:
        """Every block ``[lo, hi)`` touches: its fragments cover it exactly and combine to its CRC32C."""
        fragments = self._fragments
        if len(fragments) == 1 and fragments[0][:2] == (self.wide_lo, self.wide_hi) and self.first == self.last:
            if fragments[0][2] != self.crcs[self.first]:  # one block, read in one piece: the common small item
                self._mismatch(self.first, self.wide_lo, self.wide_hi, fragments[0][2])
            return
        fragments = sorted(fragments)
        at = 0
        for i in range(self.first, self.last + 1):
            b_lo, b_hi = i * self.block, min(self.nbytes, (i + 1) * self.block)
            crc, pos = 0, b_lo
            while at < len(fragments) and fragments[at][0] < b_hi:
                a, b, piece = fragments[at]
                if a != pos:  # a gap, or bytes read twice: never from the reads planned here
                    raise CheckpointFormatError(f"{self.where(b_lo, b_hi)}: block {i} was not read exactly once")
                crc = crc32c_combine(crc, piece, b - a)
                pos = b
                at += 1
            if pos != b_hi:
                raise CheckpointFormatError(f"{self.where(b_lo, b_hi)}: block {i} was not read whole")
            if crc != self.crcs[i]:
                self._mismatch(i, b_lo, b_hi, crc)

    def _mismatch(self, i: int, b_lo: int, b_hi: int, crc: int) -> None:
        raise CheckpointFormatError(
            f"{self.where(b_lo, b_hi)}: checksum mismatch in block {i} (crc32c {crc:#010x}, expected "
            f"{self.crcs[i]:#010x}): the stored bytes are corrupt"
        )


class _ReadHasher:
    """Hashes one read's bytes ``[a, b)`` of the payload as they arrive (``RangeRead.received``), in fragments
    cut at block boundaries, and hands them to the ledger once the read is done (``finish``); if the backend
    did not report every byte exactly once, the read's buffer is hashed instead."""

    def __init__(self, ledger: BlockLedger, a: int, b: int) -> None:
        self.ledger, self.a, self.b = ledger, a, b
        self.pos = a
        self.crc = 0
        self.start = a
        self.bound = self._bound()  # where the fragment being hashed ends
        self.done: list[tuple[int, int, int]] = []

    def _bound(self) -> int:
        return min(self.b, (self.pos // self.ledger.block + 1) * self.ledger.block)

    def __call__(self, piece: memoryview) -> None:
        end = self.pos + piece.nbytes
        bound = self.bound
        if end < bound:  # the common case (a socket read inside a block): as cheap as hashing alone
            self.crc = crc32c(piece, self.crc)
            self.pos = end
            return
        if end == bound:  # a piece that ends a block (or the read)
            self.done.append((self.start, end, crc32c(piece, self.crc)))
            self.start = self.pos = end
            self.crc = 0
            self.bound = min(self.b, end + self.ledger.block)  # (``end`` is a block boundary, or the read's end)
            return
        view = memoryview(piece).cast("B")
        while view:
            if self.pos >= self.b:  # more bytes than the read holds: finish() hashes the buffer
                self.pos = self.b + 1
                return
            n = min(len(view), self.bound - self.pos)
            self.crc = crc32c(view[:n], self.crc)
            self.pos += n
            view = view[n:]
            if self.pos == self.bound:
                self.done.append((self.start, self.pos, self.crc))
                self.start, self.crc = self.pos, 0
                self.bound = self._bound()

    def finish(self, buf: memoryview | None) -> None:
        """The read is in (its buffer ``buf``): give the ledger its fragments."""
        if self.pos != self.b:
            if buf is None:
                raise CheckpointFormatError(f"{self.ledger.where(self.a, self.b)}: bytes arrived unchecked")
            self.done, self.pos, self.start, self.crc = [], self.a, self.a, 0
            self.bound = self._bound()
            self(buf)
        self.ledger._fragments.extend(self.done)
