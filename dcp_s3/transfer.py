"""The S3 transfer engine: streaming multipart uploads and concurrent ranged reads.

A narrow transport over botocore: put, multipart (create/part/complete/abort),
ranged get, head, list, delete. It knows nothing of torch or DCP (a test checks
that it does not import torch). Byte ranges are ``[start, end)`` (end exclusive)
everywhere; the inclusive HTTP ``Range`` header is built in ``_range_header`` only.

Memory is bounded by a pool of part buffers shared by every object a writer
streams: a part is filled, handed to the upload pool, and its buffer returns to
the pool when the part is acknowledged. Reads go straight into caller-provided
memory (``RangeRead.open`` returns the destination), so the engine itself holds
no object-sized buffers.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from .errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    S3AccessDeniedError,
    S3TransferError,
    ServerCapabilityError,
)

__all__ = ["S3Transport", "ObjectWriter", "BufferPool", "RangeRead", "coalesce", "fit_part_size", "wait_all"]

log = logging.getLogger("dcp_s3")

MAX_PARTS = 10_000

# What each (endpoint, bucket) was found to support ("conditional_writes", "delete_objects",
# "list_uploads"), learnt once per process; absent = not known yet.
_CAPABILITIES: dict[tuple[str, str, str], bool] = {}
_CAPABILITIES_LOCK = threading.Lock()
# Error codes of servers that lack DeleteObjects as we send it: MinIO's gateway (JuiceFS) wants Content-MD5.
_NO_BATCH_DELETE = {"MissingContentMD5", "NotImplemented"}
MIN_PART_SIZE = 5 << 20

_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "404", "NotFound"}
_DENIED = {
    "AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem",
}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_WRONG_REGION = {"AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException", "301"}
# Errors raised while a response body is being read: botocore does not retry these.
_BODY_ERRORS = (
    IncompleteReadError, ResponseStreamingError, ReadTimeoutError, ConnectionClosedError,
    EndpointConnectionError, Urllib3HTTPError, HTTPException, ConnectionError, TimeoutError,
)


def translate_error(exc: BaseException, action: str, bucket: str, key: str | None = None) -> DcpS3Error:
    """Map a botocore failure to a picklable dcp_s3 error naming bucket/key and cause."""
    where = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        cause = f"{code or status}: {err.get('Message') or 'no message'}"
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{action} {where}: bucket {bucket!r} does not exist ({cause})")
        if code in _NOT_FOUND or status == 404:
            return CheckpointNotFoundError(f"{action} {where}: not found ({cause})")
        if code in _DENIED or status == 403:
            return S3AccessDeniedError(f"{action} {where}: access denied ({cause})")
        if code in _EXISTS or status == 412:
            return CheckpointExistsError(f"{action} {where}: already exists ({cause})")
        if code in _WRONG_REGION or status == 301:
            headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            hint = f"; the bucket is in {headers['x-amz-bucket-region']!r}" if "x-amz-bucket-region" in headers else ""
            return ConfigError(f"{action} {where}: wrong region or endpoint for this bucket ({cause}){hint}; pass region=")
        return S3TransferError(f"{action} {where} failed: {cause}")
    if isinstance(exc, DcpS3Error):
        return exc
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, BotoCoreError) and "credentials" in detail.lower():
        return S3AccessDeniedError(f"{action} {where}: {detail}")
    if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):  # the detail names the endpoint URL
        return S3TransferError(
            f"{action} {where} failed: no answer in time, after every attempt: {detail} (the wait is bounded by "
            "ClientConfig connect_timeout, read_timeout and retry_attempts)"
        )
    return S3TransferError(f"{action} {where} failed: {type(exc).__name__}: {detail}")


def _range_header(start: int, end: int) -> str:
    # RFC 9110 byte ranges are inclusive at both ends.
    return f"bytes={start}-{end - 1}"


def _op_label(op: str) -> str:
    return "".join(w.capitalize() for w in op.split("_"))


def _status(exc: BaseException | None) -> int | None:
    if isinstance(exc, ClientError):
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")  # type: ignore[no-any-return]
    return None


def _is_not_implemented(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") == "NotImplemented" or _status(exc) == 501


_OBJECT_OPS = frozenset(
    {"put_object", "create_multipart_upload", "upload_part", "complete_multipart_upload", "abort_multipart_upload",
     "get_object", "head_object", "delete_object", "delete_objects", "list_objects_v2", "list_multipart_uploads",
     "list_parts", "copy_object", "upload_part_copy"}
)
_NEW_OBJECT_OPS = frozenset({"put_object", "create_multipart_upload", "copy_object"})
#: Largest object CopyObject copies in one request (S3's limit); larger ones are copied by UploadPartCopy.
MAX_COPY_SIZE = 5 << 30
#: Bytes per UploadPartCopy part (enlarged when an object would exceed 10,000 parts).
COPY_PART_SIZE = 512 << 20
#: Request options passed through to S3, and the operations that take each.
_REQUEST_ARG_OPS: dict[str, frozenset[str]] = {
    "ServerSideEncryption": _NEW_OBJECT_OPS,
    "SSEKMSKeyId": _NEW_OBJECT_OPS,
    "SSEKMSEncryptionContext": _NEW_OBJECT_OPS,
    "BucketKeyEnabled": _NEW_OBJECT_OPS,
    "StorageClass": _NEW_OBJECT_OPS,
    "ExpectedBucketOwner": _OBJECT_OPS | {"head_bucket"},
    "RequestPayer": _OBJECT_OPS,
}


def check_request_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Validate pass-through request options (SSE, storage class, bucket owner, payer)."""
    unknown = sorted(set(args) - set(_REQUEST_ARG_OPS))
    if unknown:
        raise ConfigError(f"unsupported request_args {unknown}; supported: {sorted(_REQUEST_ARG_OPS)}")
    return dict(args)


