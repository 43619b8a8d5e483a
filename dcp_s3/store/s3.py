"""The S3 side of :class:`dcp_s3.store.base.Store`: its storage options, and server-side copies."""

from __future__ import annotations

from typing import Any

from dcp_s3.objstore.config import S3Uri, client_config
from dcp_s3.storage.reader import S3StorageReader
from dcp_s3.storage.session import Session
from dcp_s3.store.base import _CLIENT_OPTIONS, Store, split_storage_options, transfer_from
from dcp_s3.storage.writer import S3StorageWriter

__all__ = ["S3Store"]

class S3Store(Store):
    """Objects under ``s3://bucket/prefix``.

    One ``Session`` carries every request: the client settings (``ClientConfig``, built from
    the storage options exactly as the writer/reader build theirs, so ``request_args``, timeouts
    and retries reach every request), the object store and the I/O pool (``TransferConfig``).
    """

    def __init__(self, uri: S3Uri, **options: Any) -> None:
        self.uri = uri
        writer_options, reader_options = split_storage_options(options)
        S3StorageWriter(None, **writer_options)  # reject a bad option now, not at the first save
        S3StorageReader(None, **reader_options)
        transfer = transfer_from(options)
        client_options = {k: options.get(k) for k in _CLIENT_OPTIONS}
        # The writer's pool size, so that the store and its writers share one client.
        pool = transfer.max_concurrency + transfer.files_per_rank + 2
        client = client_config(writer_options.get("client"), pool, **client_options)
        session = Session(None, client, transfer)
        session.location = uri
        super().__init__(
            session, uri.key, str(uri).rstrip("/"), writer_options=writer_options, reader_options=reader_options
        )

    def same_server(self, other: S3Store) -> bool:
        """Whether ``other`` reaches the same endpoint with the same credentials (so a server-side copy works)."""
        mine, theirs = self.session.client_config, other.session.client_config
        fields = ("credential_path", "endpoint_url", "region", "profile")
        return all(getattr(mine, f) == getattr(theirs, f) for f in fields)
