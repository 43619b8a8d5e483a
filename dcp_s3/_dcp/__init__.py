"""The DCP storage layer: :class:`S3StorageWriter` and :class:`S3StorageReader`.

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
from dcp_s3._dcp.writer import S3StorageWriter

__all__ = [
    "S3HuggingFaceStorageReader",
    "S3HuggingFaceStorageWriter",
    "S3StorageReader",
    "S3StorageWriter",
]
