"""What a writer and a reader share: the checkpoint location, its object store, the pools.

A location is ``s3://bucket/key`` (the S3 backend, one store per bucket) or a local
directory, given as a path or ``file://`` URL (the local backend, one store rooted at the
checkpoint directory). ``Session`` is picklable: only the location and the (secret-free)
configs travel; the store, its client and the thread pool are created lazily in whichever
process uses them, which is what ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` needs.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dcp_s3._objstore.base import ObjectStore
from dcp_s3._objstore.config import ClientConfig, TransferConfig
from dcp_s3._objstore.local import LocalObjectStore
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3._objstore.s3_requests import check_request_args
from dcp_s3._objstore.uri import S3Uri, parse_s3_uri, s3_location
from dcp_s3.errors import ConfigError, DcpS3Error, InvalidCheckpointIdError

__all__ = ["Session", "Location", "LocalDir", "parse_location", "file_url_path"]


@dataclass(frozen=True, slots=True)
class LocalDir:
    """A checkpoint directory on local disk (an absolute path); object names are relative to it.

    ``follow_symlinks``: listings descend into linked directories and reads follow links below the
    directory; writes and deletes never do (see ``LocalObjectStore``). Readers and writers made from
    a path never follow.
    """

    path: str
    follow_symlinks: bool = False
    #: A directory above ``path`` that the user chose (a ``Checkpointer``'s run directory, ``path``
    #: being one part of a step): the store is rooted there, and the rest of ``path`` is walked as
    #: part of every key, never through a symbolic link. None: rooted at ``path`` itself.
    anchor: str | None = None

    @property
    def root(self) -> str:
        """The directory the local object store is rooted at (opened by path: it may be a link)."""
        return self.anchor if self.anchor is not None else self.path

    def join(self, name: str) -> str:
        if self.anchor is None or self.anchor == self.path:
            return name
        rel = os.path.relpath(self.path, self.anchor).replace(os.sep, "/")
        return f"{rel}/{name}" if name else rel

    def __str__(self) -> str:
        return self.path


def parse_location(path: str | os.PathLike[str]) -> S3Uri | LocalDir:
    """``s3://bucket/key`` → ``S3Uri``; a local path or ``file://`` URL → ``LocalDir``; other schemes and S3
    look-alikes (``s3:/bucket/key`` as a string: :func:`dcp_s3._objstore.uri.s3_location`) refused."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise InvalidCheckpointIdError(f"checkpoint id {path!r}: expected s3://bucket/key or a local directory")
    s3 = s3_location(path)
    if s3 is not None:
        return parse_s3_uri(s3)
    if text.startswith("file:"):
        return LocalDir(file_url_path(text))
    if "://" in text:
        return parse_s3_uri(text)
    return LocalDir(os.path.abspath(text))


def file_url_path(url: str) -> str:
    """The absolute path of a ``file:`` URL (RFC 8089): ``file:///abs/path``, ``file://localhost/abs/path``
    or ``file:/abs/path``; ``ConfigError`` for anything else (no path, a relative path, another host).

    The path is taken verbatim (no percent-decoding), as the plain path would be.
    """
    rest = url[len("file:") :]
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise ConfigError(
                f"checkpoint id {url!r} names host {host!r}; a file: URL must be local: file:///abs/path "
                "(or file://localhost/abs/path)"
            )
        path = slash + path
    else:
        path = rest
    if not path.startswith("/"):
        raise ConfigError(
            f"checkpoint id {url!r} has no absolute path; expected file:///abs/path (a relative directory "
            "is given as a plain path)"
        )
    return os.path.abspath(path)


