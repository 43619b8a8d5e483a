"""The object-store interface every backend implements, and the read helpers they share.

An :class:`ObjectStore` holds objects in one *container* (an S3 bucket, a local directory)
under ``/``-separated keys: conditional put, a streaming writer, ranged reads into caller
memory, head, get, list (recursive or one level), batched delete, copy and the unfinished
multipart uploads. It knows nothing of torch or DCP (a test checks that importing it does
not import torch). Backends: :mod:`dcp_s3._objstore.s3` (S3 and S3-compatible servers) and
:mod:`dcp_s3._objstore.local` (files under a directory).

Byte ranges are ``[start, end)`` (end exclusive) everywhere.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from dcp_s3._objstore.buffers import BufferPool
from dcp_s3._objstore.config import DEFAULT_MAX_WHOLE_READ
from dcp_s3._objstore.throttle import JobProgress
from dcp_s3.errors import CheckpointFormatError, ConfigError

__all__ = [
    "ObjectStore",
    "ObjectWriter",
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
    """

    key: str
    start: int
    end: int
    open: Callable[[], memoryview]
    done: Callable[[], None] | None = None
    direct: bool = False
    received: Callable[[memoryview], None] | None = None

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


class ObjectWriter(ABC):
    """A write-only stream that creates one object; it appears, whole, only on ``close``.

    A failure or ``abort()`` leaves nothing behind (no partial object, no orphan upload).
    ``part_size`` is the size of the chunks worth handing to ``write`` at once. Backends
    implement ``_write``, ``_finish`` and ``_abort``; this class keeps the position and makes
    any failure abort.
    """

    def __init__(self, key: str, part_size: int, where: str) -> None:
        self.key = key
        self.part_size = part_size
        self._where = where
        self._position = 0
        self._closed = False

    def tell(self) -> int:
        """Bytes written so far."""
        return self._position

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns ``len(data)``."""
        view = memoryview(data).cast("B")
        self._append(view, self._write)
        return len(view)

    def write_stable(self, data: bytes | bytearray | memoryview) -> int:
        """``write`` bytes that stay alive and unchanged until ``close`` or ``abort`` returns: a backend
        may send them from there instead of copying them."""
        view = memoryview(data).cast("B")
        self._append(view, self._write_stable)
        return len(view)

    def write_checked(self, data: bytes | bytearray | memoryview, *, stable: bool = False) -> int:
        """``write`` (``stable``: ``write_stable``) ``data``; returns its CRC32C.

        A backend that checksums what it sends (S3: each part's ``x-amz-checksum-crc32c``) hashes the
        bytes once for both, combining per-segment CRCs (:mod:`dcp_s3._objstore.checksums`)."""
        view = memoryview(data).cast("B")
        crc = self._append(view, self._write_stable if stable else self._write)
        return crc32c(view) if crc is None else crc

    def _append(self, data: bytes | bytearray | memoryview, how: Callable[[memoryview], int | None]) -> int | None:
        """Write ``data`` with ``how``; returns the CRC32C ``how`` computed of it, if it did."""
        if self._closed:
            raise ConfigError(f"write to closed writer of {self._where}")
        view = memoryview(data).cast("B")
        try:
            crc = how(view)
        except BaseException:
            self.abort()
            raise
        self._position += len(view)
        return crc

    def close(self) -> int:
        """Make the object visible; returns its size in bytes. Idempotent."""
        if self._closed:
            return self._position
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self._position

    def abort(self) -> None:
        """Drop the object being written."""
        self._closed = True
        self._abort()

    @abstractmethod
    def _write(self, view: memoryview) -> int | None:
        """Append ``view``; returns its CRC32C if the backend computed it anyway (else None)."""

    def _write_stable(self, view: memoryview) -> int | None:
        return self._write(view)

    @abstractmethod
    def _finish(self) -> None: ...

    @abstractmethod
    def _abort(self) -> None: ...


class ObjectStore(ABC):
    """Objects in one container under ``/``-separated keys.

    Errors are :mod:`dcp_s3.errors` classes, the same on every backend: a missing object is
    ``CheckpointNotFoundError``, an object shorter than a read needs ``CheckpointFormatError``,
    a refused conditional put ``CheckpointExistsError``, a denied request ``S3AccessDeniedError``.
    """

    #: The container's name for messages (bucket name, or directory path).
    container: str
    #: Largest object :meth:`get` returns (``TransferConfig.max_whole_read``): a larger one is a
    #: ``CheckpointFormatError`` before its bytes are read, and no more than this + 1 bytes are read.
    max_whole_read: int = DEFAULT_MAX_WHOLE_READ

    @abstractmethod
    def url(self, key: str = "") -> str:
        """``key`` as a user would write it (``s3://bucket/key`` or a file path)."""

    def describe(self) -> str:
        """The container for messages (an S3 store adds its endpoint)."""
        return self.url()

    def plan_requests(self, ranks: int, prefixes: int) -> None:  # noqa: B027 -- an optional hook, a no-op by default
        """A job of ``ranks`` ranks spreading its keys over ``prefixes`` prefixes is about to send its
        requests: a store that paces them (S3) starts this process at its share of the budget."""

    @contextmanager
    def following(self, progress: JobProgress) -> Iterator[None]:
        """While a save or load runs, ``progress`` counts the job's ranks still sending: a store that paces
        requests (S3) lets the ranks still sending take up what finished ones leave."""
        yield

    @abstractmethod
    def check_container(self) -> None:
        """Fail with a clear error if the container is missing or not accessible."""

    @abstractmethod
    def put(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str:
        """Create or replace ``key`` atomically; returns the new ETag.

        ``if_none_match``: refuse (``CheckpointExistsError``) if ``key`` exists, atomically where
        the backend can (see :meth:`conditional_writes_supported`).
        """

    @abstractmethod
    def conditional_writes_supported(self, probe_key: str) -> bool:
        """Whether ``put(..., if_none_match=True)`` is enforced atomically here."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object (for small objects such as ``.metadata``), at most ``max_whole_read`` bytes
        (``CheckpointFormatError`` naming it, its size and the setting, if larger)."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size, mtime and ETag of ``key``, or None if it does not exist."""

    def read_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        executor: ThreadPoolExecutor,
        max_gap: int,
        max_size: int,
        max_direct_size: int | None = None,
    ) -> None:
        """Fill every read, coalescing neighbours into ranged requests run concurrently (see :func:`coalesce`).

        Raises the first failure after the other requests have settled.
        """
        groups = coalesce(reads, max_gap, max_size, max_direct_size)
        wait_all([executor.submit(self._read_group, group) for group in groups])

    @abstractmethod
    def _read_group(self, group: list[RangeRead]) -> None:
        """Fill the reads of one coalesced group (one object, ascending, non-overlapping)."""

    @abstractmethod
    def open_writer(
        self, key: str, *, pool: BufferPool, executor: ThreadPoolExecutor, expected_size: int | None = None
    ) -> ObjectWriter:
        """A writer that streams ``key``; its memory comes from ``pool`` (shared by a save's writers)."""

    def compose_parts(
        self,
        key: str,
        parts: Sequence[ComposePart],
        *,
        executor: ThreadPoolExecutor,
        fill: Callable[[ComposePart, memoryview], None],
        max_buffered: int,
    ) -> bool:
        """Create ``key`` from ``parts`` (planned by :func:`dcp_s3._objstore.compose.plan_parts`) with the server
        copying the ``copy`` parts, ``fill`` giving the bytes of the others, at most ``max_buffered`` of them
        held at once. False where the backend cannot copy ranges server-side (nothing was created): the caller
        then streams the object through this process (:func:`dcp_s3._objstore.compose.compose`)."""
        return False

    @abstractmethod
    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a plain string prefix), recursively."""

    @abstractmethod
    def list_dir(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        """One level under ``prefix`` (``""`` or ending in ``/``): (objects directly in it, the
        "directories" ``prefix<name>/`` below it); costs O(entries at that level)."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (batched where the backend can); keys already gone are fine."""

    @abstractmethod
    def copy(self, key: str, source: ObjectStore, source_key: str, size: int, *, executor: ThreadPoolExecutor) -> None:
        """Copy ``source_key`` of ``source`` (a store of the same backend) to ``key``, without the
        bytes passing through this process where the backend can."""

    @abstractmethod
    def list_uploads(self, prefix: str) -> list[PendingUpload]:
        """Unfinished multipart uploads under ``prefix`` (none where the backend has no such thing)."""

    @abstractmethod
    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort an unfinished multipart upload."""

    @abstractmethod
    def upload_activity(self, upload: PendingUpload) -> float | None:
        """When ``upload`` last received a part (else when it started); None if it is gone."""
