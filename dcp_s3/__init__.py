"""dcp_s3: save and load PyTorch Distributed Checkpoints straight to S3 and S3-compatible stores.

    import torch.distributed.checkpoint as dcp
    from dcp_s3 import S3StorageWriter, S3StorageReader

    dcp.save(state_dict, storage_writer=S3StorageWriter("s3://bucket/run1/step-0001000"))
    dcp.load(state_dict, storage_reader=S3StorageReader("s3://bucket/run1/step-0001000"))
"""

from __future__ import annotations

import logging

from .checkpointer import AsyncSave, Checkpointer, latest_checkpoint, load_object, save_object
from .config import ClientConfig, TransferConfig
from .errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    InvalidCheckpointIdError,
    S3AccessDeniedError,
    S3TransferError,
)
from .planners import MetaRankLoadPlanner, TrainableOnlyLoadPlanner, TrainableOnlySavePlanner, frozen_parameter_fqns
from .planners_scale import ScalableSavePlanner
from .reader import S3StorageReader
from .writer import S3StorageWriter

__version__ = "0.1.0"

__all__ = [
    "S3StorageWriter",
    "S3StorageReader",
    "Checkpointer",
    "AsyncSave",
    "latest_checkpoint",
    "save_object",
    "load_object",
    "TrainableOnlySavePlanner",
    "TrainableOnlyLoadPlanner",
    "MetaRankLoadPlanner",
    "ScalableSavePlanner",
    "frozen_parameter_fqns",
    "TransferConfig",
    "ClientConfig",
    "DcpS3Error",
    "InvalidCheckpointIdError",
    "ConfigError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "S3AccessDeniedError",
    "S3TransferError",
    "CheckpointFormatError",
]

logging.getLogger("dcp_s3").addHandler(logging.NullHandler())
