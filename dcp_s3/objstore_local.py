"""The local-disk backend of :class:`dcp_s3.objstore.ObjectStore`: files under a directory.

Keys become paths below the root only through :func:`~dcp_s3.objstore.check_relative_name`
(no ``..``, no absolute names), so nothing lands outside it. Every object appears whole or
not at all: it is written to a temporary file in the target directory, fsynced, then
renamed over the target (``os.replace``) and the directory fsynced. ``if_none_match`` links
the temporary file to the target (``os.link`` fails if the target exists: atomic and
exclusive). Ranged reads go straight into the caller's buffer (``os.preadv``). The "ETag" is
made of inode, size and modification time in ns. There are no multipart uploads to list.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from .buffers import BufferPool, fit_part_size
from .errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError, ConfigError, DcpS3Error
from .objstore import (
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    PendingUpload,
    RangeRead,
    check_relative_name,
    open_destination,
)

__all__ = ["LocalObjectStore", "FileWriter"]

_TMP_PREFIX = ".tmp-"


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename is durable before anything that relies on it happens
    finally:
        os.close(fd)


def _new_temp(target: str) -> tuple[int, str]:
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    return tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX)


def _commit_temp(tmp: str, target: str, *, exclusive: bool) -> None:
    """Move the (fsynced) temporary file ``tmp`` to ``target`` atomically, then fsync the directory."""
    if not exclusive:
        os.replace(tmp, target)  # atomic on POSIX: readers see the old file or the new one
    else:
        try:
            os.link(tmp, target)  # atomic, and fails if target exists
        except FileExistsError:
            raise CheckpointExistsError(f"{target} already exists") from None
        except OSError:  # a file system without hard links: check, then replace (not atomic)
            if os.path.lexists(target):
                raise CheckpointExistsError(f"{target} already exists") from None
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    _fsync_dir(os.path.dirname(target))


class LocalObjectStore(ObjectStore):
    """Files under ``root`` (which need not exist yet).

    Listing does not descend into symbolically linked directories unless ``follow_symlinks``.
    """

    def __init__(self, root: str | os.PathLike[str], *, follow_symlinks: bool = False) -> None:
        self.root = self.container = os.path.abspath(os.fspath(root))
        self.follow_symlinks = follow_symlinks

    def __repr__(self) -> str:
        return f"LocalObjectStore({self.root!r})"

    def path(self, key: str) -> str:
        if not key:
            return self.root
        return os.path.join(self.root, *check_relative_name(key, self.root).split("/"))

    def url(self, key: str = "") -> str:
        return self.path(key)

    def check_container(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"{self.root} exists and is not a directory")

    def put(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str:
        target = self.path(key)
        fd, tmp = _new_temp(target)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            _commit_temp(tmp, target, exclusive=if_none_match)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return _etag(os.stat(target))

    def conditional_writes_supported(self, probe_key: str) -> bool:
        return True  # os.link refuses an existing target

    def get(self, key: str) -> bytes:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CheckpointNotFoundError(f"{self.path(key)} does not exist") from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):  # a directory is not an object
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime, _etag(st))

    def _read_group(self, group: list[RangeRead]) -> None:
        key = group[0].key
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CheckpointNotFoundError(f"{path} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            end = group[-1].end
            if size < end:  # checked before any destination is opened (allocated)
                raise CheckpointFormatError(
                    f"read {path} bytes {group[0].start}-{end}: the file has {size} bytes "
                    "(object shorter than the checkpoint metadata says?)"
                )
            for read in group:
                dest = open_destination(read, path)
                pos = 0
                while pos < read.size:
                    n = os.preadv(fd, [dest[pos:]], read.start + pos)
                    if not n:
                        raise CheckpointFormatError(f"read {path} bytes {read.start}-{read.end}: file cut short")
                    pos += n
                if read.done is not None:
                    read.done()
        finally:
            os.close(fd)

    def open_writer(
        self, key: str, *, pool: BufferPool, executor: ThreadPoolExecutor, expected_size: int | None = None
    ) -> FileWriter:
        """Writes through to a temporary file (no buffers of ``pool``), renamed over ``key`` on close."""
        return FileWriter(self.path(key), key, fit_part_size(pool.size, expected_size))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        seen: set[str] = set()  # real paths of the directories walked: a linked loop is walked once
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
                except FileNotFoundError:  # removed while listing
                    continue
                yield ObjectInfo(key, st.st_size, st.st_mtime, _etag(st))

    def list_dir(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        """Linked subdirectories are listed only with ``follow_symlinks``."""
        objects: list[ObjectInfo] = []
        dirs: list[str] = []
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

    def delete(self, keys: Sequence[str]) -> None:
        """Directories left empty are removed too (deepest first), never the root."""
        dirs = set()
        for key in keys:
            path = self.path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            if "/" in key:
                dirs.add(os.path.dirname(path))
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)

    def copy(self, key: str, source: ObjectStore, source_key: str, size: int, *, executor: ThreadPoolExecutor) -> None:
        if not isinstance(source, LocalObjectStore):
            raise ConfigError(f"copy {source.url(source_key)} to {self.url(key)}: not a local source")
        target = self.path(key)
        fd, tmp = _new_temp(target)
        os.close(fd)
        try:
            try:
                shutil.copyfile(source.path(source_key), tmp)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{source.path(source_key)} does not exist") from None
            _commit_temp(tmp, target, exclusive=False)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def list_uploads(self, prefix: str) -> list[PendingUpload]:
        return []

    def abort_upload(self, upload: PendingUpload) -> None:  # pragma: no cover - nothing to abort on disk
        raise DcpS3Error("local directories have no multipart uploads")

    def upload_activity(self, upload: PendingUpload) -> float | None:  # pragma: no cover - no uploads on disk
        return None


class FileWriter(ObjectWriter):
    """Writes one file through a temporary file next to it; ``close`` fsyncs and renames it into place."""

    def __init__(self, target: str, key: str, part_size: int) -> None:
        super().__init__(key, part_size, target)
        self._target = target
        fd, self._tmp = _new_temp(target)
        self._file = os.fdopen(fd, "wb")

    def _write(self, view: memoryview) -> None:
        self._file.write(view)

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        _commit_temp(self._tmp, self._target, exclusive=False)

    def _abort(self) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)
