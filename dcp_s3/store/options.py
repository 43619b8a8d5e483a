"""Storage options: the ``S3StorageWriter``/``S3StorageReader`` keywords a store (and a ``Checkpointer``) takes.

:func:`parse_storage_options` is the one parser: it checks every option once, its name and then
its value (a bad one is a ``ConfigError`` naming it, when the store is opened rather than at the
first save), and returns what a store needs: the writer's keywords, the reader's, the
``ClientConfig`` and the ``TransferConfig`` — without making a writer or a reader.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dcp_s3.errors import ConfigError
from dcp_s3.layout import check_key_prefixes
from dcp_s3.metadata.formats import metadata_format_option
from dcp_s3.objstore.config import ClientConfig, TransferConfig, client_config
from dcp_s3.objstore.s3_requests import check_request_args
from dcp_s3.storage.options import (
    check_allow_unsafe_byte_items,
    check_compression,
    check_replica_group,
    check_share_metadata,
)
from dcp_s3.storage.reader import S3StorageReader
from dcp_s3.storage.writer import S3StorageWriter

__all__ = ["ParsedOptions", "parse_storage_options", "CLIENT_OPTIONS", "CLIENT_SETTINGS", "LOCAL_OPTIONS"]

#: Options that choose the S3 client (the rest tune the writer/reader).
CLIENT_OPTIONS = ("credential_path", "endpoint_url", "region", "profile", "request_args")
#: Options that mean something for a local directory (the rest are S3's: client, parts, conditional writes).
LOCAL_OPTIONS = frozenset(
    {
        "compression",
        "compression_level",
        "compression_threads",
        "key_prefixes",
        "files_per_rank",
        "max_concurrency",
        "max_range_size",
        "max_direct_range_size",
        "transfer",
        "overwrite",
        "share_metadata",
        "replica_group",
        "allow_unsafe_byte_items",
        "metadata_format",
        "max_whole_read",
    }
)
#: ``ClientConfig`` fields accepted as storage options of their own; folded into ``client=``.
CLIENT_SETTINGS = (
    "connect_timeout",
    "read_timeout",
    "retry_attempts",
    "retry_mode",
    "verify",
    "client_cert",
    "addressing_style",
)


def _keyword_names(cls: type) -> frozenset[str]:
    params = inspect.signature(cls).parameters
    return frozenset(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY)


_WRITER_OPTIONS = _keyword_names(S3StorageWriter)
_READER_OPTIONS = _keyword_names(S3StorageReader)


@dataclass(frozen=True, slots=True)
class ParsedOptions:
    """Parsed storage options: ``writer``/``reader`` are the keywords of the DCP writer/reader a store
    makes; ``client`` and ``transfer`` configure the store's own session (one client for the store and
    its writers: the pool is the writer's)."""

    writer: dict[str, Any]
    reader: dict[str, Any]
    client: ClientConfig
    transfer: TransferConfig


def parse_storage_options(options: Mapping[str, Any], *, local: str | None = None) -> ParsedOptions:
    """Check and split storage options (``S3StorageWriter``/``S3StorageReader`` keywords).

    ``ClientConfig`` settings given on their own (``connect_timeout``, ``read_timeout``,
    ``retry_attempts``, ``retry_mode``, ``verify``, ``client_cert``, ``addressing_style``) are folded into ``client=`` (a ``ClientConfig``, given or
    default), which both classes take. ``local``: the options are for this local directory: options
    left at None are dropped, and those that would do nothing there (not in ``LOCAL_OPTIONS``: the
    S3 client, parts, conditional writes) are refused. Raises ``ConfigError`` naming any option
    neither class accepts, and any value either would refuse.
    """
    options = dict(options)
    if local is not None:
        options = {k: v for k, v in options.items() if v is not None}
        s3_only = sorted(set(options) - LOCAL_OPTIONS)
        if s3_only:
            raise ConfigError(f"storage options {s3_only} apply to s3:// locations only, not to local path {local!r}")
    settings = {k: options.pop(k) for k in CLIENT_SETTINGS if options.get(k) is not None}
    for k in CLIENT_SETTINGS:
        options.pop(k, None)
    if settings:
        options["client"] = client_config(options.get("client"), 1, **settings)
    unknown = sorted(set(options) - _WRITER_OPTIONS - _READER_OPTIONS)
    if unknown:
        accepted = sorted(_WRITER_OPTIONS | _READER_OPTIONS | set(CLIENT_SETTINGS))
        raise ConfigError(f"unknown storage option(s) {unknown}; S3 locations accept {accepted}")
    transfer = (options.get("transfer") or TransferConfig()).override(
        part_size=options.get("part_size"),
        max_direct_part_size=options.get("max_direct_part_size"),
        max_concurrency=options.get("max_concurrency"),
        files_per_rank=options.get("files_per_rank"),
        max_range_size=options.get("max_range_size"),
        max_direct_range_size=options.get("max_direct_range_size"),
        max_whole_read=options.get("max_whole_read"),
    )
    for name, value in options.items():
        check = _VALUE_CHECKS.get(name)
        if check is not None:
            check(value)
    check_compression(
        options.get("compression"), options.get("compression_level", 1), options.get("compression_threads", 2)
    )
    if local is None:
        # The writer's pool size, so that the store and its writers share one client.
        pool = transfer.max_concurrency + transfer.files_per_rank + 2
        client = client_config(options.get("client"), pool, **{k: options.get(k) for k in CLIENT_OPTIONS})
        check_request_args(client.request_args)
    else:
        client = ClientConfig()
    return ParsedOptions(
        writer={k: v for k, v in options.items() if k in _WRITER_OPTIONS},
        reader={k: v for k, v in options.items() if k in _READER_OPTIONS},
        client=client,
        transfer=transfer,
    )


#: The checks of values S3StorageWriter/S3StorageReader make themselves (the same functions; the
#: TransferConfig and ClientConfig fields are checked by those classes, above).
_VALUE_CHECKS: dict[str, Callable[[Any], object]] = {
    "key_prefixes": check_key_prefixes,
    "metadata_format": metadata_format_option,
    "allow_unsafe_byte_items": check_allow_unsafe_byte_items,
    "share_metadata": check_share_metadata,
    "replica_group": check_replica_group,
}
