"""Deprecated path (0.3.0 documented it): import ``ClientConfig``/``TransferConfig`` from ``dcp_s3`` and
``ObjectStore`` from ``dcp_s3.testing``. Removed in a later release."""

import warnings

from dcp_s3._objstore import ClientConfig, ObjectStore, TransferConfig

__all__ = ["ClientConfig", "ObjectStore", "TransferConfig"]

warnings.warn(
    "dcp_s3.objstore is deprecated: use dcp_s3.ClientConfig, dcp_s3.TransferConfig and dcp_s3.testing.ObjectStore",
    DeprecationWarning,
    stacklevel=2,
)
