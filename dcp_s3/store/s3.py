"""The S3 side of :class:`dcp_s3.store.base.Store`: its session, and server-side copies."""

from __future__ import annotations

from typing import Any

from dcp_s3.objstore.uri import S3Uri
from dcp_s3.storage.session import Session
from dcp_s3.store.base import Store
from dcp_s3.store.options import parse_storage_options

__all__ = ["S3Store"]


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``.

    One ``Session`` carries every request: the client settings (``ClientConfig``, built from
    the storage options exactly as the writer/reader build theirs, so ``request_args``, timeouts
    and retries reach every request), the object store and the I/O pool (``TransferConfig``).
    """

    def __init__(self, uri: S3Uri, **options: Any) -> None:
        self.uri = uri
        parsed = parse_storage_options(options)  # a bad option is refused now, not at the first save
        session = Session(None, parsed.client, parsed.transfer)
        session.location = uri
        super().__init__(
            session, uri.key, str(uri).rstrip("/"), writer_options=parsed.writer, reader_options=parsed.reader
        )

    def same_server(self, other: Store) -> bool:
        """Whether ``other`` is an S3 store reaching the same endpoint with the same credentials (so a
        server-side copy works)."""
        if not isinstance(other, S3Store):
            return False
        mine, theirs = self.session.client_config, other.session.client_config
        fields = ("credential_path", "endpoint_url", "region", "profile")
        return all(getattr(mine, f) == getattr(theirs, f) for f in fields)
