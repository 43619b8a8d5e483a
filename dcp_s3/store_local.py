"""The local disk backend of :class:`dcp_s3.store.Store`: files under a directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .byte_items import CheckedFileSystemReader
from .errors import CheckpointExistsError, CheckpointNotFoundError, DcpS3Error
from .local_writer import SafeFileSystemWriter
from .store import Entry, Upload, check_relative_name

__all__ = ["LocalStore"]


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
