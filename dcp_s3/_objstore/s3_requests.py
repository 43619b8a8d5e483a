"""S3 requests: error translation, pass-through request options, the HTTP ``Range`` header.

What every S3 request of :mod:`dcp_s3._objstore.s3` and :mod:`dcp_s3._objstore.s3_multipart` shares.
Errors are decided by botocore exception types, S3 error codes and HTTP status, never by
message text.
"""

from __future__ import annotations

import base64
import ssl
from collections.abc import Mapping, Sequence
from http.client import HTTPException
from typing import Any
from urllib.parse import urlsplit

from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    IncompleteReadError,
    NoAuthTokenError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
    SSOError,
    TokenRetrievalError,
    UnknownCredentialError,
)
from crc32c import crc32c
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from dcp_s3._objstore.rate_limits import is_throttle
from dcp_s3.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    S3AccessDeniedError,
    S3ThrottledError,
    S3TransferError,
)

__all__ = [
    "translate_error",
    "untrusted_certificate",
    "check_request_args",
    "range_header",
    "status_of",
    "is_not_implemented",
    "op_label",
    "request_args_for",
    "BODY_ERRORS",
    "upload_checksum",
]

_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "404", "NotFound"}
_DENIED = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AccountProblem",
}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
#: What a server answers to a request header it does not implement (S3's own code for one: NotImplemented).
_REFUSED_HEADER = {"NotImplemented", "InvalidArgument", "InvalidRequest"}
_UPLOADS = {"PutObject", "UploadPart"}
_WRONG_REGION = {"AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException", "301"}
# Errors raised while a response body is being read: botocore does not retry these.
BODY_ERRORS = (
    IncompleteReadError,
    ResponseStreamingError,
    ReadTimeoutError,
    ConnectionClosedError,
    EndpointConnectionError,
    Urllib3HTTPError,
    HTTPException,
    ConnectionError,
    TimeoutError,
)


# botocore's failures to find or refresh credentials: no request was sent, the user must fix their setup.
_CREDENTIAL_ERRORS = (
    NoCredentialsError,
    PartialCredentialsError,
    CredentialRetrievalError,
    UnknownCredentialError,
    NoAuthTokenError,
    TokenRetrievalError,
    SSOError,
)


