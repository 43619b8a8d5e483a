"""One store over a checkpoint root on S3 (``s3://bucket/prefix``) or on local disk.

The checkpoint manager and the ``dcp-s3`` tools work on *objects* named relative to a
root: list (recursively, by name prefix, or one level), read, read byte ranges, write
(atomically), delete, copy, and make a DCP ``StorageWriter``/``StorageReader`` for a
sub-location. :class:`Store` does all of it over the object-store interface
(:class:`dcp_s3._objstore.base.ObjectStore`), the same way on every backend: the writer/reader are
``S3StorageWriter``/``S3StorageReader`` on S3 and on disk alike. Names always use ``/``.

The backends add only what really differs: :class:`dcp_s3._dcp.store_s3.S3Store` (server-side
copy between buckets of one server) and :class:`dcp_s3._dcp.store_local.LocalStore` (paths,
symbolic-link policy); :func:`dcp_s3._dcp.store_opening.open_store` picks one for a location, and
:class:`dcp_s3._dcp.options.Settings` holds the storage options of both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dcp_s3._dcp.options import Settings
from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._dcp.session import Session
from dcp_s3._dcp.writer import S3StorageWriter
from dcp_s3._objstore.base import ObjectInfo, ObjectStore, PendingUpload, RangeRead
from dcp_s3._objstore.buffers import BufferPool
from dcp_s3.errors import CheckpointExistsError, CheckpointNotFoundError

__all__ = ["Entry", "Upload", "Store"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored object: ``name`` relative to the store root, size in bytes, modification time (epoch s)."""

    name: str
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class Upload:
    """A multipart upload that was started and neither completed nor aborted (S3 only)."""

    name: str
    upload_id: str
    initiated: float


