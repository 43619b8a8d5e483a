"""Deprecated path (0.3.0 documented it): import these names from ``dcp_s3``. Removed in a later release."""

import warnings

from dcp_s3._checkpointer import Checkpointer, latest_checkpoint, load_object, save_object

__all__ = ["Checkpointer", "latest_checkpoint", "load_object", "save_object"]

warnings.warn(
    "dcp_s3.checkpointer is deprecated: import Checkpointer, latest_checkpoint, load_object and save_object from dcp_s3",
    DeprecationWarning,
    stacklevel=2,
)
