"""One set of storage options for both sides of a checkpoint: :class:`StorageOptions`.

The options themselves (each declared once, with its default and its check) and how keywords merge
are :mod:`dcp_s3._dcp.options`; this class adds what needs a store: writers, readers and stores
for locations.
"""

from __future__ import annotations

import os

from dcp_s3._dcp.options import Settings
from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._dcp.store import Store
from dcp_s3._dcp.store_opening import open_object, open_store
from dcp_s3._dcp.writer import S3StorageWriter

__all__ = ["StorageOptions"]


class StorageOptions(Settings):
    """Storage options (``S3StorageWriter``/``S3StorageReader`` keywords: every ``ClientConfig``,
    ``TransferConfig``, writer and reader setting, or ``client=``/``transfer=`` whole), checked once,
    when made: an unknown option, or a value that would be refused, is a ``ConfigError`` naming it.
    A frozen value: ``client``, ``transfer``, ``writing`` and ``reading`` are its parts.

        options = StorageOptions(endpoint_url="http://127.0.0.1:8333", part_size=32 << 20, compression="zstd")
        dcp.save(state_dict, storage_writer=options.writer("s3://bucket/run1/step-100"))
        dcp.load(state_dict, storage_reader=options.reader("s3://bucket/run1/step-100"))

    Each side uses the part that is its own (``compression`` and the other writer settings do
    nothing on a load: the reader finds the compression from what is stored); the client and
    transfer parts go to both. On a local path only the options that mean something there are
    accepted (see ``open_store``). ``StorageOptions.of(mapping_or_options, **overrides)`` merges,
    once; ``replace(**changes)`` is a copy with changes; ``as_dict()`` the keywords as given.
    """

    def writer(self, checkpoint: str | os.PathLike[str], *, overwrite: bool | None = None) -> S3StorageWriter:
        """An ``S3StorageWriter`` for ``checkpoint`` (``s3://bucket/key`` or a local directory) with
        these options; ``overwrite`` overrides the option of that name."""
        store, name = open_object(checkpoint, options=self)
        return store.writer(name, overwrite=overwrite)

    def reader(
        self, checkpoint: str | os.PathLike[str], kind: type[S3StorageReader] = S3StorageReader
    ) -> S3StorageReader:
        """An ``S3StorageReader`` (or ``kind``, a subclass taking its arguments) for ``checkpoint`` with these
        options."""
        store, name = open_object(checkpoint, options=self)
        return store.reader(name, kind)

    def store(self, root: str | os.PathLike[str]) -> Store:
        """A :class:`~dcp_s3._dcp.Store` rooted at ``root`` with these options (what the
        ``Checkpointer`` and the command-line tools use: listings, deletes, writers and readers)."""
        return open_store(root, options=self)
