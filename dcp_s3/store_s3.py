"""The S3 backend of :class:`dcp_s3.store.Store`: objects under ``s3://bucket/prefix``."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .config import S3Uri, TransferConfig, client_config
from .errors import CheckpointExistsError, CheckpointNotFoundError, ConfigError
from .reader import S3StorageReader
from .session import S3Session
from .store import Entry, Upload, _join
from .transfer import BufferPool, RangeRead, S3Transport
from .writer import S3StorageWriter

__all__ = ["S3Store", "split_storage_options", "CLIENT_SETTINGS"]

#: Options that choose the S3 client (the rest tune the writer/reader).
_CLIENT_OPTIONS = ("credential_path", "endpoint_url", "region", "profile", "request_args")
#: ``ClientConfig`` fields accepted as storage options of their own; folded into ``client=``.
CLIENT_SETTINGS = ("connect_timeout", "read_timeout", "retry_attempts", "retry_mode")


def _option_names(cls: type) -> set[str]:
    params = inspect.signature(cls).parameters
    return {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


def split_storage_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split S3 storage options into (``S3StorageWriter`` kwargs, ``S3StorageReader`` kwargs).

    ``ClientConfig`` settings given on their own (``connect_timeout``, ``read_timeout``,
    ``retry_attempts``, ``retry_mode``) are folded into ``client=`` (a ``ClientConfig``, given
    or default), which both classes take. Raises ``ConfigError`` naming any option neither
    class accepts.
    """
    options = dict(options)
    settings = {k: options.pop(k) for k in CLIENT_SETTINGS if options.get(k) is not None}
    for k in CLIENT_SETTINGS:
        options.pop(k, None)
    if settings:
        options["client"] = client_config(options.get("client"), 1, **settings)
    writer_names, reader_names = _option_names(S3StorageWriter), _option_names(S3StorageReader)
    unknown = sorted(set(options) - writer_names - reader_names)
    if unknown:
        accepted = sorted(writer_names | reader_names | set(CLIENT_SETTINGS))
        raise ConfigError(f"unknown storage option(s) {unknown}; S3 locations accept {accepted}")
    writer = {k: v for k, v in options.items() if k in writer_names}
    reader = {k: v for k, v in options.items() if k in reader_names}
    return writer, reader