class Store:
    """Objects under one root location; names are relative to the root and use ``/``.

    ``session`` carries the object store (created lazily, so a store pickles), its I/O pool
    (``TransferConfig``) and, on S3, every client setting; ``prefix`` is the root's key in the
    object store's container. ``options`` (a :class:`~dcp_s3._dcp.options.Settings`) are the
    DCP writer's/reader's it makes.
    """

    def __init__(
        self,
        session: Session,
        prefix: str,
        root: str,
        *,
        options: Settings | None = None,
    ) -> None:
        self.session = session
        self.prefix = prefix
        self.root = root
        self.options = Settings.of(options)
        transfer = session.transfer
        # Part buffers of uploads, shared by concurrent uploads: their memory bound.
        self._buffers = BufferPool(transfer.max_concurrency + 2, transfer.part_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    @property
    def object_store(self) -> ObjectStore:
        return self.session.object_store

    def close(self) -> None:
        self.session.close()
        self._buffers.clear()

    def key(self, name: str) -> str:
        return _join(self.prefix, name)

    def url(self, name: str = "") -> str:
        """The location of ``name`` as a user would write it (``s3://...`` or a path)."""
        return self.object_store.url(self.key(name)).rstrip("/") if name or self.prefix else self.root

    def _rel(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def _dir_key(self, prefix: str) -> str:
        # The root is a "directory": list "key/" so that "run" does not match "run2/...".
        return self.key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")

    def _entry(self, obj: ObjectInfo) -> Entry:
        return Entry(self._rel(obj.key), obj.size, obj.mtime)

    def list_objects(self, prefix: str = "") -> list[Entry]:
        """Every object whose relative name starts with ``prefix`` (a plain string prefix)."""
        return [
            self._entry(o) for o in self.object_store.list_objects(self._dir_key(prefix)) if not o.key.endswith("/")
        ]

    def list_dir(self, prefix: str = "") -> tuple[list[Entry], list[str]]:
        """(objects directly in directory ``prefix`` (``""`` or ending in ``/``), its subdirectories
        ``prefix<name>/``): one level, so the cost is that of the entries at that level only."""
        objects, prefixes = self.object_store.list_dir(self._dir_key(prefix))
        return [self._entry(o) for o in objects if not o.key.endswith("/")], [self._rel(p) for p in prefixes]

    def read(self, name: str) -> bytes:
        """The whole object; ``CheckpointNotFoundError`` if it does not exist."""
        return self.object_store.get(self.key(name))

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of ``name`` for each range, fetched concurrently."""
        bufs = [bytearray(end - start) for start, end in ranges]
        reads = [
            RangeRead(self.key(name), start, end, _opener(buf))
            for (start, end), buf in zip(ranges, bufs, strict=True)
            if end > start
        ]
        transfer = self.session.transfer
        self.object_store.read_ranges(
            reads, executor=self.session.executor, max_gap=transfer.coalesce_gap, max_size=transfer.max_range_size
        )
        return [bytes(b) for b in bufs]

    def size(self, name: str) -> int | None:
        """The object's size, or None if it does not exist."""
        head = self.object_store.head(self.key(name))
        return None if head is None else head.size

    def write(self, name: str, data: bytes, *, overwrite: bool = True) -> None:
        """Create or replace ``name`` atomically (readers see the old or the new bytes).

        ``overwrite=False``: ``CheckpointExistsError`` if ``name`` exists (checked atomically).
        """
        try:
            self.object_store.put(self.key(name), data, if_none_match=not overwrite)
        except CheckpointExistsError:
            raise CheckpointExistsError(
                f"{self.url(name)} already exists; pass overwrite (--force) to replace it"
            ) from None

    def delete(self, names: Iterable[str]) -> None:
        """Delete objects (missing ones are ignored)."""
        self.object_store.delete([self.key(n) for n in names])

    def writer(self, name: str, *, overwrite: bool | None = None) -> S3StorageWriter:
        """A DCP storage writer for the checkpoint at ``name`` (``overwrite``: the writer's, if given)."""
        return S3StorageWriter(self.url(name), options=self.options, overwrite=overwrite)

    def reader(self, name: str, kind: type[S3StorageReader] = S3StorageReader) -> S3StorageReader:
        """A DCP storage reader for the checkpoint at ``name`` (``kind``: ``S3StorageReader`` or a subclass taking
        its arguments, e.g. ``S3HuggingFaceStorageReader``)."""
        return kind(self.url(name), options=self.options)

    def uploads(self, prefix: str = "") -> list[Upload]:
        """Unfinished multipart uploads under ``prefix`` (always empty on disk)."""
        return [
            Upload(self._rel(u.key), u.upload_id, u.initiated)
            for u in self.object_store.list_uploads(self._dir_key(prefix))
        ]

    def _pending(self, upload: Upload) -> PendingUpload:
        return PendingUpload(self.key(upload.name), upload.upload_id, upload.initiated)

    def abort(self, upload: Upload) -> None:
        """Abort an unfinished multipart upload."""
        self.object_store.abort_upload(self._pending(upload))

    def upload_activity(self, upload: Upload) -> float | None:
        """When ``upload`` last received a part (else when it started); None if it is gone."""
        return self.object_store.upload_activity(self._pending(upload))

    def stream_to(self, name: str, dst: Store, dst_name: str) -> None:
        """Copy object ``name`` to ``dst_name`` of ``dst`` (any backend) through this process, over
        both object stores (so a local side is read and written without following links and
        regular files only): ranged reads of ``max_range_size``, ``max_concurrency`` at a time,
        written in order to ``dst``'s streamed writer (on S3: parts sent concurrently). Memory:
        about ``max_concurrency * max_range_size`` plus ``dst``'s part buffers."""
        key = self.key(name)
        head = self.object_store.head(key)
        if head is None:
            raise CheckpointNotFoundError(f"GET {self.url(name)}: not found")
        step = self.session.transfer.max_range_size
        window = step * max(1, self.session.transfer.max_concurrency)
        writer = dst.object_store.open_writer(
            dst.key(dst_name), pool=dst._buffers, executor=dst.session.executor, expected_size=head.size
        )
        try:
            for first in range(0, head.size, window):
                bufs = [
                    bytearray(min(head.size, start + step) - start)
                    for start in range(first, min(head.size, first + window), step)
                ]
                reads = [
                    RangeRead(key, first + i * step, first + i * step + len(b), _opener(b)) for i, b in enumerate(bufs)
                ]
                self.object_store.read_ranges(reads, executor=self.session.executor, max_gap=0, max_size=step)
                for buf in bufs:
                    writer.write(buf)
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def same_server(self, other: Store) -> bool:
        """Whether ``other`` is on the same server as this store, reached with the same credentials,
        so that :meth:`copy_from` copies server-side. False here; S3 stores of one server say True."""
        return False

    def links_out(self, names: Iterable[str] = ("",)) -> list[tuple[str, str]]:
        """(path, real target) of every symbolic link at or under ``names`` that resolves outside the
        root. None here: only a local store has links."""
        return []

    def copy_from(self, source: Store, source_name: str, name: str) -> None:
        """Copy ``source_name`` of ``source`` (a store of the same backend) to ``name`` here, without
        the bytes passing through this process where the backend can (S3: CopyObject, UploadPartCopy
        over 5 GiB, with this store's request options)."""
        size = source.size(source_name)
        if size is None:
            raise CheckpointNotFoundError(f"COPY {source.url(source_name)}: not found")
        self.object_store.copy(
            self.key(name), source.object_store, source.key(source_name), size, executor=self.session.executor
        )


def _opener(buf: bytearray) -> Callable[[], memoryview]:
    return lambda: memoryview(buf)


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else a or b
