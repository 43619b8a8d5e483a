"""Open a store (or one object's parent store) for a location: ``s3://bucket[/prefix]`` or a local path."""

from __future__ import annotations

import os
from typing import Any

from dcp_s3._dcp.options import Settings
from dcp_s3._dcp.store import Store
from dcp_s3._dcp.store_local import LocalStore
from dcp_s3._dcp.store_s3 import S3Store
from dcp_s3._objstore.uri import parse_s3_uri, s3_location
from dcp_s3.errors import InvalidCheckpointIdError

__all__ = ["open_store", "open_object"]


def open_store(
    location: str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    options: Settings | None = None,
    **storage_options: Any,
) -> Store:
    """A store rooted at ``s3://bucket[/prefix]`` (an :class:`S3Store`) or at a local directory (a
    :class:`LocalStore`).

    ``options`` (a ``StorageOptions``) and ``storage_options`` (its keywords, merged over it: see
    :mod:`dcp_s3._dcp.options`); for local directories only those that mean something there
    (``LOCAL_KEYWORDS``: compression, key prefixes...); the S3 ones are rejected (``ConfigError``)
    there, where they would do nothing. ``follow_symlinks``: a local store lists linked directories
    too (see ``LocalStore``).
    """
    text = os.fspath(location)
    s3 = s3_location(location)
    if s3 is not None:
        return S3Store(parse_s3_uri(s3, require_key=False), options=options, **storage_options)
    if "://" in text:
        raise InvalidCheckpointIdError(f"{text!r}: unsupported scheme; expected s3://bucket/prefix or a local path")
    return LocalStore(text, follow_symlinks=follow_symlinks, options=options, **storage_options)


def open_object(
    location: str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    options: Settings | None = None,
    **storage_options: Any,
) -> tuple[Store, str]:
    """(store of the parent location, object name) for one object/file location."""
    s3 = s3_location(location)
    if s3 is not None:
        uri = parse_s3_uri(s3)
        parent, _, name = uri.key.rpartition("/")
        return open_store(f"s3://{uri.bucket}/{parent}", options=options, **storage_options), name
    parent, name = os.path.split(os.path.abspath(os.fspath(location).rstrip("/")))
    return open_store(parent, follow_symlinks=follow_symlinks, options=options, **storage_options), name
