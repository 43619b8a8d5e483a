"""One store over a checkpoint root, on S3 or local disk: what the checkpoint manager and the tools use.

:mod:`~dcp_s3.store.base` is :class:`Store` (objects under a root, and DCP writers/readers for
its sub-locations) and :func:`open_store`; :mod:`~dcp_s3.store.s3` and :mod:`~dcp_s3.store.local`
are its two backends; :mod:`~dcp_s3.store.options` parses storage options, once.
"""

from dcp_s3.store.base import Entry, Store, Upload, open_object, open_store

__all__ = [
    "Entry",
    "Store",
    "Upload",
    "open_object",
    "open_store",
]
