"""One store over a checkpoint root, on S3 or local disk: what the checkpoint manager and the tools use.

:mod:`~dcp_s3.store.base` is :class:`Store` (objects under a root, and DCP writers/readers for
its sub-locations); :mod:`~dcp_s3.store.s3` and :mod:`~dcp_s3.store.local` are its two backends;
:mod:`~dcp_s3.store.opening` is
:func:`open_store` and :func:`open_object`, which pick the backend for a location;
:mod:`~dcp_s3.store.storage_options` is :class:`StorageOptions`, one set of options for writers and readers
(the options are declared in :mod:`dcp_s3.storage.options`).
"""

from dcp_s3.store.base import Entry, Store, Upload
from dcp_s3.store.opening import open_object, open_store
from dcp_s3.store.storage_options import StorageOptions

__all__ = [
    "Entry",
    "Store",
    "StorageOptions",
    "Upload",
    "open_object",
    "open_store",
]
