"""dcp_s3: save and load PyTorch Distributed Checkpoints straight to S3 and S3-compatible stores.

import torch.distributed.checkpoint as dcp
from dcp_s3 import S3StorageWriter, S3StorageReader

dcp.save(state_dict, storage_writer=S3StorageWriter("s3://bucket/run1/step-0001000"))
dcp.load(state_dict, storage_reader=S3StorageReader("s3://bucket/run1/step-0001000"))
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from dcp_s3.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    DeletionRefusedError,
    InvalidCheckpointIdError,
    InvalidTypeError,
    LocalServerError,
    S3AccessDeniedError,
    S3ThrottledError,
    S3TransferError,
    ServerCapabilityError,
    TorchCompatibilityError,
)

if TYPE_CHECKING:
    from dcp_s3._checkpointer import AsyncSave, Checkpointer, latest_checkpoint, load_object, save_object
    from dcp_s3._dcp import (
        S3HuggingFaceStorageReader,
        S3HuggingFaceStorageWriter,
        S3StorageReader,
        S3StorageWriter,
        StorageOptions,
    )
    from dcp_s3._objstore import ClientConfig, TransferConfig
    from dcp_s3._planners import (
        MetaRankLoadPlanner,
        ScalableLoadPlanner,
        ScalableSavePlanner,
        TrainableOnlyLoadPlanner,
        TrainableOnlySavePlanner,
        frozen_parameter_fqns,
    )

__version__ = "0.3.0"

# Imported on first use, so that ``import dcp_s3._objstore.base`` (the torch-free object stores) does not load
# torch and DCP, and ``import dcp_s3`` stays cheap.
_LAZY = {
    "S3StorageWriter": "storage",
    "S3StorageReader": "storage",
    "S3HuggingFaceStorageReader": "storage",
    "S3HuggingFaceStorageWriter": "storage",
    "StorageOptions": "store",
    "Checkpointer": "checkpointer",
    "AsyncSave": "checkpointer",
    "latest_checkpoint": "checkpointer",
    "save_object": "checkpointer",
    "load_object": "checkpointer",
    "TrainableOnlySavePlanner": "planners",
    "TrainableOnlyLoadPlanner": "planners",
    "MetaRankLoadPlanner": "planners",
    "frozen_parameter_fqns": "planners",
    "ScalableSavePlanner": "planners",
    "ScalableLoadPlanner": "planners",
    "TransferConfig": "objstore",
    "ClientConfig": "objstore",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_s3' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "S3StorageWriter",
    "S3StorageReader",
    "S3HuggingFaceStorageReader",
    "S3HuggingFaceStorageWriter",
    "StorageOptions",
    "Checkpointer",
    "AsyncSave",
    "latest_checkpoint",
    "save_object",
    "load_object",
    "TrainableOnlySavePlanner",
    "TrainableOnlyLoadPlanner",
    "MetaRankLoadPlanner",
    "ScalableSavePlanner",
    "ScalableLoadPlanner",
    "frozen_parameter_fqns",
    "TransferConfig",
    "ClientConfig",
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

#: The public face, listed once: these modules' ``__all__`` and the ``dcp-s3`` command line are what the compatibility
#: policy promises (docs/stored-format.md) and what the API reference documents (docs/api/, checked by
#: tests/test_docs_site.py); every other module is internal, whatever its name. One entry module per integration
#: (NeMo AutoModel has two: its Checkpointer and its recipes).
_PUBLIC_MODULES = (
    "dcp_s3",
    "dcp_s3.admin",
    "dcp_s3.testing",
    "dcp_s3.integrations.dcp_route",
    "dcp_s3.integrations.torchtitan",
    "dcp_s3.integrations.lightning",
    "dcp_s3.integrations.accelerate",
    "dcp_s3.integrations.nemo_automodel",
    "dcp_s3.integrations.nemo_recipe",
    "dcp_s3.integrations.torch_checkpointing",
    "dcp_s3.integrations.megatron",
)

logging.getLogger("dcp_s3").addHandler(logging.NullHandler())
