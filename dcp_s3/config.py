"""Checkpoint URIs, credentials and S3 client settings.

Nothing here knows about DCP. ``ClientConfig`` is a frozen, picklable value:
it holds where credentials come from (a file path, a profile, the standard
boto3 chain), never the secrets themselves, so a writer pickled into an
``async_save`` child re-reads them there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, InvalidCheckpointIdError

__all__ = ["S3Uri", "ClientConfig", "TransferConfig", "parse_s3_uri"]

log = logging.getLogger("dcp_s3")

MiB = 1 << 20

#: Keys a credential file may hold: boto3 client keyword arguments.
CREDENTIAL_FILE_KEYS = frozenset(
    {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "endpoint_url", "region_name"}
)


@dataclass(frozen=True, slots=True)
class S3Uri:
    """A parsed ``s3://bucket/key`` location; ``key`` has no leading or trailing slash."""

    bucket: str
    key: str

    def join(self, name: str) -> str:
        """The object key of ``name`` under this prefix."""
        return f"{self.key}/{name}" if self.key else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3_uri(uri: str | os.PathLike[str], *, require_key: bool = True) -> S3Uri:
    """Parse ``s3://bucket/key...``; reject other schemes, local paths and a missing key."""
    if not isinstance(uri, str):
        raise InvalidCheckpointIdError(
            f"checkpoint id {os.fspath(uri)!r} is a local path; dcp_s3 needs an s3://bucket/key URI"
        )
    if not uri.startswith("s3://"):
        scheme = uri.split("://", 1)[0] + "://" if "://" in uri else None
        what = f"has scheme {scheme!r}" if scheme else "is not a URI"
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r} {what}; expected s3://bucket/key")
    bucket, _, key = uri[len("s3://"):].partition("/")
    key = key.strip("/")
    if not bucket:
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r} names no bucket; expected s3://bucket/key")
    if not (3 <= len(bucket) <= 63) or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789.-_" for c in bucket):
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r}: {bucket!r} is not a valid bucket name")
    if require_key and not key:
        raise InvalidCheckpointIdError(
            f"checkpoint id {uri!r} names a bucket but no key prefix; expected s3://{bucket}/some/prefix"
        )
    if any(part in (".", "..") for part in key.split("/")):
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r} contains '.' or '..' path segments")
    return S3Uri(bucket, key)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Sizes and concurrency of the transfer engine.

    Peak extra memory of a save is about ``part_size * (max_concurrency + files_per_rank)``.
    """

    #: Bytes per multipart part (5 MiB..5 GiB); enlarged when an object would exceed 10,000 parts.
    part_size: int = 16 * MiB
    #: Parallel part uploads / ranged GETs per process.
    max_concurrency: int = 8
    #: Data objects each rank writes (each streamed by its own thread).
    files_per_rank: int = 1
    #: Largest ranged GET; bigger reads are split and fetched concurrently.
    max_range_size: int = 16 * MiB
    #: Neighbouring reads closer than this are merged into one ranged GET.
    coalesce_gap: int = 1 * MiB
    #: Attempts per request, first try included: botocore's retries (standard mode, jittered
    #: backoff) and the resumption of response bodies cut short.
    max_attempts: int = 5

    def override(self, **changes: int | None) -> TransferConfig:
        """A copy with the given fields replaced; ``None`` values are ignored."""
        given: dict[str, int] = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def __post_init__(self) -> None:
        if not 5 * MiB <= self.part_size <= 5 * 1024 * MiB:
            raise ConfigError(f"part_size={self.part_size} must be between 5 MiB and 5 GiB (S3 limits)")
        for name in ("max_concurrency", "files_per_rank", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_range_size < 64 * 1024:
            raise ConfigError(f"max_range_size={self.max_range_size} must be >= 64 KiB")
        if self.coalesce_gap < 0:
            raise ConfigError(f"coalesce_gap={self.coalesce_gap} must be >= 0")


@dataclass(frozen=True)
class ClientConfig:
    """How to build the boto3 S3 client: credential source, endpoint, timeouts, retries.

    Explicit ``endpoint_url``/``region`` win over a credential file's values, which
    win over the standard boto3 chain (``AWS_*`` environment variables incl.
    ``AWS_ENDPOINT_URL``, profiles, instance roles).
    """

    credential_path: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    #: botocore retry attempts (first try included) and mode ("standard" or "adaptive").
    retry_attempts: int = 5
    retry_mode: str = "standard"
    max_pool_connections: int = 10
    #: Options added to every request that takes them: ``ServerSideEncryption``, ``SSEKMSKeyId``,
    #: ``SSEKMSEncryptionContext``, ``BucketKeyEnabled``, ``StorageClass``, ``ExpectedBucketOwner``,
    #: ``RequestPayer``.
    request_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.retry_mode not in ("standard", "adaptive"):
            raise ConfigError(f"retry_mode={self.retry_mode!r}; expected 'standard' or 'adaptive'")
        if self.retry_attempts < 1:
            raise ConfigError(f"retry_attempts={self.retry_attempts} must be >= 1")
        if self.credential_path is not None and not os.path.isfile(self.credential_path):
            raise ConfigError(f"credential file {self.credential_path!r} does not exist")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``boto3.session.Session.client('s3', ...)`` (may hold secrets: never log)."""
        kwargs: dict[str, Any] = {}
        if self.credential_path is not None:
            kwargs.update(_read_credential_file(self.credential_path))
        if self.endpoint_url is not None:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.region is not None:
            kwargs["region_name"] = self.region
        return kwargs

    def make_client(self) -> Any:
        """A new boto3 S3 client. boto3 clients are thread-safe; sessions are not."""
        import boto3
        from botocore.config import Config

        kwargs = self.client_kwargs()
        custom_endpoint = kwargs.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL"
        )
        config = Config(
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"max_attempts": self.retry_attempts, "mode": self.retry_mode},
            max_pool_connections=self.max_pool_connections,
            tcp_keepalive=True,
            s3={
                # MinIO, SeaweedFS, Ceph and most S3-compatible stores want path-style URLs.
                "addressing_style": "path" if custom_endpoint else "auto",
                # Integrity comes from the x-amz-checksum-* headers botocore adds to uploads;
                # SHA-256 signing every body as well (botocore's default over plain HTTP)
                # costs a third of the upload throughput.
                "payload_signing_enabled": False,
            },
        )
        session = boto3.session.Session(profile_name=self.profile)
        client = session.client("s3", config=config, **kwargs)
        client.meta.events.register("needs-retry.s3", _log_failed_attempt)
        return client

    def client(self) -> Any:
        """A client for these settings, shared by every thread and every ``ClientConfig`` equal to this one
        in this process (a new boto3 session costs 0.3-0.5 s); a forked child makes its own."""
        return _CLIENTS.get(self)

    def _identity(self) -> tuple[Any, ...]:
        """What the client depends on: these settings, the ``AWS_*`` environment (credentials, endpoint,
        profile: hashed, never kept) and a credential file's identity and modification time, so that
        changed credentials get a new client."""
        fields = tuple(getattr(self, k) for k in self.__dataclass_fields__ if k != "request_args")
        env = hashlib.sha256(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))).encode())
        file: tuple[int, ...] = ()
        if self.credential_path is not None:
            try:
                st = os.stat(self.credential_path)
                file = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                pass
        return (*fields, env.hexdigest(), file)


