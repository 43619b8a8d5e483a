"""One object made of given bytes and byte ranges of other objects of the same store (no torch).

:func:`compose` writes ``key`` as the concatenation of its pieces: ``bytes`` (a header) and :class:`Span`
ranges of objects already stored. Where the backend copies ranges server-side
(:meth:`ObjectStore.compose_parts`: S3's UploadPartCopy) the bytes of large spans never pass through this
process; the rest — given bytes, spans shorter than S3's 5 MiB minimum part, and the few MiB around a
boundary that a part needs to reach that minimum — are read and sent as ordinary parts, at most
``max_buffered`` parts of ``fit_part_size(MIN_PART_SIZE, size)`` bytes held at once (a given-bytes piece
may add its own length). Elsewhere (a local directory; a server without UploadPartCopy, found by its
``NotImplemented`` answer) the object is streamed: read and written in batches of at most ``chunk`` bytes,
memory bounded by ``chunk`` plus the upload's own part buffers, never by the object's or a span's size.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from dcp_s3._objstore.base import ComposePart, ObjectStore, RangeRead, Span
from dcp_s3._objstore.buffers import MAX_PARTS, MIN_PART_SIZE, BufferPool, fit_part_size
from dcp_s3.errors import ConfigError

__all__ = ["Piece", "compose", "plan_parts", "fill_part", "COPY_PART_MAX"]

log = logging.getLogger(__name__)

#: A piece of a composed object: bytes given, or a span of an object of the same store.
Piece = bytes | Span
#: Largest span copied as one UploadPartCopy part (S3 allows 5 GiB): smaller parts copy in parallel, and each
#: request's answer comes well within the client's ``read_timeout`` on a server copying at ~100 MB/s.
COPY_PART_MAX = 128 << 20


def _size(piece: Piece) -> int:
    return len(piece) if isinstance(piece, bytes) else piece.size


def plan_parts(pieces: Sequence[Piece], min_part: int, max_copy: int = COPY_PART_MAX) -> list[ComposePart]:
    """The multipart parts of the concatenation of ``pieces``: every part but the last at least ``min_part``
    bytes (S3's rule); a span of at least ``min_part`` bytes met with nothing pending is copied (in parts
    of at most ``max_copy``); what precedes a span is topped up to ``min_part`` from the span's head,
    and what remains of a span under ``min_part`` starts the next sent part. Sent parts are therefore
    ``min_part`` bytes, or ``min_part`` plus one given-bytes piece, or the last."""
    parts: list[ComposePart] = []
    pending: list[Piece] = []
    size = 0

    def flush() -> None:
        nonlocal size
        parts.append(ComposePart(tuple(pending)))
        pending.clear()
        size = 0

    for piece in pieces:
        n = _size(piece)
        if n == 0:
            continue
        if isinstance(piece, bytes):
            pending.append(piece)
            size += n
            if size >= min_part:
                flush()
            continue
        if size:
            take = min(n, min_part - size)
            pending.append(Span(piece.key, piece.start, piece.start + take))
            size += take
            piece, n = Span(piece.key, piece.start + take, piece.end), n - take
            if size >= min_part:
                flush()
            if n == 0:
                continue
        if n >= min_part:  # nothing pending here
            count = max(1, min(-(-n // max_copy), n // min_part))  # even parts, each in [min_part, max_copy]
            cuts = [piece.start + i * n // count for i in range(count + 1)]
            parts.extend(ComposePart((Span(piece.key, a, b),), copy=True) for a, b in itertools.pairwise(cuts))
        else:
            pending.append(piece)
            size = n
    if pending:
        flush()
    return parts


def fill_part(
    store: ObjectStore, pieces: Sequence[Piece], dest: memoryview, *, executor: ThreadPoolExecutor, max_size: int
) -> None:
    """Put the bytes of ``pieces`` into ``dest`` (exactly their total size): given bytes copied, spans read
    with ``store.read_ranges`` (concurrent, neighbours in one object merged into one request)."""
    reads: list[RangeRead] = []
    at = 0
    for piece in pieces:
        n = _size(piece)
        if isinstance(piece, bytes):
            dest[at : at + n] = piece
        elif n:
            reads.append(RangeRead(piece.key, piece.start, piece.end, _opener(dest[at : at + n])))
        at += n
    if at != len(dest):
        raise ConfigError(f"pieces of {at} bytes for a {len(dest)}-byte buffer")
    if reads:
        store.read_ranges(reads, executor=executor, max_gap=0, max_size=max_size)


def _opener(view: memoryview):  # type: ignore[no-untyped-def]
    return lambda: view


def batches(pieces: Sequence[Piece], limit: int) -> Iterator[list[Piece]]:
    """``pieces`` in consecutive groups of at most ``limit`` bytes (pieces split where they must be)."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        n = _size(piece)
        at = 0
        while at < n:
            take = min(n - at, limit - size)
            if isinstance(piece, bytes):
                batch.append(piece[at : at + take])
            else:
                batch.append(Span(piece.key, piece.start + at, piece.start + at + take))
            at += take
            size += take
            if size == limit:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def compose(
    store: ObjectStore,
    key: str,
    pieces: Sequence[Piece],
    *,
    executor: ThreadPoolExecutor,
    chunk: int,
    max_buffered: int,
) -> int:
    """Write ``key`` as the concatenation of ``pieces`` (see the module docstring); returns its size.

    ``chunk``: bytes read and sent at once where the object is streamed, and the size up to which it is
    one PUT; ``max_buffered``: sent parts held at once. The object appears whole or not at all."""
    total = sum(_size(p) for p in pieces)
    if total <= chunk:
        buf = bytearray(total)
        fill_part(store, pieces, memoryview(buf), executor=executor, max_size=chunk)
        store.put(key, buf)
        return total
    min_part = fit_part_size(MIN_PART_SIZE, total)
    parts = plan_parts(pieces, min_part)
    while len(parts) > MAX_PARTS:  # every part but the last is >= min_part: doubling converges
        min_part *= 2
        parts = plan_parts(pieces, min_part)

    def fill(part: ComposePart, dest: memoryview) -> None:
        fill_part(store, part.pieces, dest, executor=executor, max_size=min_part)

    if store.compose_parts(key, parts, executor=executor, fill=fill, max_buffered=max_buffered):
        copied = sum(p.size for p in parts if p.copy)
        log.debug("composed %s: %d parts, %d of %d bytes copied server-side", key, len(parts), copied, total)
        return total
    _stream(store, key, pieces, total, executor=executor, chunk=chunk, max_buffered=max_buffered)
    return total


def _stream(
    store: ObjectStore,
    key: str,
    pieces: Sequence[Piece],
    total: int,
    *,
    executor: ThreadPoolExecutor,
    chunk: int,
    max_buffered: int,
) -> None:
    """Read and write ``pieces`` through this process, ``chunk`` bytes at a time."""
    pool = BufferPool(max(1, max_buffered), fit_part_size(chunk, total))
    buf = memoryview(bytearray(chunk))
    writer = store.open_writer(key, pool=pool, executor=executor, expected_size=total)
    try:
        for batch in batches(pieces, chunk):
            n = sum(_size(p) for p in batch)
            fill_part(store, batch, buf[:n], executor=executor, max_size=chunk)
            writer.write(buf[:n])  # copied into the writer's part buffers: ``buf`` is reused
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        pool.clear()
