"""The local-disk backend of :class:`dcp_s3._objstore.base.ObjectStore`: files under a directory.

Keys become paths below the root only through :func:`~dcp_s3._objstore.base.check_relative_name`
(no ``..``, no absolute names), so nothing lands outside it. Every object appears whole or
not at all: it is written to a temporary file in the target directory, fsynced, then
renamed over the target (``os.replace``) and the directory fsynced. ``if_none_match`` links
the temporary file to the target (``os.link`` fails if the target exists: atomic and
exclusive). Ranged reads go straight into the caller's buffer (``os.preadv``). The "ETag" is
made of inode, size and modification time in ns. There are no multipart uploads to list.

Whatever lies below the root is as untrusted as a bucket's keys (the root itself may be a
link the user chose): every access walks the key's directories from a descriptor of the root
(:mod:`dcp_s3._objstore.local_fs`), one component at a time with ``O_NOFOLLOW``, and reads open the
object with ``O_NOFOLLOW | O_NONBLOCK`` and require a regular file (``fstat``). So a symbolic
link where a directory or an object should be is refused (``CheckpointFormatError`` naming
the key), a FIFO or device never blocks or streams, and writes, renames and deletes act on
entries inside the root only (deleting a key that is a link removes the link, never its
target). ``follow_symlinks=True`` (a tree the user trusts, e.g. ``dcp-s3 cp --follow-symlinks``)
lets listings and reads follow links; writes and deletes never do. Every ``OSError`` becomes
a :class:`~dcp_s3.errors.DcpS3Error` subclass of the same builtin naming the path.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from dcp_s3._objstore.base import (
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    PendingUpload,
    RangeRead,
    check_relative_name,
    check_whole_size,
    open_destination,
)
from dcp_s3._objstore.buffers import BufferPool, fit_part_size
from dcp_s3._objstore.config import DEFAULT_MAX_WHOLE_READ
from dcp_s3._objstore.local_fs import Dirs, new_temp, os_errors, unlink_quietly
from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError, ConfigError, DcpS3Error

__all__ = ["LocalObjectStore", "FileWriter"]

_READ_CHUNK = 1 << 26  # os.read of at most 64 MiB at a time (Linux returns at most ~2 GiB per call anyway)


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


class LocalObjectStore(ObjectStore):
    """Files under ``root`` (which need not exist yet).

    Listing does not descend into symbolically linked directories, and reads refuse links
    below the root, unless ``follow_symlinks``. ``max_whole_read`` caps :meth:`get`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        follow_symlinks: bool = False,
        max_whole_read: int = DEFAULT_MAX_WHOLE_READ,
    ) -> None:
        self.root = self.container = os.path.abspath(os.fspath(root))
        self.follow_symlinks = follow_symlinks
        self.max_whole_read = max_whole_read
        self._dirs = Dirs(self.root, self.path)

    def __repr__(self) -> str:
        return f"LocalObjectStore({self.root!r})"

    def path(self, key: str) -> str:
        if not key:
            return self.root
        return os.path.join(self.root, *check_relative_name(key, self.root).split("/"))

    def url(self, key: str = "") -> str:
        return self.path(key)

    def _split(self, key: str) -> tuple[list[str], str]:
        parts = check_relative_name(key, self.root).split("/")
        return parts[:-1], parts[-1]

    def check_container(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"{self.root} exists and is not a directory")

    # -- writing ---------------------------------------------------------------------------
    def put(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str:
        dirs, name = self._split(key)
        with os_errors("write", self.path(key)):
            dfd = self._dirs.open(key, dirs, create=True, follow=False)
            try:
                fd, tmp = new_temp(dfd)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(body)
                        f.flush()
                        os.fsync(f.fileno())
                    self._commit(dfd, tmp, name, key, exclusive=if_none_match)
                finally:
                    unlink_quietly(tmp, dfd)
                return _etag(os.stat(name, dir_fd=dfd, follow_symlinks=False))
            finally:
                os.close(dfd)

    def _commit(self, dfd: int, tmp: str, name: str, key: str, *, exclusive: bool) -> None:
        """Move the (fsynced) temporary file ``tmp`` to ``name`` in ``dfd`` atomically, then fsync the directory."""
        if not exclusive:
            self._dirs.refuse_link(dfd, name, key)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # readers see the old file or the new one
        else:
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)  # fails if name exists
            except FileExistsError:
                raise CheckpointExistsError(f"{self.path(key)} already exists") from None
            except OSError:  # a file system without hard links: check, then replace (not atomic)
                if self._dirs.lexists(dfd, name):
                    raise CheckpointExistsError(f"{self.path(key)} already exists") from None
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)  # the rename is durable before anything that relies on it happens

    def conditional_writes_supported(self, probe_key: str) -> bool:
        return True  # os.link refuses an existing target

    def open_writer(
        self, key: str, *, pool: BufferPool, executor: ThreadPoolExecutor, expected_size: int | None = None
    ) -> FileWriter:
        """Writes through to a temporary file (no buffers of ``pool``), renamed over ``key`` on close."""
        return FileWriter(self, key, fit_part_size(pool.size, expected_size))

    def copy(self, key: str, source: ObjectStore, source_key: str, size: int, *, executor: ThreadPoolExecutor) -> None:
        if not isinstance(source, LocalObjectStore):
            raise ConfigError(f"copy {source.url(source_key)} to {self.url(key)}: not a local source")
        src, _ = source._open_object(source_key, "copy")
        try:
            with os_errors("copy", f"{source.path(source_key)} to {self.path(key)}"):
                writer = FileWriter(self, key, 1 << 20)
                try:
                    while chunk := os.read(src, 1 << 20):
                        writer.write(chunk)
                except BaseException:
                    writer.abort()
                    raise
                writer.close()
        finally:
            os.close(src)

    # -- reading ---------------------------------------------------------------------------
    def _open_object(self, key: str, action: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of the regular file ``key`` and its ``fstat``."""
        dirs, name = self._split(key)
        path = self.path(key)
        follow = self.follow_symlinks
        with os_errors(action, path):
            dfd = self._dirs.open(key, dirs, create=False, follow=follow)
            try:
                flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
                try:
                    fd = os.open(name, flags, dir_fd=dfd)  # O_NONBLOCK: a FIFO opens at once, and is refused below
                except FileNotFoundError:
                    raise CheckpointNotFoundError(f"{path} does not exist") from None
                except OSError:
                    self._dirs.refuse_link(dfd, name, key)  # O_NOFOLLOW on a link fails with ELOOP
                    raise
            finally:
                os.close(dfd)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):  # a directory is not an object
                    raise CheckpointNotFoundError(f"{path} does not exist (it is a directory)")
                if not stat.S_ISREG(st.st_mode):
                    raise CheckpointFormatError(
                        f"{path} is not a regular file (a FIFO, socket or device); refusing to read it"
                    )
            except BaseException:
                os.close(fd)
                raise
            return fd, st

    def get(self, key: str) -> bytes:
        fd, st = self._open_object(key, "read")
        path, limit = self.path(key), self.max_whole_read
        try:
            check_whole_size(path, st.st_size, limit)
            with os_errors("read", path):
                chunks: list[bytes] = []
                got = 0
                while got <= limit:  # a file growing while read stops at limit + 1 bytes
                    want = st.st_size + 1 - got if got < st.st_size else _READ_CHUNK  # + 1: EOF seen at once
                    chunk = os.read(fd, min(want, limit + 1 - got, _READ_CHUNK))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
            check_whole_size(path, got, limit)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        dirs, name = self._split(key)
        with os_errors("stat", self.path(key)):
            try:
                dfd = self._dirs.open(key, dirs, create=False, follow=self.follow_symlinks)
            except CheckpointNotFoundError:
                return None
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=self.follow_symlinks)
            except FileNotFoundError:
                return None
            finally:
                os.close(dfd)
        if stat.S_ISLNK(st.st_mode):
            raise self._dirs.link_error(key, key)
        if stat.S_ISDIR(st.st_mode):  # a directory is not an object
            return None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{self.path(key)} is not a regular file (a FIFO, socket or device)")
        return ObjectInfo(key, st.st_size, st.st_mtime, _etag(st))

    def _read_group(self, group: list[RangeRead]) -> None:
        key = group[0].key
        path = self.path(key)
        fd, st = self._open_object(key, "read")
        try:
            end = group[-1].end
            if st.st_size < end:  # checked before any destination is opened (allocated)
                raise CheckpointFormatError(
                    f"read {path} bytes {group[0].start}-{end}: the file has {st.st_size} bytes "
                    "(object shorter than the checkpoint metadata says?)"
                )
            for read in group:
                dest = open_destination(read, path)
                pos = 0
                while pos < read.size:
                    with os_errors("read", path):
                        n = os.preadv(fd, [dest[pos:]], read.start + pos)
                    if not n:
                        raise CheckpointFormatError(f"read {path} bytes {read.start}-{read.end}: file cut short")
                    if read.received is not None:
                        read.received(dest[pos : pos + n])
                    pos += n
                if read.done is not None:
                    read.done()
        finally:
            os.close(fd)

    # -- listing ---------------------------------------------------------------------------
    def _through_link(self, base: str) -> bool:
        """A listing walks no linked directory unless ``follow_symlinks`` (as ``os.walk``)."""
        return not self.follow_symlinks and bool(base) and self._dirs.linked(check_relative_name(base, self.root))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if self._through_link(base):
            return
        seen: set[str] = set()  # real paths of the directories walked: a linked loop is walked once
        with os_errors("list", self.path(base)):
            for dirpath, dirnames, filenames in os.walk(self.path(base), followlinks=self.follow_symlinks):
                real = os.path.realpath(dirpath)
                if real in seen:
                    dirnames.clear()
                    continue
                seen.add(real)
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
                for fn in sorted(filenames):
                    key = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                    if not key.startswith(prefix):
                        continue
                    try:
                        st = os.stat(os.path.join(dirpath, fn))
                    except FileNotFoundError:  # removed while listing (or a dangling link)
                        continue
                    yield ObjectInfo(key, st.st_size, st.st_mtime, _etag(st))

    def list_dir(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        """Linked subdirectories are listed only with ``follow_symlinks``."""
        objects: list[ObjectInfo] = []
        dirs: list[str] = []
        if self._through_link(prefix.rstrip("/")):
            return [], []
        with os_errors("list", self.path(prefix.rstrip("/"))):
            try:
                with os.scandir(self.path(prefix.rstrip("/"))) as it:
                    found = sorted(it, key=lambda e: e.name)
            except (FileNotFoundError, NotADirectoryError):
                return [], []
            for entry in found:
                try:
                    if entry.is_dir(follow_symlinks=self.follow_symlinks):
                        dirs.append(f"{prefix}{entry.name}/")
                    elif not entry.is_dir():
                        st = entry.stat()
                        objects.append(ObjectInfo(prefix + entry.name, st.st_size, st.st_mtime, _etag(st)))
                except FileNotFoundError:  # removed while listing
                    continue
        return objects, dirs

    # -- deleting ----------------------------------------------------------------------------
    def delete(self, keys: Sequence[str]) -> None:
        """Directories left empty are removed too (deepest first), never the root.

        A key whose directories include a symbolic link is not deleted (nothing is ever removed
        through a link): the others are, then ``CheckpointFormatError`` names the first refused.
        A key that is itself a link loses the link, never its target.
        """
        refused: list[DcpS3Error] = []
        emptied: set[tuple[str, ...]] = set()
        for key in keys:
            dirs, name = self._split(key)
            with os_errors("delete", self.path(key)):
                try:
                    dfd = self._dirs.open(key, dirs, create=False, follow=False)
                except CheckpointNotFoundError:
                    continue
                except CheckpointFormatError as exc:
                    refused.append(exc)
                    continue
                try:
                    os.unlink(name, dir_fd=dfd)
                except (FileNotFoundError, IsADirectoryError):  # gone already; a directory is not an object
                    pass
                finally:
                    os.close(dfd)
            emptied.update(tuple(dirs[:i]) for i in range(1, len(dirs) + 1))
        for d in sorted(emptied, key=len, reverse=True):
            try:
                dfd = self._dirs.open("/".join(d), list(d[:-1]), create=False, follow=False)
            except (DcpS3Error, OSError):
                continue
            try:
                os.rmdir(d[-1], dir_fd=dfd)  # fails on a link (ENOTDIR) and on a directory not empty
            except OSError:
                pass
            finally:
                os.close(dfd)
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise CheckpointFormatError(f"not deleted: {refused[0]}{more}")

    def list_uploads(self, prefix: str) -> list[PendingUpload]:
        return []

    def abort_upload(self, upload: PendingUpload) -> None:  # pragma: no cover - nothing to abort on disk
        raise DcpS3Error("local directories have no multipart uploads")

    def upload_activity(self, upload: PendingUpload) -> float | None:  # pragma: no cover - no uploads on disk
        return None


class FileWriter(ObjectWriter):
    """Writes one file through a temporary file next to it; ``close`` fsyncs and renames it into place.

    The directory is opened (and created) once, without following links; the temporary file
    and the rename act in that directory only.
    """

    def __init__(self, store: LocalObjectStore, key: str, part_size: int) -> None:
        target = store.path(key)
        super().__init__(key, part_size, target)
        self._store, self._target = store, target
        dirs, self._name = store._split(key)
        with os_errors("write", target):
            self._dfd = store._dirs.open(key, dirs, create=True, follow=False)
            try:
                fd, self._tmp = new_temp(self._dfd)
            except BaseException:
                os.close(self._dfd)
                raise
        self._file = os.fdopen(fd, "wb")

    def _write(self, view: memoryview) -> None:
        with os_errors("write", self._target):
            self._file.write(view)

    def _finish(self) -> None:
        with os_errors("write", self._target):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            try:
                self._store._commit(self._dfd, self._tmp, self._name, self.key, exclusive=False)
            finally:
                unlink_quietly(self._tmp, self._dfd)
                os.close(self._dfd)
                self._dfd = -1

    def _abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        if self._dfd >= 0:
            unlink_quietly(self._tmp, self._dfd)
            os.close(self._dfd)
            self._dfd = -1
