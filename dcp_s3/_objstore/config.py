"""Credentials and S3 client settings (checkpoint URIs: :mod:`dcp_s3._objstore.uri`; credential files:
:mod:`dcp_s3._objstore.credentials`; the User-Agent: :mod:`dcp_s3._objstore.user_agent`).

Nothing here knows about DCP. ``ClientConfig`` is a frozen, picklable value:
it holds where credentials come from (a file path, a profile, the standard
boto3 chain), never the secrets themselves, so a writer pickled into an
``async_save`` child re-reads them there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import numbers
import os
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config

from dcp_s3._objstore.credentials import read_credential_file
from dcp_s3._objstore.deadline import install_request_deadline
from dcp_s3._objstore.rate_hooks import install_rate_control
from dcp_s3._objstore.redact import install_log_redaction
from dcp_s3._objstore.user_agent import USER_AGENT
from dcp_s3.errors import ConfigError

__all__ = ["ClientConfig", "TransferConfig"]

log = logging.getLogger(__name__)

MiB = 1 << 20


#: Default of ``TransferConfig.max_whole_read``: 4 GiB.
DEFAULT_MAX_WHOLE_READ = 4 << 30


def int_option(name: str, value: Any, minimum: int) -> int:
    """``value`` as a plain int (numpy ints too) if it is an integer >= ``minimum``; else ``ConfigError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}; expected an integer")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return int(value)


def _check_int(owner: object, name: str, minimum: int) -> None:
    object.__setattr__(owner, name, int_option(name, getattr(owner, name), minimum))


def _check_seconds(owner: object, name: str, unit: str = "seconds") -> None:
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}; expected a number of {unit}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{name}={value} must be a finite number of {unit} > 0")
    object.__setattr__(owner, name, seconds)


def _check_tls(config: ClientConfig) -> None:
    """``verify`` is a bool or an existing CA bundle (file or directory); ``client_cert`` existing files."""
    verify = config.verify
    if isinstance(verify, os.PathLike):
        verify = os.fspath(verify)
        object.__setattr__(config, "verify", verify)
    if not isinstance(verify, (bool, str)) or verify == "":
        raise ConfigError(f"verify={verify!r}: expected True, False or the path of a PEM CA bundle")
    if isinstance(verify, str) and not os.path.exists(verify):
        raise ConfigError(f"verify={verify!r}: no CA bundle at that path")
    cert = config.client_cert
    if cert is None:
        return
    paths = list(cert) if isinstance(cert, (tuple, list)) else [cert]
    paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in paths]
    if not (1 <= len(paths) <= 2 and all(isinstance(p, str) and p for p in paths)):
        raise ConfigError(f"client_cert={cert!r}: expected a PEM path or (certificate path, key path)")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"client_cert: no file at {missing[0]!r}")
    object.__setattr__(config, "client_cert", paths[0] if len(paths) == 1 else (paths[0], paths[1]))


