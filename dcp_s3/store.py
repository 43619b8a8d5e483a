"""One interface over a checkpoint root on S3 (``s3://bucket/prefix``) or on local disk.

The checkpoint manager and the ``dcp-s3`` tools work on *objects* named relative to a
root: list (recursively, by name prefix), read, read byte ranges, write (atomically),
delete, and make a DCP ``StorageWriter``/``StorageReader`` for a sub-location. On S3 the
writer/reader are ``S3StorageWriter``/``S3StorageReader``; on disk ``SafeFileSystemWriter``
(torch's ``FileSystemWriter`` with an atomic overwrite) and ``CheckedFileSystemReader`` (torch's
``FileSystemReader`` with dcp_s3's byte item check). Names always use ``/``.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .byte_items import CheckedFileSystemReader
from .config import S3Uri, TransferConfig, client_config, parse_s3_uri
from .errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    InvalidCheckpointIdError,
)
from .local_writer import SafeFileSystemWriter
from .reader import S3StorageReader
from .session import S3Session
from .transfer import BufferPool, RangeRead, S3Transport
from .writer import S3StorageWriter

__all__ = ["Entry", "Upload", "Store", "S3Store", "LocalStore", "open_store", "open_object", "split_storage_options"]

#: Options that choose the S3 client (the rest tune the writer/reader).
_CLIENT_OPTIONS = ("credential_path", "endpoint_url", "region", "profile", "request_args")
#: ``ClientConfig`` fields accepted as storage options of their own; folded into ``client=``.
CLIENT_SETTINGS = ("connect_timeout", "read_timeout", "retry_attempts", "retry_mode")


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


class Store(Protocol):
    """Objects under one root location; names are relative to the root and use ``/``."""

    root: str

    def url(self, name: str = "") -> str:
        """The location of ``name`` as a user would write it (``s3://...`` or a path)."""
        ...

    def list_objects(self, prefix: str = "") -> list[Entry]:
        """Every object whose relative name starts with ``prefix`` (a plain string prefix)."""
        ...

    def list_dir(self, prefix: str = "") -> tuple[list[Entry], list[str]]:
        """(objects directly in directory ``prefix`` (``""`` or ending in ``/``), its subdirectories
        ``prefix<name>/``): one level, so the cost is that of the entries at that level only."""
        ...

    def read(self, name: str) -> bytes:
        """The whole object; ``CheckpointNotFoundError`` if it does not exist."""
        ...

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of ``name`` for each range (fetched concurrently on S3)."""
        ...

    def size(self, name: str) -> int | None:
        """The object's size, or None if it does not exist."""
        ...

    def write(self, name: str, data: bytes, *, overwrite: bool = True) -> None:
        """Create or replace ``name`` atomically (readers see the old or the new bytes).

        ``overwrite=False``: ``CheckpointExistsError`` if ``name`` exists (checked atomically).
        """
        ...

    def delete(self, names: Iterable[str]) -> None:
        """Delete objects (missing ones are ignored)."""
        ...

    def writer(self, name: str, *, overwrite: bool | None = None) -> StorageWriter:
        """A DCP storage writer for the checkpoint at ``name`` (``overwrite``: the writer's, if given)."""
        ...

    def reader(self, name: str) -> StorageReader:
        """A DCP storage reader for the checkpoint at ``name``."""
        ...

    def uploads(self, prefix: str = "") -> list[Upload]:
        """Unfinished multipart uploads under ``prefix`` (always empty on disk)."""
        ...

    def abort(self, upload: Upload) -> None:
        """Abort an unfinished multipart upload."""
        ...

    def upload_activity(self, upload: Upload) -> float | None:
        """When ``upload`` last received a part (else when it started); None if it is gone."""
        ...

    def download(self, name: str, path: str) -> None:
        """Copy object ``name`` to the local file ``path``."""
        ...

    def upload(self, path: str, name: str) -> None:
        """Copy the local file ``path`` to object ``name``."""
        ...


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else a or b


def check_relative_name(name: str, origin: str) -> str:
    """``name`` if it is a clean relative object name (no empty, ``.`` or ``..`` segment, no NUL,
    no leading ``/``; on Windows no ``\\``), so the file path or key made from it stays under its root.

    A bucket can hold keys such as ``ck/../../x`` (S3 stores them verbatim); turned into a
    local path, or re-sent to a server that normalizes paths, such a key would land outside
    the target. ``origin`` says where the name came from, for the error.
    """
    segments = name.split("/")
    separators = {os.sep, os.altsep or "/"} - {"/"}  # a backslash separates paths on Windows
    if not name or any(seg in ("", ".", "..") for seg in segments) or "\0" in name or separators & set(name):
        raise CheckpointFormatError(
            f"refusing object name {name!r} from {origin}: its '', '.' or '..' segments (or NUL, or a path "
            "separator) would resolve outside the target; rename or delete that object"
        )
    return name


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


class LocalStore:
    """Files under a local directory (which need not exist yet).

    Names from elsewhere (object keys) are checked by ``check_relative_name`` before they
    become paths. Listing does not descend into symbolically linked directories unless
    ``follow_symlinks``; :meth:`links_out` tells which paths resolve outside the root.
    """

    def __init__(self, root: str | os.PathLike[str], *, follow_symlinks: bool = False) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.follow_symlinks = follow_symlinks

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def close(self) -> None:
        pass

    def path(self, name: str) -> str:
        if not name:
            return self.root
        return os.path.join(self.root, *check_relative_name(name, self.root).split("/"))

    def links_out(self, names: Iterable[str] = ("",)) -> list[tuple[str, str]]:
        """(path, real target) of every symbolic link at or under ``names`` (files or directories,
        existing or not: the nearest existing ancestor counts) that resolves outside the root."""
        real_root = os.path.realpath(self.root)

        def outside(path: str) -> str | None:
            real = os.path.realpath(path)
            return None if os.path.commonpath([real, real_root]) == real_root else real

        found: dict[str, str] = {}
        for name in names:
            top = self.path(name)
            target = outside(top)
            if target is not None:
                link = top
                while os.path.dirname(link) != link and outside(os.path.dirname(link)) is not None:
                    link = os.path.dirname(link)  # report the link itself, not a path below it
                found[link] = os.path.realpath(link)
                continue
            for dirpath, dirnames, filenames in os.walk(top):
                for entry in dirnames + filenames:
                    path = os.path.join(dirpath, entry)
                    if os.path.islink(path) and (target := outside(path)) is not None:
                        found[path] = target
        return sorted(found.items())

    def url(self, name: str = "") -> str:
        return self.path(name)

    def list_objects(self, prefix: str = "") -> list[Entry]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.path(base)
        out: list[Entry] = []
        seen: set[str] = set()  # real paths of the directories walked: a linked loop is walked once
        for dirpath, dirnames, filenames in os.walk(top, followlinks=self.follow_symlinks):
            real = os.path.realpath(dirpath)
            if real in seen:
                dirnames.clear()
                continue
            seen.add(real)
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for fn in sorted(filenames):
                name = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                if not name.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, fn))
                except FileNotFoundError:  # removed while listing
                    continue
                out.append(Entry(name, st.st_size, st.st_mtime))
        return out

    def list_dir(self, prefix: str = "") -> tuple[list[Entry], list[str]]:
        """One level under directory ``prefix`` (``""`` or ending in ``/``): (its files, the names of its
        subdirectories, ending in ``/``; linked ones only with ``follow_symlinks``)."""
        top = self.path(prefix.rstrip("/"))
        objects: list[Entry] = []
        dirs: list[str] = []
        try:
            with os.scandir(top) as it:
                found = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        for entry in found:
            try:
                if entry.is_dir(follow_symlinks=self.follow_symlinks):
                    dirs.append(f"{prefix}{entry.name}/")
                elif not entry.is_dir():
                    st = entry.stat()
                    objects.append(Entry(prefix + entry.name, st.st_size, st.st_mtime))
            except FileNotFoundError:  # removed while listing
                continue
        return objects, dirs

    def read(self, name: str) -> bytes:
        try:
            with open(self.path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path(name)} does not exist") from None

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        out = []
        try:
            with open(self.path(name), "rb") as f:
                for start, end in ranges:
                    f.seek(start)
                    data = f.read(end - start)
                    if len(data) != end - start:
                        raise CheckpointNotFoundError(
                            f"{self.path(name)}: bytes {start}-{end} requested, file ends at {start + len(data)}"
                        )
                    out.append(data)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path(name)} does not exist") from None
        return out

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self.path(name)).st_size
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes, *, overwrite: bool = True) -> None:
        target = self.path(name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, target)  # atomic on POSIX
            else:
                try:
                    os.link(tmp, target)  # atomic, and fails if target exists
                except FileExistsError:
                    raise CheckpointExistsError(f"{target} already exists; pass overwrite (--force) to replace it") from None
                except OSError:  # a file system without hard links: check, then replace
                    if os.path.lexists(target):
                        raise CheckpointExistsError(f"{target} already exists; pass overwrite (--force) to replace it") from None
                    os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def delete(self, names: Iterable[str]) -> None:
        dirs = set()
        for name in names:
            try:
                os.unlink(self.path(name))
            except FileNotFoundError:
                pass
            if "/" in name:
                dirs.add(os.path.dirname(self.path(name)))
        # Remove directories left empty (deepest first), never the root.
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)

    def writer(self, name: str, *, overwrite: bool | None = None) -> StorageWriter:
        return SafeFileSystemWriter(self.path(name), overwrite=overwrite is not False)

    def reader(self, name: str) -> StorageReader:
        return CheckedFileSystemReader(self.path(name))  # byte items checked as on S3

    def uploads(self, prefix: str = "") -> list[Upload]:
        return []

    def abort(self, upload: Upload) -> None:  # pragma: no cover - nothing to abort on disk
        raise DcpS3Error("local directories have no multipart uploads")

    def upload_activity(self, upload: Upload) -> float | None:  # pragma: no cover - no uploads on disk
        return None

    def download(self, name: str, path: str) -> None:
        try:
            shutil.copyfile(self.path(name), path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path(name)} does not exist") from None

    def upload(self, path: str, name: str) -> None:
        target = self.path(name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path, target)


