"""One store over a checkpoint root, on S3 or local disk: what the checkpoint manager and the tools use.

:mod:`~dcp_s3._store.base` is :class:`Store` (objects under a root, and DCP writers/readers for
its sub-locations); :mod:`~dcp_s3._store.s3` and :mod:`~dcp_s3._store.local` are its two backends;
:mod:`~dcp_s3._store.opening` is
:func:`open_store` and :func:`open_object`, which pick the backend for a location;
:mod:`~dcp_s3._store.storage_options` is :class:`StorageOptions`, one set of options for writers and readers
(the options are declared in :mod:`dcp_s3._storage.options`).
"""

from dcp_s3._store.base import Entry, Store, Upload
from dcp_s3._store.opening import open_object, open_store
from dcp_s3._store.storage_options import StorageOptions

__all__ = [
    "Entry",
    "Store",
    "StorageOptions",
    "Upload",
    "open_object",
    "open_store",
]