class S3Store:
    """Objects under ``s3://bucket/prefix``.

    One ``S3Session`` carries every request: the client settings (``ClientConfig``, built from
    the storage options exactly as the writer/reader build theirs, so ``request_args``, timeouts
    and retries reach every request), the transport and the I/O pool (``TransferConfig``).
    """

    def __init__(self, uri: S3Uri, **options: Any) -> None:
        self.uri = uri
        self.root = str(uri).rstrip("/")
        self._writer_options, self._reader_options = split_storage_options(options)
        S3StorageWriter(None, **self._writer_options)  # reject a bad option now, not at the first save
        S3StorageReader(None, **self._reader_options)
        transfer = (options.get("transfer") or TransferConfig()).override(
            part_size=options.get("part_size"), max_concurrency=options.get("max_concurrency"),
            files_per_rank=options.get("files_per_rank"), max_range_size=options.get("max_range_size"),
        )
        client_options = {k: options.get(k) for k in _CLIENT_OPTIONS}
        # The writer's pool size, so that the store and its writers share one client.
        pool = transfer.max_concurrency + transfer.files_per_rank + 2
        client = client_config(self._writer_options.get("client"), pool, **client_options)
        self.session = S3Session(None, client, transfer)
        self.session.uri = uri
        # Part buffers of uploads, shared by concurrent uploads: their memory bound.
        self._buffers = BufferPool(transfer.max_concurrency + 2, transfer.part_size)

    def __repr__(self) -> str:
        return f"S3Store({self.root!r})"

    @property
    def transport(self) -> S3Transport:
        return self.session.transport

    def close(self) -> None:
        self.session.close()
        self._buffers.clear()

    def key(self, name: str) -> str:
        return _join(self.uri.key, name)

    def url(self, name: str = "") -> str:
        return f"s3://{self.uri.bucket}/{self.key(name)}".rstrip("/")

    def _rel(self, key: str) -> str:
        return key[len(self.uri.key) + 1 :] if self.uri.key else key

    def _dir_key(self, prefix: str) -> str:
        # The root is a "directory": list "key/" so that "run" does not match "run2/...".
        return self.key(prefix) if prefix else (self.uri.key + "/" if self.uri.key else "")

    def _entry(self, obj: dict[str, Any]) -> Entry:
        return Entry(self._rel(obj["Key"]), int(obj["Size"]), obj["LastModified"].timestamp())

    def list_objects(self, prefix: str = "") -> list[Entry]:
        return [self._entry(o) for o in self.transport.list_objects(self._dir_key(prefix)) if not o["Key"].endswith("/")]

    def list_dir(self, prefix: str = "") -> tuple[list[Entry], list[str]]:
        """One level under directory ``prefix`` (``""`` or ending in ``/``): (its objects, the names of
        its subdirectories, ending in ``/``), with a delimiter listing: costs O(entries at that level)."""
        objects, prefixes = self.transport.list_dir(self._dir_key(prefix))
        return [self._entry(o) for o in objects if not o["Key"].endswith("/")], [self._rel(p) for p in prefixes]

    def read(self, name: str) -> bytes:
        return self.transport.get_object(self.key(name))

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        bufs = [bytearray(end - start) for start, end in ranges]
        reads = [
            RangeRead(self.key(name), start, end, _opener(buf))
            for (start, end), buf in zip(ranges, bufs)
            if end > start
        ]
        transfer = self.session.transfer
        self.transport.read_ranges(
            reads, executor=self.session.executor, max_gap=transfer.coalesce_gap, max_size=transfer.max_range_size
        )
        return [bytes(b) for b in bufs]

    def size(self, name: str) -> int | None:
        head = self.transport.head_object(self.key(name))
        return None if head is None else int(head["ContentLength"])

    def write(self, name: str, data: bytes, *, overwrite: bool = True) -> None:
        # One PUT: atomic on S3; If-None-Match makes "only if absent" atomic too.
        try:
            self.transport.put_object(self.key(name), data, if_none_match=not overwrite)
        except CheckpointExistsError:
            raise CheckpointExistsError(f"{self.url(name)} already exists; pass overwrite (--force) to replace it") from None

    def delete(self, names: Iterable[str]) -> None:
        self.transport.delete_objects([self.key(n) for n in names])

    def writer(self, name: str, *, overwrite: bool | None = None) -> StorageWriter:
        options = dict(self._writer_options)
        if overwrite is not None:
            options["overwrite"] = overwrite
        return S3StorageWriter(self.url(name), **options)

    def reader(self, name: str) -> StorageReader:
        return S3StorageReader(self.url(name), **self._reader_options)

    def uploads(self, prefix: str = "") -> list[Upload]:
        return [
            Upload(self._rel(u["Key"]), u["UploadId"], u["Initiated"].timestamp())
            for u in self.transport.list_multipart_uploads(self._dir_key(prefix))
        ]

    def abort(self, upload: Upload) -> None:
        self.transport.abort_multipart_upload(self.key(upload.name), upload.upload_id)

    def upload_activity(self, upload: Upload) -> float | None:
        try:
            parts = self.transport.list_parts(self.key(upload.name), upload.upload_id)
        except CheckpointNotFoundError:
            return None  # completed or aborted meanwhile
        return max([upload.initiated] + [p["LastModified"].timestamp() for p in parts])

    def download(self, name: str, path: str) -> None:
        """Ranged GETs of ``max_range_size`` bytes, concurrently, each written to the file at its offset
        as it arrives: memory is bounded by ``max_concurrency * max_range_size``."""
        key = self.key(name)
        head = self.transport.head_object(key)
        if head is None:
            raise CheckpointNotFoundError(f"GET {self.url(name)}: not found")
        size = int(head["ContentLength"])
        step = self.session.transfer.max_range_size
        with open(path, "wb") as f:
            f.truncate(size)
            reads = [_file_range(key, f.fileno(), start, min(size, start + step)) for start in range(0, size, step)]
            self.transport.read_ranges(reads, executor=self.session.executor, max_gap=0, max_size=step)

    def upload(self, path: str, name: str) -> None:
        """A streaming multipart upload of the file (one PUT if small), parts sent concurrently."""
        size = os.path.getsize(path)
        writer = self.transport.open_writer(
            self.key(name), pool=self._buffers, executor=self.session.executor, expected_size=size
        )
        try:
            with open(path, "rb") as f:
                while chunk := f.read(writer.part_size):
                    writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def same_server(self, other: S3Store) -> bool:
        """Whether ``other`` reaches the same endpoint with the same credentials (so a server-side copy works)."""
        mine, theirs = self.session.client_config, other.session.client_config
        fields = ("credential_path", "endpoint_url", "region", "profile")
        return all(getattr(mine, f) == getattr(theirs, f) for f in fields)

    def copy_from(self, source: S3Store, source_name: str, name: str) -> None:
        """Server-side copy of ``source_name`` in ``source`` to ``name`` here (CopyObject; UploadPartCopy
        over 5 GiB); this store's request options apply to the copy."""
        size = source.size(source_name)
        if size is None:
            raise CheckpointNotFoundError(f"COPY {source.url(source_name)}: not found")
        self.transport.copy_object(
            self.key(name), source.transport, source.key(source_name), size, executor=self.session.executor
        )


def _file_range(key: str, fd: int, start: int, end: int) -> RangeRead:
    """A read of bytes ``[start, end)`` into a buffer allocated when they arrive, written to ``fd`` at ``start``."""
    buf: list[bytearray] = []

    def open_() -> memoryview:
        buf.append(bytearray(end - start))
        return memoryview(buf[0])

    def done() -> None:
        os.pwrite(fd, buf.pop(), start)

    return RangeRead(key, start, end, open_, done)


def _opener(buf: bytearray) -> Callable[[], memoryview]:
    return lambda: memoryview(buf)