def untrusted_certificate(exc: BaseException | None) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind a botocore ``SSLError`` (an unknown authority, a name
    that does not match, an expired certificate), or None: a failure no retry can mend."""
    if not isinstance(exc, SSLError):
        return None
    seen: BaseException | None = exc.kwargs.get("error")
    for _ in range(8):  # botocore SSLError -> urllib3 SSLError -> ssl.SSLCertVerificationError
        if seen is None or isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        inner = seen.args[0] if seen.args and isinstance(seen.args[0], BaseException) else None
        seen = inner or seen.__cause__ or seen.__context__
    return None


def _endpoint(url: object) -> str:
    parts = urlsplit(str(url))
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else str(url)


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
            return ConfigError(
                f"{action} {where}: wrong region or endpoint for this bucket ({cause}){hint}; pass region="
            )
        if is_throttle(status, code):
            return _throttled(exc.response, action, where, cause)
        if action in _UPLOADS and code in _REFUSED_HEADER:
            cause += (
                "; a server that refuses the x-amz-checksum-crc32c header dcp_s3 sends with each upload takes "
                "uploads without it under AWS_REQUEST_CHECKSUM_CALCULATION=when_required (loads still check the "
                "CRC32C in .metadata)"
            )
        return S3TransferError(f"{action} {where} failed: {cause}")
    if isinstance(exc, DcpS3Error):
        return exc
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return S3AccessDeniedError(f"{action} {where}: {detail}")
    refused = untrusted_certificate(exc)
    if refused is not None:
        endpoint = _endpoint(exc.kwargs.get("endpoint_url", "the endpoint"))  # type: ignore[attr-defined]
        reason = refused.verify_message or refused.reason or str(refused)
        return ConfigError(
            f"{action} {where}: the TLS certificate of {endpoint} was not trusted ({reason}); give the certificate "
            "authority that signed it as verify='<CA bundle .pem>' (ClientConfig, storage options, dcp-s3 "
            "--ca-bundle) or AWS_CA_BUNDLE"
        )
    if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):  # the detail names the endpoint URL
        return S3TransferError(
            f"{action} {where} failed: no answer in time, after every attempt: {detail} (the wait is bounded by "
            "ClientConfig connect_timeout, read_timeout and retry_attempts)"
        )
    return S3TransferError(f"{action} {where} failed: {type(exc).__name__}: {detail}")


def _throttled(response: Mapping[str, Any], action: str, where: str, cause: str) -> S3ThrottledError:
    paced = response.get("DcpS3Throttle")
    if paced:  # objstore.rate_hooks gave up at its deadline
        return S3ThrottledError(
            f"{action} {where} failed: throttled ({cause}) for {paced['seconds']} s, {paced['refusals']} refusals, "
            f"paced down to {paced['rate']} requests/s for {paced['key']}: past ClientConfig "
            f"throttle_deadline={paced['deadline']} s; raise it, spread keys (key_prefixes=), or ask the provider "
            "for more request capacity on this prefix"
        )
    attempts = response.get("ResponseMetadata", {}).get("RetryAttempts")
    after = f" after {attempts + 1} attempts" if isinstance(attempts, int) else ""
    return S3ThrottledError(
        f"{action} {where} failed: throttled ({cause}){after}; ClientConfig(rate_control=True) paces requests and "
        "retries throttled ones until its throttle_deadline"
    )


def range_header(start: int, end: int) -> str:
    # RFC 9110 byte ranges are inclusive at both ends.
    return f"bytes={start}-{end - 1}"


def op_label(op: str) -> str:
    return "".join(w.capitalize() for w in op.split("_"))


def status_of(exc: BaseException | None) -> int | None:
    if isinstance(exc, ClientError):
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")  # type: ignore[no-any-return]
    return None


def is_not_implemented(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") == "NotImplemented" or status_of(exc) == 501


_OBJECT_OPS = frozenset(
    {
        "put_object",
        "create_multipart_upload",
        "upload_part",
        "complete_multipart_upload",
        "abort_multipart_upload",
        "get_object",
        "head_object",
        "delete_object",
        "delete_objects",
        "list_objects_v2",
        "list_multipart_uploads",
        "list_parts",
        "copy_object",
        "upload_part_copy",
    }
)
_NEW_OBJECT_OPS = frozenset({"put_object", "create_multipart_upload", "copy_object"})
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


def request_args_for(args: Mapping[str, Any], op: str) -> dict[str, Any]:
    """The options of ``args`` that operation ``op`` takes."""
    return {k: v for k, v in args.items() if op in _REQUEST_ARG_OPS[k]}


def upload_checksum(config: Any, views: Sequence[memoryview], crc: int | None = None) -> dict[str, str]:
    """The ``ChecksumCRC32C`` argument of a PUT or UploadPart whose body is ``views``, for the server to check;
    ``crc``: their CRC32C where the caller already has it (a multipart writer's parts), else hashed here.

    Computed here (hardware CRC32C, ~10 GB/s) rather than left to botocore, whose default (CRC32, in
    software with and without ``awscrt``) cost 0.4 s of CPU per GB sent; botocore computes none when
    the request carries one. None where the client (botocore ``config``) asks for checksums only
    when required (``request_checksum_calculation="when_required"``, for servers that refuse them).
    """
    if getattr(config, "request_checksum_calculation", None) == "when_required":
        return {}
    if crc is None:
        crc = 0
        for view in views:
            crc = crc32c(view, crc)
    return {"ChecksumCRC32C": base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")}
