"""The one store layer between DCP and the object stores (:mod:`dcp_s3._objstore`).

:class:`S3StorageWriter` and :class:`S3StorageReader` (on S3 and on local disk alike) are DCP's storage writer and
reader; :class:`Store` (``store``) is the objects under one checkpoint root, for the checkpoint manager and the
tools, and makes those writers and readers for its sub-locations (backends: ``store_s3``, ``store_local``;
``store_opening`` picks one for a location); :class:`StorageOptions` (``storage_options``) is one set of options
for all of them (declared in ``options``).

They turn DCP's write and read items into objects of an object store (:mod:`dcp_s3._objstore`):
:mod:`~dcp_s3._dcp.session` is the location and the store they share,
:mod:`~dcp_s3._dcp.tensor_bytes` how one tensor becomes bytes, :mod:`~dcp_s3._dcp.data_objects`
how one rank's items are streamed into its data objects, :mod:`~dcp_s3._dcp.item_reads` how one
read item becomes ranged reads of its object, :mod:`~dcp_s3._dcp.replicated` the replicated
loads that read each byte once; :class:`S3HuggingFaceStorageReader` loads Hugging Face safetensors exports
through the same reads, and :class:`S3HuggingFaceStorageWriter` writes them from many ranks. Nothing here speaks HTTP.
"""

from dcp_s3._dcp.hf_reader import S3HuggingFaceStorageReader
from dcp_s3._dcp.hf_writer import S3HuggingFaceStorageWriter
from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._dcp.store import Entry, Store, Upload
from dcp_s3._dcp.store_opening import open_object, open_store
from dcp_s3._dcp.writer import S3StorageWriter

__all__ = [
    "Entry",
    "S3HuggingFaceStorageReader",
    "S3HuggingFaceStorageWriter",
    "S3StorageReader",
    "S3StorageWriter",
    "StorageOptions",
    "Store",
    "Upload",
    "open_object",
    "open_store",
]
