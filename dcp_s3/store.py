"""One interface over a checkpoint root on S3 (``s3://bucket/prefix``) or on local disk.

The checkpoint manager and the ``dcp-s3`` tools work on *objects* named relative to a
root: list (recursively, by name prefix), read, read byte ranges, write (atomically),
delete, and make a DCP ``StorageWriter``/``StorageReader`` for a sub-location. On S3 the
writer/reader are ``S3StorageWriter``/``S3StorageReader``; on disk ``SafeFileSystemWriter``
(torch's ``FileSystemWriter`` with an atomic overwrite) and ``CheckedFileSystemReader`` (torch's
``FileSystemReader`` with dcp_s3's byte item check). Names always use ``/``.

This module holds the interface (``Store``, ``Entry``, ``Upload``) and ``open_store``; the backends
are ``dcp_s3.store_s3.S3Store`` and ``dcp_s3.store_local.LocalStore`` (also importable from here).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .config import parse_s3_uri
from .errors import CheckpointFormatError, ConfigError, InvalidCheckpointIdError

if TYPE_CHECKING:
    from .store_local import LocalStore
    from .store_s3 import S3Store, split_storage_options

__all__ = [
    "Entry", "Upload", "Store", "S3Store", "LocalStore", "open_store", "open_object", "split_storage_options",
    "check_relative_name",
]


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

def open_store(
    location: str | os.PathLike[str], *, follow_symlinks: bool = False, **storage_options: Any
) -> S3Store | LocalStore:
    """A store rooted at ``s3://bucket[/prefix]`` or at a local directory.

    ``storage_options`` are ``S3StorageWriter``/``S3StorageReader`` keywords; they are
    rejected (``ConfigError``) for local directories, where they would silently do nothing.
    ``follow_symlinks``: a local store lists linked directories too (see ``LocalStore``).
    """
    from .store_local import LocalStore
    from .store_s3 import S3Store

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


def __getattr__(name: str) -> Any:
    """The backends and their helpers, imported on first use (they import this module)."""
    if name == "LocalStore":
        from .store_local import LocalStore

        return LocalStore
    if name in ("S3Store", "split_storage_options", "CLIENT_SETTINGS"):
        from . import store_s3

        return getattr(store_s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