class Session:
    """The checkpoint location plus its lazily created object store and worker pool."""

    def __init__(self, path: str | os.PathLike[str] | None, client: ClientConfig, transfer: TransferConfig) -> None:
        self.location: S3Uri | LocalDir | None = None if path is None else parse_location(path)
        check_request_args(client.request_args)
        self.client_config = client
        self.transfer = transfer
        self._lock = threading.Lock()
        self._object_store: ObjectStore | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"location": self.location, "client_config": self.client_config, "transfer": self.transfer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["client_config"], state["transfer"])  # type: ignore[misc]
        self.location = state["location"]

    def set_path(self, path: str | os.PathLike[str]) -> None:
        location = parse_location(path)
        with self._lock:
            old = self.location
            if (
                isinstance(location, LocalDir)
                and isinstance(old, LocalDir)
                and old.anchor is not None
                and _below(location.path, old.anchor)  # e.g. a reused writer retargeted to the next step
            ):
                location = dataclasses.replace(location, anchor=old.anchor)
            if _container(location) != _container(self.location):
                self._object_store = None
            self.location = location

    def anchor_local(self, root: str) -> None:
        """Root a local location's store at ``root``, a directory above it that the user chose, so
        that the directories between (a step's part directory) are not followed through a link."""
        with self._lock:
            location = self.location
            if isinstance(location, LocalDir) and _below(location.path, root):
                self.location = dataclasses.replace(location, anchor=root)
                self._object_store = None

    def require_location(self) -> S3Uri | LocalDir:
        if self.location is None:
            raise InvalidCheckpointIdError(
                "no checkpoint location: pass path='s3://bucket/key' (or a local directory) to the writer/reader "
                "or checkpoint_id= to dcp"
            )
        return self.location

    def plan_requests(self, prefixes: int = 1) -> None:
        """Tell the object store the job's size before its requests (see ``ObjectStore.plan_requests``)."""
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.object_store.plan_requests(ranks, prefixes)

    def key(self, name: str) -> str:
        """The store key of ``name`` (relative to the checkpoint)."""
        return self.require_location().join(name)

    def url(self, name: str) -> str:
        """``name`` (relative to the checkpoint) as a user would write it, for messages."""
        return self.object_store.url(self.key(name))

    @property
    def object_store(self) -> ObjectStore:
        """The object store of the checkpoint's bucket (S3) or directory (local disk)."""
        location = self.require_location()
        with self._lock:
            self._check_fork()
            if self._object_store is None:
                if isinstance(location, LocalDir):
                    self._object_store = LocalObjectStore(
                        location.root,
                        follow_symlinks=location.follow_symlinks,
                        max_whole_read=self.transfer.max_whole_read,
                    )
                else:
                    self._object_store = S3ObjectStore(
                        self.client_config.client,
                        location.bucket,
                        max_attempts=self.client_config.retry_attempts,
                        request_args=self.client_config.request_args,
                        max_whole_read=self.transfer.max_whole_read,
                    )
            return self._object_store

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The I/O pool: ``max_concurrency`` threads for part uploads and ranged reads."""
        with self._lock:
            self._check_fork()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.transfer.max_concurrency, thread_name_prefix="dcp_s3-io")
            return self._executor

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # threads do not survive fork
            self._pid = os.getpid()
            self._executor = None
            self._object_store = None

    def close(self) -> None:
        """Stop the worker threads (they are recreated on next use)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _container(location: S3Uri | LocalDir | None) -> tuple[str, str] | None:
    if location is None:
        return None
    return ("local", location.root) if isinstance(location, LocalDir) else ("s3", location.bucket)


def _below(path: str, root: str) -> bool:
    """Whether absolute ``path`` is ``root`` or lies below it (by name: no link is resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class Location:
    """What S3StorageWriter and S3StorageReader share as DCP storage: the checkpoint id."""

    _session: Session

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for ``s3://bucket/key...``, a local path and ``file://``; other schemes are not ours."""
        try:
            parse_location(checkpoint_id)
        except DcpS3Error:
            return False
        return True

    @property
    def checkpoint_id(self) -> str:
        return str(self._session.require_location())

    def _reset_location(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id:
            self._session.set_path(checkpoint_id)