def fit_part_size(part_size: int, expected_size: int | None) -> int:
    """The part size to use so an object of ``expected_size`` bytes needs at most 10,000 parts."""
    size = max(part_size, MIN_PART_SIZE)
    if expected_size is not None:
        while -(-expected_size // size) > MAX_PARTS:
            size *= 2
    return size


class BufferPool:
    """A fixed number of reusable part buffers; ``acquire`` blocks while all are in use.

    This is the memory bound of uploads: bytes in flight never exceed
    ``count * size``. Buffers are allocated on first use and dropped by ``clear``.
    """

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: list[bytearray] = []
        self._available = threading.Semaphore(count)
        self._lock = threading.Lock()

    def acquire(self, size: int | None = None) -> bytearray:
        need = size or self.size
        self._available.acquire()
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) >= need:
                    return buf
        return bytearray(need)

    def release(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
        self._available.release()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Read object bytes ``[start, end)`` (end exclusive) into memory the caller provides.

    ``open()`` is called in the worker thread right before the bytes arrive and returns a
    writable buffer of exactly ``end - start`` bytes; ``done()`` runs after it is filled.
    """

    key: str
    start: int
    end: int
    open: Callable[[], memoryview]
    done: Callable[[], None] | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


def coalesce(reads: Iterable[RangeRead], max_gap: int, max_size: int) -> list[list[RangeRead]]:
    """Group reads of one object into ranged GETs: sorted, merged across gaps ``<= max_gap``.

    A group spans at most ``max_size`` bytes unless a single read is larger on its own.
    """
    groups: list[list[RangeRead]] = []
    current: list[RangeRead] = []
    for read in sorted(reads, key=lambda r: (r.key, r.start)):
        if current:
            first, last = current[0], current[-1]
            if (
                read.key == first.key
                and read.start >= last.end
                and read.start - last.end <= max_gap
                and read.end - first.start <= max_size
            ):
                current.append(read)
                continue
            groups.append(current)
        current = [read]
    if current:
        groups.append(current)
    return groups


class S3Transport:
    """S3 operations on one bucket with error translation and body-level retries."""

    def __init__(
        self,
        client_factory: Callable[[], Any],
        bucket: str,
        *,
        max_attempts: int = 5,
        request_args: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client_factory = client_factory
        self.bucket = bucket
        self.max_attempts = max_attempts
        self.request_args = check_request_args(request_args or {})
        self._sleep = sleep

    @property
    def client(self) -> Any:
        return self._client_factory()

    def _call(self, op: str, key: str | None, **kwargs: Any) -> Any:
        """``client.<op>(Bucket=..., **kwargs)`` plus the request options ``op`` takes."""
        kwargs.update(self._args_for(op))
        try:
            return getattr(self.client, op)(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, _op_label(op), self.bucket, key) from exc

    def _args_for(self, op: str) -> dict[str, Any]:
        return {k: v for k, v in self.request_args.items() if op in _REQUEST_ARG_OPS[k]}

    def _backoff(self, attempt: int) -> None:
        # Full jitter (AWS architecture blog "Exponential Backoff And Jitter").
        self._sleep(random.uniform(0, min(10.0, 0.1 * 2**attempt)))

    # -- small objects -------------------------------------------------------------
    def put_object(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str:
        """One PUT; returns the new object's ETag.

        ``if_none_match`` sends ``If-None-Match: *``: a server that honours it refuses to replace
        an existing key (``CheckpointExistsError``). Some servers ignore the header and overwrite
        (see ``conditional_writes_supported``); one that answers 501 raises ``ServerCapabilityError``.
        """
        if not if_none_match:
            return str(self._call("put_object", key, Key=key, Body=body).get("ETag", ""))
        try:
            return str(self._call("put_object", key, Key=key, Body=body, IfNoneMatch="*").get("ETag", ""))
        except S3TransferError as exc:
            if isinstance(exc.__cause__, ClientError) and _is_not_implemented(exc.__cause__):
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
        self.put_object(probe_key, b"")
        try:
            self.put_object(probe_key, b"", if_none_match=True)
            supported = False  # the server replaced the object: it ignored the header
        except CheckpointExistsError:
            supported = True
        except ServerCapabilityError:
            supported = False
        finally:
            self.delete_object(probe_key)
        self._learn("conditional_writes", supported)
        return supported

    def _capability(self, feature: str) -> bool | None:
        with _CAPABILITIES_LOCK:
            return _CAPABILITIES.get((str(self.client.meta.endpoint_url), self.bucket, feature))

    def _learn(self, feature: str, supported: bool) -> None:
        endpoint = str(self.client.meta.endpoint_url)
        if not supported:
            log.info("s3://%s at %s: no %s", self.bucket, endpoint, feature)
        with _CAPABILITIES_LOCK:
            _CAPABILITIES[(endpoint, self.bucket, feature)] = supported

    def get_object(self, key: str) -> bytes:
        """The whole object (for small objects such as ``.metadata``)."""
        for attempt in range(self.max_attempts):
            try:
                # A cut error response (e.g. a 404's body) surfaces from the call itself.
                return bytes(self._call("get_object", key, Key=key)["Body"].read())
            except _BODY_ERRORS as exc:
                if attempt + 1 == self.max_attempts:
                    raise translate_error(exc, "GET", self.bucket, key) from exc
                log.debug("GET s3://%s/%s: body failed (%s), retrying", self.bucket, key, exc)
                self._backoff(attempt)
        raise AssertionError("unreachable")

    def head_object(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD response, or None if it does not exist."""
        try:
            return self._call("head_object", key, Key=key)  # type: ignore[no-any-return]
        except CheckpointNotFoundError as exc:
            if _status(exc.__cause__) == 404:
                return None
            raise

    def check_bucket(self) -> None:
        """Fail with a clear error if the bucket is missing or not accessible."""
        try:
            self._call("head_bucket", None)
        except CheckpointNotFoundError as exc:
            raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist") from exc.__cause__

    def delete_object(self, key: str) -> None:
        self._call("delete_object", key, Key=key)

    def delete_objects(self, keys: Sequence[str]) -> None:
        """Delete many keys, 1,000 per request (the S3 limit); keys already gone are fine.

        On a server that refuses DeleteObjects as botocore sends it (``MissingContentMD5``:
        MinIO's gateway, as in JuiceFS; or ``NotImplemented``), keys are deleted one by one,
        and so on for this endpoint and bucket from then on.
        """
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if self._capability("delete_objects") is False:
                for key in batch:
                    self.delete_object(key)
                continue
            try:
                resp = self._call(
                    "delete_objects", batch[0], Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except S3TransferError as exc:
                cause = exc.__cause__
                if not isinstance(cause, ClientError) or (
                    cause.response.get("Error", {}).get("Code") not in _NO_BATCH_DELETE and _status(cause) != 501
                ):
                    raise
                self._learn("delete_objects", False)
                for key in batch:
                    self.delete_object(key)
                continue
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise S3TransferError(
                    f"DeleteObjects s3://{self.bucket}/{first.get('Key')} failed: {first.get('Code')}: "
                    f"{first.get('Message')} ({len(errors)} of {len(batch)} keys failed)"
                )

    def list_objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every object under ``prefix`` (``Key``, ``Size``, ``LastModified``...)."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, **self._args_for("list_objects_v2")):
                yield from page.get("Contents", [])
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, "LIST", self.bucket, prefix) from exc

    def list_dir(self, prefix: str) -> tuple[list[dict[str, Any]], list[str]]:
        """One level under ``prefix`` (which ends in ``/`` or is empty): (objects directly in it,
        the common prefixes ``prefix<name>/`` of the "directories" below it), with ``Delimiter="/"``."""
        objects: list[dict[str, Any]] = []
        prefixes: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/", **self._args_for("list_objects_v2")
            ):
                objects.extend(page.get("Contents", []))
                prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, "LIST", self.bucket, prefix) from exc
        return objects, prefixes

    def list_parts(self, key: str, upload_id: str) -> list[dict[str, Any]]:
        """The parts uploaded so far to a multipart upload (``PartNumber``, ``LastModified``...)."""
        parts: list[dict[str, Any]] = []
        paginator = self.client.get_paginator("list_parts")
        try:
            args = self._args_for("list_parts")
            for page in paginator.paginate(Bucket=self.bucket, Key=key, UploadId=upload_id, **args):
                parts.extend(page.get("Parts", []))
        except (ClientError, BotoCoreError) as exc:
            raise translate_error(exc, "LIST parts", self.bucket, key) from exc
        return parts

    # -- server-side copy --------------------------------------------------------------------
    def copy_object(
        self, key: str, source: S3Transport, source_key: str, size: int, *, executor: ThreadPoolExecutor
    ) -> None:
        """Copy ``source_key`` of ``source``'s bucket to ``key`` on the server (no bytes pass through here).

        This transport's request options apply (SSE, storage class of the copy); the source's
        ``ExpectedBucketOwner`` is sent as ``ExpectedSourceBucketOwner``. Objects over 5 GiB
        (``MAX_COPY_SIZE``) are copied as a multipart upload of concurrent UploadPartCopy requests.
        """
        copy_source = {"Bucket": source.bucket, "Key": source_key}
        extra = {}
        if "ExpectedBucketOwner" in source.request_args:
            extra["ExpectedSourceBucketOwner"] = source.request_args["ExpectedBucketOwner"]
        if "RequestPayer" in source.request_args and "RequestPayer" not in self.request_args:
            extra["RequestPayer"] = source.request_args["RequestPayer"]
        if size <= MAX_COPY_SIZE:
            self._call("copy_object", key, Key=key, CopySource=copy_source, **extra)
            return
        part_size = fit_part_size(COPY_PART_SIZE, size)
        upload_id = self._call("create_multipart_upload", key, Key=key)["UploadId"]
        try:
            def copy_part(number: int, start: int) -> dict[str, Any]:
                end = min(size, start + part_size)
                resp = self._call(
                    "upload_part_copy", key, Key=key, UploadId=upload_id, PartNumber=number,
                    CopySource=copy_source, CopySourceRange=_range_header(start, end), **extra,
                )
                return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

            futures = [
                executor.submit(copy_part, i + 1, start) for i, start in enumerate(range(0, size, part_size))
            ]
            wait_all(futures)
            parts = [fut.result() for fut in futures]
            self._call(
                "complete_multipart_upload", key, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                self.abort_multipart_upload(key, upload_id)
            except DcpS3Error as exc:
                log.warning("could not abort multipart copy to s3://%s/%s: %s", self.bucket, key, exc)
            raise

    def list_multipart_uploads(self, prefix: str) -> list[dict[str, Any]]:
        """Multipart uploads started under ``prefix`` and neither completed nor aborted.

        A server without ListMultipartUploads (s3rver answers ``NotImplemented``) lists none,
        with a warning (once per endpoint and bucket in a process): unfinished uploads there
        are invisible to ``gc`` and retention, which carry on without them.
        """
        if self._capability("list_uploads") is False:
            return []
        uploads: list[dict[str, Any]] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            args = self._args_for("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, **args):
                uploads.extend(page.get("Uploads", []))
        except ClientError as exc:
            if not _is_not_implemented(exc):
                raise translate_error(exc, "LIST uploads", self.bucket, prefix) from exc
            self._learn("list_uploads", False)
            warnings.warn(
                f"s3://{self.bucket} at {self.client.meta.endpoint_url} does not list multipart uploads: "
                "unfinished uploads cannot be found or aborted there (abort them by other means)",
                RuntimeWarning, stacklevel=2,
            )
            return []
        except BotoCoreError as exc:
            raise translate_error(exc, "LIST uploads", self.bucket, prefix) from exc
        return uploads

    def abort_multipart_upload(self, key: str, upload_id: str) -> None:
        self._call("abort_multipart_upload", key, Key=key, UploadId=upload_id)

    # -- streaming upload ------------------------------------------------------------
    def open_writer(
        self, key: str, *, pool: BufferPool, executor: ThreadPoolExecutor, expected_size: int | None = None
    ) -> ObjectWriter:
        """A file-like writer that streams ``key`` as a multipart upload (single PUT if small)."""
        return ObjectWriter(self, key, pool=pool, executor=executor, expected_size=expected_size)

    # -- ranged reads --------------------------------------------------------------------
    def read_ranges(
        self, reads: Sequence[RangeRead], *, executor: ThreadPoolExecutor, max_gap: int, max_size: int
    ) -> None:
        """Fill every read, coalescing neighbours into ranged GETs run concurrently.

        Raises the first failure after the other requests have settled.
        """
        groups = coalesce(reads, max_gap, max_size)
        futures = [executor.submit(self._read_group, group) for group in groups]
        wait_all(futures)

    def _read_group(self, group: list[RangeRead]) -> None:
        key = group[0].key
        start, end = group[0].start, group[-1].end
        pos = start  # next object byte to receive
        index = 0  # read in ``group`` that holds ``pos`` (or the gap before it)
        dest: memoryview | None = None
        scratch = bytearray(min(1 << 20, max(1, end - start)))
        attempt = 0
        while pos < end:
            try:
                try:
                    resp = self._call("get_object", key, Key=key, Range=_range_header(pos, end))
                except S3TransferError as exc:
                    if _status(exc.__cause__) != 416:  # Range Not Satisfiable: starts past the end
                        raise
                    length = 0
                else:
                    length = int(resp.get("ContentLength", -1))
                if length != end - pos:  # checked before any destination is opened (allocated)
                    raise CheckpointFormatError(
                        f"GET s3://{self.bucket}/{key} bytes {pos}-{end}: server sent {length} bytes, "
                        f"expected {end - pos} (object shorter than the checkpoint metadata says?)"
                    )
                readinto = _body_readinto(resp["Body"])
                while pos < end:
                    read = group[index]
                    if pos < read.start:  # a gap between coalesced reads: discard
                        n = _readinto_some(readinto, memoryview(scratch)[: min(len(scratch), read.start - pos)])
                        pos += n
                        continue
                    if dest is None:
                        dest = read.open()
                        if len(dest) != read.size:
                            raise ValueError(f"destination of {key}[{read.start}:{read.end}] has {len(dest)} bytes")
                    pos += _readinto_some(readinto, dest[pos - read.start :])
                    if pos == read.end:
                        if read.done is not None:
                            read.done()
                        dest = None
                        index += 1
                resp["Body"].close()
            except _BODY_ERRORS as exc:
                attempt += 1
                if attempt >= self.max_attempts:
                    raise translate_error(exc, "GET", self.bucket, key) from exc
                log.debug("GET s3://%s/%s from byte %d failed (%s); retrying", self.bucket, key, pos, exc)
                self._backoff(attempt)


def _body_readinto(body: Any) -> Callable[[memoryview], int]:
    """A ``readinto`` for a botocore streaming body, copying as little as possible."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)  # http.client.HTTPResponse under urllib3
    if fp is not None and hasattr(fp, "readinto") and not getattr(raw, "headers", {}).get("content-encoding"):
        return fp.readinto  # type: ignore[no-any-return]

    def readinto(buf: memoryview) -> int:
        data = body.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    return readinto


def _readinto_some(readinto: Callable[[memoryview], int], buf: memoryview) -> int:
    """Receive up to ``len(buf)`` bytes; the caller advances by what arrived, so a body
    cut short is resumed from the last byte received."""
    n = readinto(buf)
    if not n:
        raise IncompleteReadError(actual_bytes=0, expected_bytes=len(buf))
    return n


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for every future; raise the first exception (others are logged at debug)."""
    first: BaseException | None = None
    for fut in futures:
        exc = fut.exception()
        if exc is not None:
            if first is None:
                first = exc
            else:
                log.debug("further failure: %s", exc)
    if first is not None:
        raise first


class ObjectWriter:
    """A write-only stream that uploads one object in parts as they fill.

    Small objects go up in one PUT on ``close``; larger ones as a multipart upload whose
    parts upload concurrently on ``executor``. On any failure (or ``abort()``) the
    multipart upload is aborted, so no orphan parts are left behind.
    """

    def __init__(
        self,
        transport: S3Transport,
        key: str,
        *,
        pool: BufferPool,
        executor: ThreadPoolExecutor,
        expected_size: int | None = None,
    ) -> None:
        self.transport = transport
        self.key = key
        self._pool = pool
        self._executor = executor
        self.part_size = fit_part_size(pool.size, expected_size)
        self._buf: bytearray | None = None
        self._fill = 0
        self._position = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._closed = False

    def tell(self) -> int:
        return self._position

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError(f"write to closed writer of s3://{self.transport.bucket}/{self.key}")
        view = memoryview(data).cast("B")
        total = len(view)
        try:
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
        except BaseException:
            self.abort()
            raise
        self._position += total
        return total

    def _submit_part(self) -> None:
        if self._upload_id is None:
            resp = self.transport._call("create_multipart_upload", self.key, Key=self.key)
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
            # botocore takes bytes/bytearray, not memoryview: only a short last part is copied.
            body = buf if fill == len(buf) else bytes(memoryview(buf)[:fill])
            resp = self.transport._call(
                "upload_part", self.key, Key=self.key, UploadId=self._upload_id, PartNumber=part_number, Body=body
            )
            return {"PartNumber": part_number, "ETag": resp["ETag"]}
        finally:
            self._pool.release(buf)

    def close(self) -> int:
        """Finish the object; returns its size in bytes."""
        if self._closed:
            return self._position
        try:
            if self._upload_id is None:
                body = bytes(memoryview(self._buf)[: self._fill]) if self._buf is not None else b""
                self.transport.put_object(self.key, body)
                if self._buf is not None:
                    self._pool.release(self._buf)
                    self._buf = None
            else:
                if self._fill or not self._parts:
                    self._submit_part()
                wait_all(self._parts)
                parts = [fut.result() for fut in self._parts]
                self.transport._call(
                    "complete_multipart_upload", self.key,
                    Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts},
                )
                self._upload_id = None
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self._position

    def abort(self) -> None:
        """Drop the object: cancel queued parts and abort the multipart upload."""
        self._closed = True
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
            try:
                self.transport.abort_multipart_upload(self.key, upload_id)
                log.debug("aborted multipart upload of s3://%s/%s", self.transport.bucket, self.key)
            except DcpS3Error as exc:  # its parts stay stored (and billed) until someone aborts it
                warnings.warn(
                    f"could not abort the multipart upload of s3://{self.transport.bucket}/{self.key} ({exc}); "
                    "its parts stay on the server until aborted (`dcp-s3 gc`, or the server's own tools)",
                    RuntimeWarning, stacklevel=2,
                )
