"""S3 multipart uploads: the streaming :class:`MultipartWriter` and server-side copies by part.

Abort is registered the moment an upload is created: any failure (or ``abort()``) aborts it,
so no orphan parts are left behind where the server lets us.
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from dcp_s3.errors import DcpS3Error
from dcp_s3.objstore.base import ObjectWriter, PendingUpload, wait_all
from dcp_s3.objstore.buffers import BufferPool, BufferReader, fit_part_size
from dcp_s3.objstore.s3_requests import range_header

__all__ = ["MultipartWriter", "copy_multipart", "COPY_PART_SIZE"]

log = logging.getLogger("dcp_s3")

#: Bytes per UploadPartCopy part (enlarged when an object would exceed 10,000 parts).
COPY_PART_SIZE = 512 << 20


class S3Requests(Protocol):
    """What multipart uploads need of the S3 object store (``dcp_s3.objstore.s3.S3ObjectStore``)."""

    bucket: str

    def call(self, op: str, key: str | None, **kwargs: Any) -> Any: ...

    def put(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str: ...

    def abort_upload(self, upload: PendingUpload) -> None: ...


def _abort(store: S3Requests, key: str, upload_id: str, what: str) -> None:
    try:
        store.abort_upload(PendingUpload(key, upload_id, 0.0))
        log.debug("aborted %s of s3://%s/%s", what, store.bucket, key)
    except DcpS3Error as exc:  # its parts stay stored (and billed) until someone aborts it
        warnings.warn(
            f"could not abort the {what} of s3://{store.bucket}/{key} ({exc}); its parts stay on the "
            "server until aborted (`dcp-s3 gc`, or the server's own tools)",
            RuntimeWarning, stacklevel=3,
        )


def copy_multipart(
    store: S3Requests, key: str, copy_source: dict[str, str], size: int, extra: dict[str, str],
    executor: ThreadPoolExecutor,
) -> None:
    """Copy ``copy_source`` (``size`` bytes) to ``key`` by concurrent UploadPartCopy requests."""
    part_size = fit_part_size(COPY_PART_SIZE, size)
    upload_id = store.call("create_multipart_upload", key, Key=key)["UploadId"]
    try:
        def copy_part(number: int, start: int) -> dict[str, Any]:
            end = min(size, start + part_size)
            resp = store.call(
                "upload_part_copy", key, Key=key, UploadId=upload_id, PartNumber=number,
                CopySource=copy_source, CopySourceRange=range_header(start, end), **extra,
            )
            return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

        futures = [executor.submit(copy_part, i + 1, start) for i, start in enumerate(range(0, size, part_size))]
        wait_all(futures)
        parts = [fut.result() for fut in futures]
        store.call("complete_multipart_upload", key, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
    except BaseException:
        _abort(store, key, upload_id, "multipart copy")
        raise


class MultipartWriter(ObjectWriter):
    """Uploads one object in parts as they fill.

    Small objects go up in one PUT on ``close``; larger ones as a multipart upload whose
    parts upload concurrently on ``executor``, their buffers taken from ``pool``.
    """

    def __init__(
        self,
        store: S3Requests,
        key: str,
        *,
        pool: BufferPool,
        executor: ThreadPoolExecutor,
        expected_size: int | None = None,
    ) -> None:
        super().__init__(key, fit_part_size(pool.size, expected_size), f"s3://{store.bucket}/{key}")
        self.store = store
        self._pool = pool
        self._executor = executor
        self._buf: bytearray | None = None
        self._fill = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []

    def _write(self, view: memoryview) -> None:
        while view:
            if self._buf is None:
                self._buf = self._pool.acquire(self.part_size)
                self._fill = 0
            n = min(len(view), self.part_size - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == self.part_size:
                self._submit_part()

    def _submit_part(self) -> None:
        if self._upload_id is None:
            resp = self.store.call("create_multipart_upload", self.key, Key=self.key)
            self._upload_id = resp["UploadId"]
        # Fail fast if an earlier part already failed.
        for fut in self._parts:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        buf, fill = self._buf, self._fill
        assert buf is not None
        self._buf, self._fill = None, 0
        part_number = len(self._parts) + 1
        self._parts.append(self._executor.submit(self._upload_part, part_number, buf, fill))

    def _upload_part(self, part_number: int, buf: bytearray, fill: int) -> dict[str, Any]:
        try:
            # A file over the buffer, not the buffer: botocore copies bytes-like bodies (see BufferReader).
            with BufferReader(buf, fill) as body:
                resp = self.store.call(
                    "upload_part", self.key, Key=self.key, UploadId=self._upload_id, PartNumber=part_number, Body=body
                )
            return {"PartNumber": part_number, "ETag": resp["ETag"]}
        finally:
            self._pool.release(buf)

    def _finish(self) -> None:
        if self._upload_id is None:
            body = bytes(memoryview(self._buf)[: self._fill]) if self._buf is not None else b""
            self.store.put(self.key, body)
            if self._buf is not None:
                self._pool.release(self._buf)
                self._buf = None
            return
        if self._fill or not self._parts:
            self._submit_part()
        wait_all(self._parts)
        parts = [fut.result() for fut in self._parts]
        self.store.call(
            "complete_multipart_upload", self.key,
            Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts},
        )
        self._upload_id = None

    def _abort(self) -> None:
        """Cancel queued parts and abort the multipart upload."""
        for fut in self._parts:
            fut.cancel()
        for fut in self._parts:
            if not fut.cancelled():
                fut.exception()  # wait: a part still uploading would outlive the abort
        if self._buf is not None:
            self._pool.release(self._buf)
            self._buf = None
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            _abort(self.store, self.key, upload_id, "multipart upload")