def open_store(
    location: str | os.PathLike[str], *, follow_symlinks: bool = False, **storage_options: Any
) -> S3Store | LocalStore:
    """A store rooted at ``s3://bucket[/prefix]`` or at a local directory.

    ``storage_options`` are ``S3StorageWriter``/``S3StorageReader`` keywords; they are
    rejected (``ConfigError``) for local directories, where they would silently do nothing.
    ``follow_symlinks``: a local store lists linked directories too (see ``LocalStore``).
    """
    text = os.fspath(location)
    if text.startswith("s3://"):
        return S3Store(parse_s3_uri(text, require_key=False), **storage_options)
    if "://" in text:
        raise InvalidCheckpointIdError(f"{text!r}: unsupported scheme; expected s3://bucket/prefix or a local path")
    given = sorted(k for k, v in storage_options.items() if v is not None)
    if given:
        raise ConfigError(f"storage options {given} apply to s3:// locations only, not to local path {text!r}")
    return LocalStore(text, follow_symlinks=follow_symlinks)


def open_object(
    location: str | os.PathLike[str], *, follow_symlinks: bool = False, **storage_options: Any
) -> tuple[S3Store | LocalStore, str]:
    """(store of the parent location, object name) for one object/file location."""
    text = os.fspath(location).rstrip("/")
    if text.startswith("s3://"):
        uri = parse_s3_uri(text)
        parent, _, name = uri.key.rpartition("/")
        return open_store(f"s3://{uri.bucket}/{parent}", **storage_options), name
    parent, name = os.path.split(os.path.abspath(text))
    return open_store(parent, follow_symlinks=follow_symlinks, **storage_options), name
