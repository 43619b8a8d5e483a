"""S3's side of :func:`dcp_s3._objstore.compose.compose`: one multipart upload whose parts are UploadPartCopy
ranges of stored objects (copied by the server, never through this process) and ordinary parts for the rest.

Abort is registered the moment the upload is created. A server that answers UploadPartCopy with
``NotImplemented`` (or HTTP 501) makes :func:`compose_by_copy` abort and return False, and the caller streams
the object instead; any other failure aborts and raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError

from dcp_s3._objstore.base import ComposePart, wait_all
from dcp_s3._objstore.buffers import BufferReader
from dcp_s3._objstore.s3_multipart import S3Requests, abort_quietly
from dcp_s3._objstore.s3_requests import is_not_implemented, range_header
from dcp_s3.errors import DcpS3Error

__all__ = ["compose_by_copy"]


class _NoPartCopy(Exception):
    """The server does not implement UploadPartCopy."""


def compose_by_copy(
    store: S3Requests,
    key: str,
    parts: Sequence[ComposePart],
    *,
    executor: ThreadPoolExecutor,
    fill: Callable[[ComposePart, memoryview], None],
    max_buffered: int,
    extra: Mapping[str, str],
) -> bool:
    """Create ``key`` from ``parts`` by one multipart upload (``extra``: UploadPartCopy's source options);
    ``fill`` runs on this thread, at most ``max_buffered`` sent parts held at once. False if the server has
    no UploadPartCopy (nothing is left behind)."""
    upload_id = store.call("create_multipart_upload", key, Key=key)["UploadId"]
    slots = threading.BoundedSemaphore(max(1, max_buffered))
    failed = threading.Event()
    futures: list[Future[dict[str, Any]]] = []

    def copy(number: int, part: ComposePart) -> dict[str, Any]:
        (span,) = part.pieces
        assert not isinstance(span, bytes)
        try:
            resp = store.call(
                "upload_part_copy",
                key,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource={"Bucket": store.bucket, "Key": span.key},
                CopySourceRange=range_header(span.start, span.end),
                **extra,
            )
        except DcpS3Error as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and is_not_implemented(cause):
                raise _NoPartCopy() from exc
            raise
        return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

    def send(number: int, body: memoryview) -> dict[str, Any]:
        try:
            with BufferReader.of([body], send_block=True) as stream:
                resp = store.call(
                    "upload_part",
                    key,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=stream,
                    **store.upload_checksum([body]),
                )
            return {"PartNumber": number, "ETag": resp["ETag"]}
        finally:
            slots.release()

    def note(fut: Future[dict[str, Any]]) -> None:
        if fut.exception() is not None:
            failed.set()

    try:
        for number, part in enumerate(parts, 1):
            if failed.is_set():
                break
            if part.copy:
                fut = executor.submit(copy, number, part)
            else:
                slots.acquire()
                try:
                    body = memoryview(bytearray(part.size))
                    fill(part, body)
                    fut = executor.submit(send, number, body)
                except BaseException:
                    slots.release()
                    raise
            fut.add_done_callback(note)
            futures.append(fut)
        wait_all(futures)
        store.call(
            "complete_multipart_upload",
            key,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [fut.result() for fut in futures]},
        )
    except _NoPartCopy:
        _settle(futures)
        abort_quietly(store, key, upload_id, "multipart upload")
        return False
    except BaseException:
        _settle(futures)
        abort_quietly(store, key, upload_id, "multipart upload")
        raise
    return True


def _settle(futures: Sequence[Future[Any]]) -> None:
    """Cancel the parts not started and wait for the others: none may outlive the abort."""
    for fut in futures:
        fut.cancel()
    for fut in futures:
        if not fut.cancelled():
            fut.exception()
