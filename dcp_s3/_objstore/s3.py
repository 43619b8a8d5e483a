"""The S3 backend of :class:`dcp_s3._objstore.base.ObjectStore`: one bucket through botocore.

Error translation and request options come from :mod:`dcp_s3._objstore.s3_requests`; multipart
uploads (streamed and server-side copies) from :mod:`dcp_s3._objstore.s3_multipart`. What a server
supports (conditional writes, DeleteObjects, ListMultipartUploads) is learnt once per
endpoint and bucket in a process and handled by capability, never by server name.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, IncompleteReadError

from dcp_s3._objstore.base import ComposePart, ObjectInfo, ObjectStore, PendingUpload, RangeRead, check_whole_size
from dcp_s3._objstore.buffers import BufferPool, BufferReader
from dcp_s3._objstore.config import DEFAULT_MAX_WHOLE_READ
from dcp_s3._objstore.deadline import body_deadline
from dcp_s3._objstore.rate_hooks import end_progress, plan_progress, plan_share
from dcp_s3._objstore.s3_compose import compose_by_copy
from dcp_s3._objstore.s3_multipart import MultipartWriter, copy_multipart
from dcp_s3._objstore.s3_reads import read_group
from dcp_s3._objstore.s3_requests import (
    BODY_ERRORS,
    check_request_args,
    is_not_implemented,
    op_label,
    request_args_for,
    status_of,
    translate_error,
    upload_checksum,
)
from dcp_s3._objstore.throttle import JobProgress
from dcp_s3.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    S3TransferError,
    ServerCapabilityError,
)

__all__ = ["S3ObjectStore", "MAX_COPY_SIZE"]

log = logging.getLogger(__name__)

#: Largest object CopyObject copies in one request (S3's limit); larger ones are copied by UploadPartCopy.
MAX_COPY_SIZE = 5 << 30
# What each (endpoint, bucket) was found to support ("conditional_writes", "delete_objects",
# "list_uploads", "upload_part_copy"), learnt once per process; absent = not known yet.
_CAPABILITIES: dict[tuple[str, str, str], bool] = {}
_CAPABILITIES_LOCK = threading.Lock()
# Error codes of servers that lack DeleteObjects as we send it: MinIO's gateway (JuiceFS) wants Content-MD5.
_NO_BATCH_DELETE = {"MissingContentMD5", "NotImplemented"}


class S3ObjectStore(ObjectStore):
    """Objects in one S3 bucket, with error translation and body-level retries."""

    def __init__(
        self,
        client_factory: Callable[[], Any],
        bucket: str,
        *,
        max_attempts: int = 5,
        request_args: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        max_whole_read: int = DEFAULT_MAX_WHOLE_READ,
    ) -> None:
        self._client_factory = client_factory
        self.max_whole_read = max_whole_read
        self.bucket = self.container = bucket
        self.max_attempts = max_attempts
        self.request_args = check_request_args(request_args or {})
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.bucket!r})"

    @property
    def client(self) -> Any:
        return self._client_factory()

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    def describe(self) -> str:
        return f"s3://{self.bucket} at {self.client.meta.endpoint_url}"

    def plan_requests(self, ranks: int, prefixes: int) -> None:
        plan_share(str(self.client.meta.endpoint_url), ranks, prefixes)

    @contextmanager
    def following(self, progress: JobProgress) -> Iterator[None]:
        endpoint = str(self.client.meta.endpoint_url)
        plan_progress(endpoint, progress)
        try:
            yield
        finally:
            end_progress(endpoint, progress)

    def call(self, op: str, key: str | None, **kwargs: Any) -> Any:
        """``client.<op>(Bucket=..., **kwargs)`` plus the request options ``op`` takes."""
        kwargs.update(request_args_for(self.request_args, op))
        try:
            return getattr(self.client, op)(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, op_label(op), self.bucket, key) from exc

    def backoff(self, attempt: int) -> None:
        # Full jitter (AWS architecture blog "Exponential Backoff And Jitter").
        self._sleep(random.uniform(0, min(10.0, 0.1 * 2**attempt)))

    def _paginate(self, op: str, key: str, action: str, field: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator(op)
        try:
            for page in paginator.paginate(Bucket=self.bucket, **kwargs, **request_args_for(self.request_args, op)):
                yield from page.get(field, [])
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, action, self.bucket, key) from exc

    # -- capabilities ---------------------------------------------------------------
    def _capability(self, feature: str) -> bool | None:
        with _CAPABILITIES_LOCK:
            return _CAPABILITIES.get((str(self.client.meta.endpoint_url), self.bucket, feature))

    def _learn(self, feature: str, supported: bool) -> None:
        endpoint = str(self.client.meta.endpoint_url)
        if not supported:
            log.info("s3://%s at %s: no %s", self.bucket, endpoint, feature)
        with _CAPABILITIES_LOCK:
            _CAPABILITIES[(endpoint, self.bucket, feature)] = supported

    def check_container(self) -> None:
        try:
            self.call("head_bucket", None)
        except CheckpointNotFoundError as exc:
            raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist") from exc.__cause__

    # -- small objects -------------------------------------------------------------
    def put(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str:
        """One PUT; returns the new object's ETag.

        ``if_none_match`` sends ``If-None-Match: *``: a server that honours it refuses to replace
        an existing key (``CheckpointExistsError``). Some servers ignore the header and overwrite
        (see ``conditional_writes_supported``); one that answers 501 raises ``ServerCapabilityError``.
        """
        return self.put_views(key, [memoryview(body)], if_none_match=if_none_match)

    def put_views(
        self, key: str, views: Sequence[memoryview], *, if_none_match: bool = False, crc: int | None = None
    ) -> str:
        """``put`` of the bytes of ``views`` one after the other, sent from them (not copied); ``crc``: their
        CRC32C if the caller has it (else computed here)."""
        # Not the bytes themselves: botocore would copy them (see BufferReader).
        with BufferReader.of(views, send_block=True) as stream:
            size = stream.seek(0, os.SEEK_END)
            stream.seek(0)
            return self._put(key, stream if size else b"", if_none_match, self.upload_checksum(views, crc))

    def upload_checksum(self, views: Sequence[memoryview], crc: int | None = None) -> dict[str, str]:
        """The checksum argument of a PUT or UploadPart of ``views`` (``s3_requests.upload_checksum``)."""
        return upload_checksum(self.client.meta.config, views, crc)

    def _put(self, key: str, body: BufferReader | bytes, if_none_match: bool, checksum: dict[str, str]) -> str:
        if not if_none_match:
            return str(self.call("put_object", key, Key=key, Body=body, **checksum).get("ETag", ""))
        try:
            return str(self.call("put_object", key, Key=key, Body=body, IfNoneMatch="*", **checksum).get("ETag", ""))
        except S3TransferError as exc:
            if isinstance(exc.__cause__, ClientError) and is_not_implemented(exc.__cause__):
                raise ServerCapabilityError(
                    f"PUT s3://{self.bucket}/{key}: the server does not implement conditional writes (If-None-Match)"
                ) from exc
            raise

    def conditional_writes_supported(self, probe_key: str) -> bool:
        """Whether this endpoint refuses ``If-None-Match: *`` PUTs over an existing key.

        Tested once per endpoint and bucket in a process (two PUTs and a DELETE of the
        empty object ``probe_key``), then remembered.
        """
        known = self._capability("conditional_writes")
        if known is not None:
            return known
        self.put(probe_key, b"")
        try:
            self.put(probe_key, b"", if_none_match=True)
            supported = False  # the server replaced the object: it ignored the header
        except CheckpointExistsError:
            supported = True
        except ServerCapabilityError:
            supported = False
        finally:
            self.call("delete_object", probe_key, Key=probe_key)
        self._learn("conditional_writes", supported)
        return supported

    def get(self, key: str) -> bytes:
        attempt = 0
        limit = self.max_whole_read
        while True:
            try:
                # A cut error response (e.g. a 404's body) surfaces from the call itself.
                resp = self.call("get_object", key, Key=key)
                body = resp["Body"]
                length = resp.get("ContentLength")
                try:
                    check_whole_size(self.url(key), int(length or 0), limit)
                    with body_deadline("GetObject", self.url(key)):
                        data = bytes(body.read(limit + 1))  # never more than the limit + 1, whatever it claimed
                finally:
                    body.close()
                check_whole_size(self.url(key), len(data), limit)
                if length is not None and len(data) != int(length):
                    raise IncompleteReadError(actual_bytes=len(data), expected_bytes=int(length))
                return data
            except BODY_ERRORS as exc:
                if attempt + 1 >= self.max_attempts:
                    raise translate_error(exc, "GET", self.bucket, key) from exc
                log.debug("GET s3://%s/%s: body failed (%s), retrying", self.bucket, key, exc)
                self.backoff(attempt)
                attempt += 1

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self.call("head_object", key, Key=key)
        except CheckpointNotFoundError as exc:
            if status_of(exc.__cause__) == 404:
                return None
            raise
        modified = resp.get("LastModified")
        return ObjectInfo(
            key, int(resp["ContentLength"]), modified.timestamp() if modified else 0.0, str(resp.get("ETag") or "")
        )

    # -- listing and deleting -----------------------------------------------------------
    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        for obj in self._paginate("list_objects_v2", prefix, "LIST", "Contents", Prefix=prefix):
            yield _info(obj)

    def list_dir(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        """One level under ``prefix``, with ``Delimiter="/"``."""
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(
                Bucket=self.bucket,
                Prefix=prefix,
                Delimiter="/",
                **request_args_for(self.request_args, "list_objects_v2"),
            ):
                objects.extend(_info(o) for o in page.get("Contents", []))
                prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, "LIST", self.bucket, prefix) from exc
        return objects, prefixes

    def delete(self, keys: Sequence[str]) -> None:
        """1,000 keys per DeleteObjects request (the S3 limit).

        On a server that refuses DeleteObjects as botocore sends it (``MissingContentMD5``:
        MinIO's gateway, as in JuiceFS; or ``NotImplemented``), keys are deleted one by one,
        and so on for this endpoint and bucket from then on.
        """
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if self._capability("delete_objects") is False:
                for key in batch:
                    self.call("delete_object", key, Key=key)
                continue
            try:
                resp = self.call(
                    "delete_objects", batch[0], Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except S3TransferError as exc:
                cause = exc.__cause__
                if not isinstance(cause, ClientError) or (
                    cause.response.get("Error", {}).get("Code") not in _NO_BATCH_DELETE and status_of(cause) != 501
                ):
                    raise
                self._learn("delete_objects", False)
                for key in batch:
                    self.call("delete_object", key, Key=key)
                continue
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise S3TransferError(
                    f"DeleteObjects s3://{self.bucket}/{first.get('Key')} failed: {first.get('Code')}: "
                    f"{first.get('Message')} ({len(errors)} of {len(batch)} keys failed)"
                )

    # -- multipart uploads --------------------------------------------------------------
    def list_uploads(self, prefix: str) -> list[PendingUpload]:
        """A server without ListMultipartUploads (s3rver answers ``NotImplemented``) lists none,
        with a warning (once per endpoint and bucket in a process): unfinished uploads there
        are invisible to ``gc`` and retention, which carry on without them.
        """
        if self._capability("list_uploads") is False:
            return []
        uploads: list[PendingUpload] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            args = request_args_for(self.request_args, "list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, **args):
                uploads.extend(
                    PendingUpload(u["Key"], u["UploadId"], u["Initiated"].timestamp()) for u in page.get("Uploads", [])
                )
        except ClientError as exc:
            if not is_not_implemented(exc):
                raise translate_error(exc, "LIST uploads", self.bucket, prefix) from exc
            self._learn("list_uploads", False)
            warnings.warn(
                f"s3://{self.bucket} at {self.client.meta.endpoint_url} does not list multipart uploads: "
                "unfinished uploads cannot be found or aborted there (abort them by other means)",
                RuntimeWarning,
                stacklevel=2,
            )
            return []
        except BotoCoreError as exc:
            raise translate_error(exc, "LIST uploads", self.bucket, prefix) from exc
        return uploads

    def abort_upload(self, upload: PendingUpload) -> None:
        self.call("abort_multipart_upload", upload.key, Key=upload.key, UploadId=upload.upload_id)

    def upload_activity(self, upload: PendingUpload) -> float | None:
        try:
            parts = list(
                self._paginate(
                    "list_parts", upload.key, "LIST parts", "Parts", Key=upload.key, UploadId=upload.upload_id
                )
            )
        except CheckpointNotFoundError:
            return None  # completed or aborted meanwhile
        return max([upload.initiated] + [p["LastModified"].timestamp() for p in parts])

    def open_writer(
        self, key: str, *, pool: BufferPool, executor: ThreadPoolExecutor, expected_size: int | None = None
    ) -> MultipartWriter:
        """Streams ``key`` as a multipart upload (a single PUT if it fits one part)."""
        return MultipartWriter(self, key, pool=pool, executor=executor, expected_size=expected_size)

    def copy(self, key: str, source: ObjectStore, source_key: str, size: int, *, executor: ThreadPoolExecutor) -> None:
        """Server-side: CopyObject, or concurrent UploadPartCopy requests over 5 GiB (``MAX_COPY_SIZE``).

        This store's request options apply (SSE, storage class of the copy); the source's
        ``ExpectedBucketOwner`` is sent as ``ExpectedSourceBucketOwner``.
        """
        if not isinstance(source, S3ObjectStore):
            raise ConfigError(f"COPY {source.url(source_key)} to {self.url(key)}: not an S3 source")
        copy_source = {"Bucket": source.bucket, "Key": source_key}
        extra = {}
        if "ExpectedBucketOwner" in source.request_args:
            extra["ExpectedSourceBucketOwner"] = source.request_args["ExpectedBucketOwner"]
        if "RequestPayer" in source.request_args and "RequestPayer" not in self.request_args:
            extra["RequestPayer"] = source.request_args["RequestPayer"]
        if size <= MAX_COPY_SIZE:
            self.call("copy_object", key, Key=key, CopySource=copy_source, **extra)
        else:
            copy_multipart(self, key, copy_source, size, extra, executor)

    def compose_parts(
        self,
        key: str,
        parts: Sequence[ComposePart],
        *,
        executor: ThreadPoolExecutor,
        fill: Callable[[ComposePart, memoryview], None],
        max_buffered: int,
    ) -> bool:
        """One multipart upload, ``copy`` parts by UploadPartCopy (:mod:`dcp_s3._objstore.s3_compose`); False
        on a server found to lack UploadPartCopy (its ``NotImplemented`` answer, remembered per endpoint and
        bucket in a process)."""
        if self._capability("upload_part_copy") is False:
            return False
        extra = {}
        if "ExpectedBucketOwner" in self.request_args:
            extra["ExpectedSourceBucketOwner"] = self.request_args["ExpectedBucketOwner"]
        done = compose_by_copy(self, key, parts, executor=executor, fill=fill, max_buffered=max_buffered, extra=extra)
        if not done:
            self._learn("upload_part_copy", False)
        return done

    # -- ranged reads --------------------------------------------------------------------
    def _read_group(self, group: list[RangeRead]) -> None:
        read_group(self, group)


def _info(obj: dict[str, Any]) -> ObjectInfo:
    return ObjectInfo(obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp(), str(obj.get("ETag") or ""))
