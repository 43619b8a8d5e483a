"""The records and helpers every object store shares: objects, uploads, ranged reads, coalescing, names.

Byte ranges are ``[start, end)`` (end exclusive) everywhere. Nothing here knows torch or DCP.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from dcp_s3.errors import CheckpointFormatError, ConfigError

__all__ = [
    "ObjectInfo",
    "PendingUpload",
    "RangeRead",
    "Span",
    "ComposePart",
    "coalesce",
    "wait_all",
    "open_destination",
    "check_relative_name",
    "relative_name_problem",
    "check_whole_size",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object: its key, size in bytes, modification time (epoch seconds) and ETag.

    ``etag`` changes whenever the object is replaced; ``""`` where the backend reports none
    (the JuiceFS/MinIO gateway's HEAD). On disk it is made of inode, size and mtime in ns.
    """

    key: str
    size: int
    mtime: float
    etag: str = ""


@dataclass(frozen=True, slots=True)
class PendingUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    upload_id: str
    initiated: float


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Read object bytes ``[start, end)`` (end exclusive) into memory the caller provides.

    ``open()`` is called in the worker thread right before the bytes arrive and returns a
    writable buffer of exactly ``end - start`` bytes; ``done()`` runs after it is filled.
    ``direct``: that buffer is the caller's own destination, or memory the caller reuses read after read
    (given back by ``done``), not memory allocated for the read, so groups of such reads alone may be larger
    (``read_ranges``' ``max_direct_size``): a backend opens one read of a group at a time.
    ``received``: called with each piece of that buffer as soon as its bytes have arrived, in order, every
    byte once (a checksum taken there reads them while they are still in the CPU's cache).
    ``etag``: the object's ``ObjectInfo.etag`` when the read was planned; a backend reads only from that version
    (S3: ``If-Match`` on the GET) and raises ``ObjectReplacedError`` naming the object otherwise. ``""``: any.
    """

    key: str
    start: int
    end: int
    open: Callable[[], memoryview]
    done: Callable[[], None] | None = None
    direct: bool = False
    received: Callable[[memoryview], None] | None = None
    etag: str = ""

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[start, end)`` (end exclusive) of the object ``key``: a piece of an object being composed."""

    key: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ComposePart:
    """One part of an object composed by :meth:`ObjectStore.compose_parts`: ``copy``: its one :class:`Span`,
    copied by the server; else its pieces (given bytes, spans of objects) in order, sent by this process."""

    pieces: tuple[bytes | Span, ...]
    copy: bool = False

    @property
    def size(self) -> int:
        return sum(len(p) if isinstance(p, bytes) else p.size for p in self.pieces)


def coalesce(
    reads: Iterable[RangeRead], max_gap: int, max_size: int, max_direct_size: int | None = None
) -> list[list[RangeRead]]:
    """Group reads of one object into ranged requests: sorted, merged across gaps ``<= max_gap``.

    A group spans at most ``max_size`` bytes (a group of ``direct`` reads alone: ``max_direct_size``, if
    larger) unless a single read is larger on its own.
    """
    direct_size = max(max_size, max_direct_size or 0)
    groups: list[list[RangeRead]] = []
    current: list[RangeRead] = []
    all_direct = False
    for read in sorted(reads, key=lambda r: (r.key, r.start)):
        if current:
            first, last = current[0], current[-1]
            limit = direct_size if all_direct and read.direct else max_size
            if (
                read.key == first.key
                and read.start >= last.end
                and read.start - last.end <= max_gap
                and read.end - first.start <= limit
            ):
                current.append(read)
                all_direct = all_direct and read.direct
                continue
            groups.append(current)
        current = [read]
        all_direct = read.direct
    if current:
        groups.append(current)
    return groups


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for every future; raise the first exception (others are logged at debug)."""
    first: BaseException | None = None
    for fut in futures:
        exc = fut.exception()
        if exc is not None:
            if first is None:
                first = exc
            else:
                log.debug("further failure: %s", exc)
    if first is not None:
        raise first


def open_destination(read: RangeRead, where: str) -> memoryview:
    """``read.open()``, checked to be exactly the read's size."""
    dest = read.open()
    if len(dest) != read.size:
        raise ConfigError(f"destination of {where}[{read.start}:{read.end}] has {len(dest)} bytes, not {read.size}")
    return dest


def check_whole_size(where: str, size: int, limit: int) -> None:
    """Refuse to read ``where`` whole if its ``size`` (known, or found while reading) exceeds ``limit``."""
    if size > limit:
        raise CheckpointFormatError(
            f"{where} is {size:,} bytes (or more), over max_whole_read={limit:,}, the most read whole into "
            "memory (.metadata, step markers); refusing to read it. A genuine one this large needs a larger "
            "max_whole_read (storage option, or TransferConfig(max_whole_read=...))"
        )


def relative_name_problem(name: str) -> str | None:
    """Why ``name`` is not a clean relative object name, or None if it is.

    The rules every object name relative to a root obeys, wherever it came from (a listing, an
    argument, a checkpoint's metadata), so that the file path or key made from it stays under its
    root: not empty; no ``''``, ``.`` or ``..`` segment (hence no leading or trailing ``/`` and no
    ``//``, so also no ``scheme://``); no NUL; no path separator of this OS other than ``/`` (a
    backslash on Windows).
    """
    if not name:
        return "it is empty"
    if "\0" in name:
        return "it contains NUL"
    if any(seg in ("", ".", "..") for seg in name.split("/")):
        return "its '', '.' or '..' segments would resolve outside the target"
    if ({os.sep, os.altsep or "/"} - {"/"}) & set(name):  # a backslash separates paths on Windows
        return "it contains a path separator other than '/'"
    return None


def check_relative_name(name: str, origin: str) -> str:
    """``name`` if it is a clean relative object name (:func:`relative_name_problem`), so the file
    path or key made from it stays under its root.

    A bucket can hold keys such as ``ck/../../x`` (S3 stores them verbatim); turned into a
    local path, or re-sent to a server that normalizes paths, such a key would land outside
    the target. ``origin`` says where the name came from, for the error.
    """
    if relative_name_problem(name) is not None:
        raise CheckpointFormatError(
            f"refusing object name {name!r} from {origin}: its '', '.' or '..' segments (or NUL, or a path "
            "separator) would resolve outside the target; rename or delete that object"
        )
    return name
