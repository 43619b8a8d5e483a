"""The object stores: one interface (:class:`ObjectStore`) over S3 and local directories (no torch, no DCP).

:mod:`~dcp_s3._objstore.base` is the interface and the read helpers every backend shares;
:mod:`~dcp_s3._objstore.s3` (with :mod:`~dcp_s3._objstore.s3_multipart` and
:mod:`~dcp_s3._objstore.s3_requests`) is S3 and S3-compatible servers; :mod:`~dcp_s3._objstore.local`
(with :mod:`~dcp_s3._objstore.local_fs`, the link- and FIFO-proof file access) is files under a
directory. :mod:`~dcp_s3._objstore.config` holds the one settings object of S3 clients
(:class:`ClientConfig`) and of transfers (:class:`TransferConfig`); :mod:`~dcp_s3._objstore.credentials`
reads a credential file; :mod:`~dcp_s3._objstore.buffers` the part buffers that bound upload memory;
:mod:`~dcp_s3._objstore.redact` keeps secrets out of logs.
"""

from dcp_s3._objstore.base import ObjectInfo, ObjectStore, ObjectWriter, PendingUpload, RangeRead
from dcp_s3._objstore.config import ClientConfig, TransferConfig
from dcp_s3._objstore.uri import S3Uri, parse_s3_uri, s3_location

__all__ = [
    "ClientConfig",
    "ObjectInfo",
    "ObjectStore",
    "ObjectWriter",
    "PendingUpload",
    "RangeRead",
    "S3Uri",
    "TransferConfig",
    "parse_s3_uri",
    "s3_location",
]