class _ClientPool:
    """boto3 clients of this process, one per distinct ``ClientConfig`` (boto3 clients are thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._clients: dict[tuple[Any, ...], Any] = {}

    def get(self, config: ClientConfig) -> Any:
        key = config._identity()
        with self._lock:
            if self._pid != os.getpid():  # connections do not survive fork
                self._pid, self._clients = os.getpid(), {}
            client = self._clients.get(key)
        if client is None:
            client = config.make_client()  # outside the lock: slow, and may raise
            with self._lock:
                client = self._clients.setdefault(key, client)
        return client


_CLIENTS = _ClientPool()


def _log_failed_attempt(
    response: Any, operation: Any, attempts: int, caught_exception: BaseException | None, request_dict: Any,
    **_: Any,
) -> None:
    """Log, at debug, each failed attempt botocore may retry; the URL names bucket and key, never secrets."""
    status = response[0].status_code if response else None
    if caught_exception is None and (status is None or status < 500) and status != 429:
        return None  # returning None leaves the retry decision to botocore
    cause = caught_exception if caught_exception is not None else f"HTTP {status}"
    url = str(request_dict.get("url", "")).split("?", 1)[0]
    log.debug("%s %s: attempt %d failed (%s)", operation.name, url, attempts, cause)
    return None


def _read_credential_file(path: str) -> dict[str, Any]:
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"credential file {path!r} does not exist") from None
    except (OSError, ValueError) as exc:
        # The message of a JSON error can quote the file's content: name only the position.
        where = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(f"credential file {path!r} is not readable JSON{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"credential file {path!r} must hold a JSON object of boto3 client arguments")
    unknown = sorted(set(data) - CREDENTIAL_FILE_KEYS)
    if unknown:
        raise ConfigError(
            f"credential file {path!r} has unknown keys {unknown}; allowed: {sorted(CREDENTIAL_FILE_KEYS)}"
        )
    if mode & (stat.S_IRGRP | stat.S_IROTH) and "aws_secret_access_key" in data:
        log.warning("credential file %s is readable by other users; chmod 600 it", path)
    return {k: v for k, v in data.items() if v is not None}
