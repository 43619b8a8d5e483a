"""Deprecated path (0.3.0 documented it): use ``dcp_s3.testing.LocalS3Server``. Removed in a later release."""

import warnings

from dcp_s3._local_server import LocalS3Server

__all__ = ["LocalS3Server"]

warnings.warn("dcp_s3.local_server is deprecated: use dcp_s3.testing.LocalS3Server", DeprecationWarning, stacklevel=2)