def _check_str(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{name}={value!r} must be a non-empty string")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Sizes and concurrency of the transfer engine.

    Part buffers of a save hold at most ``(max_concurrency + files_per_rank) * P`` bytes, ``P`` being
    ``part_size``, or ``buffers.fit_part_size(part_size, size)`` for the largest object when it would
    exceed 10,000 parts (see docs/configuration.md, "Memory").
    """

    #: Bytes per multipart part (5 MiB..5 GiB); enlarged when an object would exceed 10,000 parts.
    part_size: int = 16 * MiB
    #: Largest part sent straight from the caller's memory (tensor bytes a save does not copy into a part
    #: buffer): it holds no buffer, so it may be larger than ``part_size`` (never smaller: the larger of the
    #: two is used), while an object still gets as many parts as the save has upload places. Fewer,
    #: larger UploadParts cost less CPU per byte (each costs ~4 ms of botocore); one part must still
    #: finish within ``ClientConfig.request_deadline``.
    max_direct_part_size: int = 64 * MiB
    #: Parallel part uploads / ranged GETs per process.
    max_concurrency: int = 8
    #: Data objects each rank writes (each streamed by its own thread).
    files_per_rank: int = 1
    #: Largest ranged GET; bigger reads are split and fetched concurrently. Also the memory bound of a
    #: staged read (one buffer of at most this size per request in flight; page-locked for CUDA loads).
    max_range_size: int = 16 * MiB
    #: Largest ranged GET read straight into its destination (an uncompressed tensor item into a
    #: contiguous CPU tensor of the stored dtype, whole rows): it holds no buffer, so it may be larger
    #: than ``max_range_size`` (never smaller: the larger of the two is used). Fewer, larger GETs cost
    #: less CPU per byte (each GET costs ~8 ms of botocore); one GET must still finish within
    #: ``ClientConfig.request_deadline``.
    max_direct_range_size: int = 64 * MiB
    #: Neighbouring reads closer than this are merged into one ranged GET.
    coalesce_gap: int = 1 * MiB
    #: Threads per reader decoding compressed items read through staging (CUDA, cast or column-sliced
    #: destinations; a frame read straight into a CPU tensor is decoded by the thread that read it).
    #: Per process: a node with many ranks runs this many per rank, so the default stays small.
    decode_threads: int = dataclasses.field(default_factory=lambda: min(4, os.cpu_count() or 1))
    #: Largest object read whole into memory (``.metadata``, step markers, other small objects);
    #: a larger one fails with ``CheckpointFormatError`` naming it, its size and this setting,
    #: before its bytes are read (a compact ``.metadata`` of 16,384 ranks is ~150 MB, a stock one
    #: of 4,096 ranks ~1.4 GB).
    max_whole_read: int = DEFAULT_MAX_WHOLE_READ

    def override(self, **changes: int | None) -> TransferConfig:
        """A copy with the given fields replaced; ``None`` values are ignored."""
        given: dict[str, int] = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def __post_init__(self) -> None:
        for name, minimum in (
            ("part_size", 1),
            ("max_direct_part_size", 1),
            ("max_concurrency", 1),
            ("files_per_rank", 1),
            ("max_range_size", 64 * 1024),
            ("max_direct_range_size", 64 * 1024),
            ("coalesce_gap", 0),
            ("decode_threads", 1),
            ("max_whole_read", 1),
        ):
            _check_int(self, name, minimum)
        if not 5 * MiB <= self.part_size <= 5 * 1024 * MiB:
            raise ConfigError(f"part_size={self.part_size} must be between 5 MiB and 5 GiB (S3 limits)")
        if self.max_direct_part_size > 5 * 1024 * MiB:
            raise ConfigError(f"max_direct_part_size={self.max_direct_part_size} must be at most 5 GiB (S3 limits)")


@dataclass(frozen=True)
class ClientConfig:
    """How to build the boto3 S3 client: credential source, endpoint, timeouts, retries.

    The one settings object for everything that bounds time: ``S3StorageWriter``,
    ``S3StorageReader`` (``client=ClientConfig(...)``), ``Checkpointer`` and the ``dcp-s3``
    tools (storage options ``client=`` or ``connect_timeout=``/``read_timeout=``/
    ``retry_attempts=``) all take it. With the defaults an endpoint that accepts connections
    and never answers fails a request after about ``retry_attempts * read_timeout`` = 100 s,
    with an error naming the endpoint; one that answers a byte at a time, after ``request_deadline``.

    Explicit ``endpoint_url``/``region`` win over a credential file's values, which
    win over the standard boto3 chain (``AWS_*`` environment variables incl.
    ``AWS_ENDPOINT_URL``, profiles, instance roles).
    """

    credential_path: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    #: Seconds to wait for a TCP connection.
    connect_timeout: float = 10.0
    #: Seconds a socket read (or write) may wait without progress: waiting for a reply, or for
    #: the next bytes of a body. Each attempt of a request that gets no answer takes this long.
    read_timeout: float = 20.0
    #: Attempts per request, first try included: botocore's retries (``retry_mode``, jittered
    #: backoff) and dcp_s3's resumption of response bodies cut short.
    retry_attempts: int = 5
    retry_mode: str = "standard"
    max_pool_connections: int = 10
    #: Seconds one attempt of a request may take, from sending it to the last byte of its answer (a GET's
    #: body included; a wait for a rate token not): a server that trickles its answer never lets a read wait
    #: ``read_timeout``. Past it the connection is cut and the request fails (``S3TransferError`` naming the
    #: operation, object and this setting), without a retry. Bounds one part or one whole-object read.
    request_deadline: float = 600.0
    #: Pace requests per (bucket, key prefix, read/write) and retry throttled ones (SlowDown, 503, 429)
    #: until ``throttle_deadline`` (docs/many-ranks.md, "Many ranks, one bucket"); False: botocore's retries alone.
    rate_control: bool = True
    #: Seconds a request may go on being refused as throttled before it fails (``S3ThrottledError``).
    throttle_deadline: float = 300.0
    #: The per-prefix budget of the whole job, requests per second (S3's published figures); each rank
    #: starts at its share of it.
    prefix_write_rate: float = 3500.0
    prefix_read_rate: float = 5500.0
    #: TLS certificate verification, as boto3's ``verify``: True (the system's CAs, or ``AWS_CA_BUNDLE``), the
    #: path of a PEM CA bundle (a private certificate authority), or False (off: a warning says so).
    verify: bool | str = True
    #: A client certificate for mutual TLS: the path of a PEM holding certificate and key, or
    #: ``(certificate path, key path)``.
    client_cert: str | tuple[str, str] | None = None
    #: ``"path"`` (``https://host/bucket/key``), ``"virtual"`` (``https://bucket.host/key``) or ``"auto"``
    #: (botocore's choice); None: path-style for a custom endpoint (what MinIO, SeaweedFS and Ceph want), else auto.
    addressing_style: str | None = None
    #: Options added to every request that takes them: ``ServerSideEncryption``, ``SSEKMSKeyId``,
    #: ``SSEKMSEncryptionContext``, ``BucketKeyEnabled``, ``StorageClass``, ``ExpectedBucketOwner``,
    #: ``RequestPayer``.
    request_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.credential_path, os.PathLike):
            object.__setattr__(self, "credential_path", os.fspath(self.credential_path))
        for name in ("credential_path", "endpoint_url", "region", "profile"):
            _check_str(self, name)
        if self.endpoint_url is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", self.endpoint_url):
            raise ConfigError(f"endpoint_url={self.endpoint_url!r} must be an http:// or https:// URL")
        _check_seconds(self, "connect_timeout")
        _check_seconds(self, "read_timeout")
        _check_int(self, "retry_attempts", 1)
        _check_int(self, "max_pool_connections", 1)
        _check_seconds(self, "request_deadline")
        if not isinstance(self.rate_control, bool):
            raise ConfigError(f"rate_control={self.rate_control!r}: must be True or False")
        _check_seconds(self, "throttle_deadline")
        _check_seconds(self, "prefix_write_rate", "requests per second")
        _check_seconds(self, "prefix_read_rate", "requests per second")
        if self.retry_mode not in ("standard", "adaptive"):
            raise ConfigError(f"retry_mode={self.retry_mode!r}; expected 'standard' or 'adaptive'")
        _check_tls(self)
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise ConfigError(f"addressing_style={self.addressing_style!r}; expected 'path', 'virtual' or 'auto'")
        if not isinstance(self.request_args, Mapping):
            raise ConfigError(f"request_args must be a mapping, not a {type(self.request_args).__name__}")
        object.__setattr__(self, "request_args", dict(self.request_args))
        if self.credential_path is not None and not os.path.isfile(self.credential_path):
            raise ConfigError(f"credential file {self.credential_path!r} does not exist")

    def __repr__(self) -> str:
        # request_args may hold KMS key ids and encryption contexts: counted, never shown.
        shown = (
            f"{f}=<{len(self.request_args)} keys>" if f == "request_args" else f"{f}={getattr(self, f)!r}"
            for f in self.__dataclass_fields__
        )
        return f"ClientConfig({', '.join(shown)})"

    def override(self, **changes: Any) -> ClientConfig:
        """A copy with the given fields replaced; ``None`` values are ignored."""
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``boto3.session.Session.client('s3', ...)`` (may hold secrets: never log)."""
        kwargs: dict[str, Any] = {}
        if self.credential_path is not None:
            kwargs.update(read_credential_file(self.credential_path))
        if self.endpoint_url is not None:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.region is not None:
            kwargs["region_name"] = self.region
        return kwargs

    def make_client(self) -> Any:
        """A new boto3 S3 client. boto3 clients are thread-safe; sessions are not."""
        install_log_redaction()
        kwargs = self.client_kwargs()
        custom_endpoint = (
            kwargs.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        config = Config(
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            # First try included; with rate control dcp_s3's handlers retry (objstore.rate_hooks).
            retries={"total_max_attempts": 1 if self.rate_control else self.retry_attempts, "mode": self.retry_mode},
            max_pool_connections=self.max_pool_connections,
            tcp_keepalive=True,
            client_cert=self.client_cert,
            # A fixed User-Agent: botocore otherwise rebuilds it from ~20 parts on every request, ~850 of its
            # ~6,300 Python calls per UploadPart (benchmarks/README.md, "A leaner request path").
            user_agent=USER_AGENT,
            s3={
                # MinIO, SeaweedFS, Ceph and most S3-compatible stores want path-style URLs.
                "addressing_style": self.addressing_style or ("path" if custom_endpoint else "auto"),
                # Integrity comes from the x-amz-checksum-* headers botocore adds to uploads;
                # SHA-256 signing every body as well (botocore's default over plain HTTP)
                # costs a third of the upload throughput.
                "payload_signing_enabled": False,
            },
        )
        if self.verify is False:
            warnings.warn(
                f"dcp_s3: TLS certificate verification is off (verify=False) for "
                f"{custom_endpoint or 'the AWS endpoint'}: anyone on the path can read and change checkpoints",
                UserWarning,
                stacklevel=3,
            )
        if self.verify is not True:
            kwargs["verify"] = self.verify
        session = boto3.session.Session(profile_name=self.profile)
        client = session.client("s3", config=config, **kwargs)
        client.meta.events.register("needs-retry.s3", _log_failed_attempt)
        install_request_deadline(client, self.request_deadline)
        if self.rate_control:
            install_rate_control(
                client,
                retry_attempts=self.retry_attempts,
                deadline=self.throttle_deadline,
                write_rate=self.prefix_write_rate,
                read_rate=self.prefix_read_rate,
            )
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
        # Looked up on every request: the values of the AWS_ variables alone (half the cost of .items()).
        env = hashlib.sha256(repr(sorted((k, os.environ[k]) for k in os.environ if k.startswith("AWS_"))).encode())
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
    response: Any,
    operation: Any,
    attempts: int,
    caught_exception: BaseException | None,
    request_dict: Any,
    **_: Any,
) -> None:
    """Log, at debug, each failed attempt botocore may retry; the URL names bucket and key, never secrets."""
    status = response[0].status_code if response else None
    if caught_exception is None and (status is None or status < 500) and status != 429:
        return  # no value: the retry decision stays botocore's
    cause = caught_exception if caught_exception is not None else f"HTTP {status}"
    url = str(request_dict.get("url", "")).split("?", 1)[0]
    log.debug("%s %s: attempt %d failed (%s)", operation.name, url, attempts, cause)
