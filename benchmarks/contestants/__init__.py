"""The contestants: each saves and loads a flat state dict through one storage path.

Every DCP contestant runs through ``dcp.save``/``dcp.load`` with ``no_dist=True``
and its library's defaults, except where noted (``sync_files=False`` for the
object-store writers built on ``FileSystemWriter``: there is no file descriptor,
and torch would otherwise call ``os.sync()`` for the whole machine).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Target", "Contestant", "CONTESTANTS", "get"]

Factory = Callable[["Target"], Any]


@dataclass(frozen=True)
class Target:
    """Where one measurement's checkpoint lives."""

    bucket: str
    prefix: str
    endpoint_url: str
    region: str
    local_dir: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class Contestant:
    name: str
    description: str
    save: Callable[[dict[str, Any], Target], None]
    load: Callable[[dict[str, Any], Target], None]
    unavailable: Callable[[], str | None] = lambda: None  # a reason, or None when it can run
    uses_s3: bool = True
    # The StorageWriter/StorageReader behind save/load, for callers that run dcp.save/dcp.load
    # themselves (e.g. on several ranks); None for contestants that are not a DCP storage backend.
    writer: Factory | None = None
    reader: Factory | None = None


def _save_with(writer: Factory) -> Callable[[dict[str, Any], Target], None]:
    """A single-process ``save`` through the StorageWriter ``writer`` builds."""

    def save(sd: dict[str, Any], t: Target) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=writer(t), no_dist=True)

    return save


def _load_with(reader: Factory) -> Callable[[dict[str, Any], Target], None]:
    """A single-process ``load`` through the StorageReader ``reader`` builds."""

    def load(sd: dict[str, Any], t: Target) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(sd, storage_reader=reader(t), no_dist=True)

    return load


def _backend(
    name: str, description: str, writer: Factory, reader: Factory, unavailable: Callable[[], str | None] = lambda: None
) -> Contestant:
    """A contestant that is a DCP storage backend: save/load run through its writer/reader."""
    return Contestant(
        name, description, _save_with(writer), _load_with(reader), unavailable, writer=writer, reader=reader
    )


# -- dcp_s3 -------------------------------------------------------------------------------------
def _dcp_s3_client(opts: dict[str, Any]) -> Any:
    """``rate_control=0|1``: ``ClientConfig(rate_control=...)`` (the retired benchmarks.throttle_overhead, commit 679e524); unset: the default."""
    from dcp_s3 import ClientConfig

    return ClientConfig(rate_control=bool(opts["rate_control"])) if "rate_control" in opts else None


def _dcp_s3_writer(t: Target, **opts: Any) -> Any:
    from dcp_s3 import S3StorageWriter

    return S3StorageWriter(
        t.uri,
        endpoint_url=t.endpoint_url,
        region=t.region,
        client=_dcp_s3_client(opts),
        **{
            k: v
            for k, v in opts.items()
            if k
            in (
                "part_size",
                "max_concurrency",
                "files_per_rank",
                "compression",
                "compression_level",
                "compression_threads",
            )
        },
    )


def _dcp_s3_reader(t: Target, **opts: Any) -> Any:
    from dcp_s3 import S3StorageReader

    return S3StorageReader(
        t.uri,
        endpoint_url=t.endpoint_url,
        region=t.region,
        client=_dcp_s3_client(opts),
        **{k: v for k, v in opts.items() if k in ("max_concurrency", "max_range_size")},
    )


def dcp_s3_variant(spec: str) -> Contestant:
    """``dcp_s3`` with non-default options, e.g. ``dcp_s3:part_size_mib=8,max_concurrency=4``, or
    ``dcp_s3:rate_control=0`` (botocore's retries alone, no rate controller)."""
    _, _, rest = spec.partition(":")
    opts: dict[str, Any] = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        if k.endswith("_mib"):
            opts[k[: -len("_mib")]] = int(float(v) * (1 << 20))
        else:
            opts[k] = int(v) if v.lstrip("-").isdigit() else v

    return _backend(
        spec, f"dcp_s3 with options {opts}", lambda t: _dcp_s3_writer(t, **opts), lambda t: _dcp_s3_reader(t, **opts)
    )


# -- torch FsspecWriter/FsspecReader over s3fs ----------------------------------------------------
def _fsspec_kwargs(t: Target) -> dict[str, Any]:
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register("before-sign.s3.DeleteObjects", _content_md5)
    return {"endpoint_url": t.endpoint_url, "client_kwargs": {"region_name": t.region}, "session": session}


def _content_md5(request: Any, **_: Any) -> None:
    """Give s3fs's ``DeleteObjects`` (torch's fsspec writer renames ``.metadata`` into place: copy, then delete)
    the ``Content-MD5`` header that the JuiceFS gateway (the benchmark server) requires and botocore >= 1.36 no
    longer sends (it sends a CRC32 checksum, which AWS accepts instead)."""
    if "Content-MD5" not in request.headers and isinstance(request.body, bytes):
        request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(request.body).digest()).decode()


def _fsspec_writer(t: Target) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(t.uri, sync_files=False, **_fsspec_kwargs(t))


def _fsspec_reader(t: Target) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(t.uri, **_fsspec_kwargs(t))


def _fsspec_unavailable() -> str | None:
    try:
        import s3fs  # noqa: F401
    except ImportError as exc:
        return f"s3fs is not installed ({exc}); pip install -r benchmarks/requirements.txt"
    return None


