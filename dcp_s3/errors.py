"""The dcp_s3 exception hierarchy.

Every class takes exactly one message argument so that it survives pickling:
DCP ships exceptions raised on one rank to the coordinator by pickle, and an
exception whose ``__init__`` needs extra arguments breaks that hand-off. Where a
builtin fits, the class also derives from it (``FileNotFoundError``,
``FileExistsError``, ``PermissionError``, ``ValueError``) so callers can catch
the builtin. Messages name the bucket/key and the cause, never credentials.
"""

from __future__ import annotations

__all__ = [
    "DcpS3Error",
    "InvalidCheckpointIdError",
    "ConfigError",
    "CheckpointNotFoundError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "S3AccessDeniedError",
    "S3TransferError",
    "CheckpointFormatError",
    "ServerCapabilityError",
    "InvalidTypeError",
    "TorchCompatibilityError",
    "LocalServerError",
    "S3ThrottledError",
    "DeletionRefusedError",
]


class DcpS3Error(Exception):
    """Base class of every error raised by dcp_s3."""


class InvalidCheckpointIdError(DcpS3Error, ValueError):
    """The checkpoint id is not of the form ``s3://bucket/key...``."""


class ConfigError(DcpS3Error, ValueError):
    """An argument, a writer/reader option, a credential file or a client setting is invalid."""


class InvalidTypeError(DcpS3Error, TypeError):
    """An argument is of a type dcp_s3 cannot use (e.g. ``model_dict`` values that are not modules)."""


class CheckpointNotFoundError(DcpS3Error, FileNotFoundError):
    """The bucket, the checkpoint or one of its objects does not exist."""


class BucketNotFoundError(CheckpointNotFoundError):
    """The bucket itself does not exist (or is not visible with these credentials)."""


class CheckpointExistsError(DcpS3Error, FileExistsError):
    """A complete checkpoint already exists where a new one was to be written."""


class S3AccessDeniedError(DcpS3Error, PermissionError):
    """The server refused the credentials or the operation."""


class S3TransferError(DcpS3Error, OSError):
    """A request failed after retries (network error, server error, throttling)."""


class CheckpointFormatError(DcpS3Error, ValueError):
    """Stored bytes or metadata are not what the checkpoint format requires."""


class ServerCapabilityError(ConfigError):
    """The S3 server lacks a feature the requested guarantee needs (e.g. conditional writes)."""


class TorchCompatibilityError(DcpS3Error, RuntimeError):
    """The installed torch behaves differently from what dcp_s3 relies on (e.g. ``torch.save``'s layout)."""


class LocalServerError(DcpS3Error, RuntimeError):
    """A local test server (:mod:`dcp_s3._local_server`) is not installed or did not start."""


class S3ThrottledError(S3TransferError):
    """The server kept refusing requests as throttled (``503 SlowDown``, 429) past the retry budget."""


class DeletionRefusedError(DcpS3Error, PermissionError):
    """dcp_s3 refused to delete a location it does not own as a committed checkpoint (see
    :mod:`dcp_s3._checkpointer.ownership`); nothing was deleted."""
