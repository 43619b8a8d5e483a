"""The S3 side of :class:`dcp_s3._dcp.store.Store`: its session, and server-side copies."""

from __future__ import annotations

from typing import Any

from dcp_s3._dcp.options import Settings, pooled
from dcp_s3._dcp.session import Session
from dcp_s3._dcp.store import Store
from dcp_s3._objstore.uri import S3Uri

__all__ = ["S3Store"]


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``.

    One ``Session`` carries every request: the client settings (``ClientConfig``, built from
    the storage options as the writer builds its own, so ``request_args``, timeouts
    and retries reach every request), the object store and the I/O pool (``TransferConfig``).
    """

    def __init__(self, uri: S3Uri, *, options: Settings | None = None, **keywords: Any) -> None:
        self.uri = uri
        settings = Settings.of(options, **keywords)  # a bad option is refused now, not at the first save
        transfer = settings.transfer
        # The writer's pool size, so that the store and its writers share one client.
        client = pooled(settings.client, transfer.max_concurrency + transfer.files_per_rank + 2)
        session = Session(None, client, transfer)
        session.location = uri
        super().__init__(session, uri.key, str(uri).rstrip("/"), options=settings)

    def same_server(self, other: Store) -> bool:
        """Whether ``other`` is an S3 store reaching the same endpoint with the same credentials (so a
        server-side copy works)."""
        if not isinstance(other, S3Store):
            return False
        mine, theirs = self.session.client_config, other.session.client_config
        fields = ("credential_path", "endpoint_url", "region", "profile")
        return all(getattr(mine, f) == getattr(theirs, f) for f in fields)