# -- AWS s3torchconnector -------------------------------------------------------------------------
def _s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def _s3tc_writer(t: Target) -> Any:
    from s3torchconnector.dcp import S3StorageWriter

    # It takes no endpoint argument: the CRT client reads AWS_ENDPOINT_URL (set by the parent).
    os.environ["AWS_ENDPOINT_URL"] = t.endpoint_url
    return S3StorageWriter(t.region, t.uri, s3client_config=_s3tc_config())


def _s3tc_reader(t: Target) -> Any:
    from s3torchconnector.dcp import S3StorageReader

    os.environ["AWS_ENDPOINT_URL"] = t.endpoint_url
    return S3StorageReader(t.region, t.uri, s3client_config=_s3tc_config())


def _s3tc_unavailable() -> str | None:
    try:
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter  # noqa: F401
    except Exception as exc:  # ImportError, or a native-library load failure
        return f"s3torchconnector[dcp] is not usable here ({type(exc).__name__}: {exc})"
    return None


# -- NVIDIA multi-storage-client -------------------------------------------------------------------
def _msc_writer(t: Target) -> Any:
    from . import msc

    return msc.writer(t)


def _msc_reader(t: Target) -> Any:
    from . import msc

    return msc.reader(t)


def _msc_unavailable() -> str | None:
    from . import msc

    return msc.unavailable()


# -- the naive BytesIO backend ----------------------------------------------------------------------
def _naive_kwargs(t: Target) -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": t.endpoint_url, "region_name": t.region}}


def _naive_writer(t: Target) -> Any:
    from .naive import NaiveS3Writer

    return NaiveS3Writer(t.uri, **_naive_kwargs(t))


def _naive_reader(t: Target) -> Any:
    from .naive import NaiveS3Reader

    return NaiveS3Reader(t.uri, **_naive_kwargs(t))


# -- local disk reference ---------------------------------------------------------------------------
def _local_writer(t: Target) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(t.local_dir)


def _local_reader(t: Target) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(t.local_dir)


# -- raw boto3 transfer ceiling ---------------------------------------------------------------------
def _ceiling_save(sd: dict[str, Any], t: Target) -> None:
    from . import ceiling

    ceiling.save(sd, t.bucket, t.prefix)


def _ceiling_load(sd: dict[str, Any], t: Target) -> None:
    from . import ceiling

    ceiling.load(sd, t.bucket, t.prefix)


CONTESTANTS: dict[str, Contestant] = {
    c.name: c
    for c in [
        _backend(
            "dcp_s3",
            "this project: streaming multipart upload from tensor memory (bounded part pool), "
            "concurrent coalesced ranged GETs into the destination tensors",
            _dcp_s3_writer,
            _dcp_s3_reader,
        ),
        Contestant(
            "dcp_s3_zstd",
            "this project with compression='zstd' (byte-grouped, frame-indexed zstd-1, 2 codec threads)",
            _save_with(lambda t: _dcp_s3_writer(t, compression="zstd")),
            _load_with(_dcp_s3_reader),
        ),
        _backend(
            "fsspec_s3fs",
            "torch FsspecWriter/FsspecReader over s3fs (FileSystemWriter through fsspec "
            "file objects; sync_files=False)",
            _fsspec_writer,
            _fsspec_reader,
            _fsspec_unavailable,
        ),
        _backend(
            "s3torchconnector",
            "AWS s3torchconnector DCP S3StorageWriter/S3StorageReader "
            "(Rust CRT client; endpoint from AWS_ENDPOINT_URL, path-style)",
            _s3tc_writer,
            _s3tc_reader,
            _s3tc_unavailable,
        ),
        _backend(
            "msc",
            "NVIDIA multi-storage-client DCP MultiStorageFileSystemWriter/Reader (boto3; each file "
            "buffered whole in a BytesIO and uploaded on close, read by downloading each whole file; "
            "path-style, no payload signing, cache off; sync_files=False)",
            _msc_writer,
            _msc_reader,
            _msc_unavailable,
        ),
        _backend(
            "naive",
            "FileSystemBase subclass buffering each whole file in a BytesIO, boto3 "
            "upload_fileobj on close, whole-object download_fileobj on read",
            _naive_writer,
            _naive_reader,
        ),
        Contestant(
            "dcp_s3_reads_naive",
            "cross-format check (not in the default set): saved by the naive "
            "FileSystemWriter backend (torch.save blobs without dcp_s3's payload offsets), loaded by "
            "dcp_s3's S3StorageReader",
            _save_with(_naive_writer),
            _load_with(_dcp_s3_reader),
        ),
        Contestant(
            "local_fs",
            "reference: torch FileSystemWriter/FileSystemReader on local disk "
            "(defaults: fsync on, 1 thread; loads come from the page cache)",
            _save_with(_local_writer),
            _load_with(_local_reader),
            uses_s3=False,
        ),
        Contestant(
            "boto3_ceiling",
            "transport ceiling: the same tensor bytes as one object via boto3 "
            "upload_fileobj/download_fileobj (16 MiB parts, 8 threads); partial = one ranged GET per "
            "tensor; no DCP",
            _ceiling_save,
            _ceiling_load,
        ),
    ]
}


def get(name: str) -> Contestant:
    if name.startswith("dcp_s3") and name not in CONTESTANTS:
        return dcp_s3_variant(name)
    try:
        return CONTESTANTS[name]
    except KeyError:
        raise SystemExit(f"unknown contestant {name!r}; choose from {', '.join(CONTESTANTS)}") from None
