"""What a writer and a reader share: the checkpoint location, the client, the pools.

``S3Session`` is picklable: only the URI and the (secret-free) configs travel;
the boto3 client and thread pool are created lazily in whichever process uses
them, which is what ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` needs.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .config import ClientConfig, S3Uri, TransferConfig, parse_s3_uri
from .errors import DcpS3Error, InvalidCheckpointIdError
from .transfer import S3Transport, check_request_args

__all__ = ["S3Session", "S3Location"]


class S3Session:
    """The checkpoint URI plus lazily created transport and worker pool."""

    def __init__(self, path: str | os.PathLike[str] | None, client: ClientConfig, transfer: TransferConfig) -> None:
        self.uri: S3Uri | None = None if path is None else parse_s3_uri(path)
        check_request_args(client.request_args)
        self.client_config = client
        self.transfer = transfer
        self._lock = threading.Lock()
        self._transport: S3Transport | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "client_config": self.client_config, "transfer": self.transfer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["client_config"], state["transfer"])  # type: ignore[misc]
        self.uri = state["uri"]

    def set_path(self, path: str | os.PathLike[str]) -> None:
        uri = parse_s3_uri(path)
        with self._lock:
            if self.uri is None or uri.bucket != self.uri.bucket:
                self._transport = None
            self.uri = uri

    def require_uri(self) -> S3Uri:
        if self.uri is None:
            raise InvalidCheckpointIdError(
                "no checkpoint location: pass path='s3://bucket/key' to the writer/reader or checkpoint_id= to dcp"
            )
        return self.uri

    def key(self, name: str) -> str:
        return self.require_uri().join(name)

    @property
    def transport(self) -> S3Transport:
        uri = self.require_uri()
        with self._lock:
            self._check_fork()
            if self._transport is None:
                self._transport = S3Transport(
                    self.client_config.client, uri.bucket, max_attempts=self.client_config.retry_attempts,
                    request_args=self.client_config.request_args,
                )
            return self._transport

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The I/O pool: ``max_concurrency`` threads for part uploads and ranged GETs."""
        with self._lock:
            self._check_fork()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.transfer.max_concurrency, thread_name_prefix="dcp_s3-io")
            return self._executor

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # threads do not survive fork
            self._pid = os.getpid()
            self._executor = None
            self._transport = None

    def close(self) -> None:
        """Stop the worker threads (they are recreated on next use)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


class S3Location:
    """What S3StorageWriter and S3StorageReader share as DCP storage: the checkpoint id."""

    _session: S3Session

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for ``s3://bucket/key...``; anything else is not ours."""
        try:
            parse_s3_uri(checkpoint_id)
        except DcpS3Error:
            return False
        return True

    @property
    def checkpoint_id(self) -> str:
        return str(self._session.require_uri())

    def _reset_location(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id:
            self._session.set_path(checkpoint_id)
