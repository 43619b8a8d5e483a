"""The checks of ``S3StorageWriter``/``S3StorageReader`` arguments that are theirs alone (the
``TransferConfig`` and ``ClientConfig`` fields check themselves): one definition each, used by the
writer and the reader and by :mod:`dcp_s3.store.options`, which checks a store's options when it opens.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dcp_s3._torch_compat import require_transform_descriptors
from dcp_s3.errors import ConfigError
from dcp_s3.objstore.config import int_option

__all__ = ["check_compression", "check_allow_unsafe_byte_items", "check_share_metadata", "check_replica_group"]


def check_compression(compression: Any, level: Any = 1, threads: Any = 2) -> tuple[int, int] | None:
    """``(level, threads)`` of the codec ``compression`` asks for, or None without compression;
    ``ConfigError`` naming the argument otherwise (level and threads are checked only with compression)."""
    if compression not in (None, "zstd"):
        raise ConfigError(f"compression={compression!r}; expected None or 'zstd'")
    if not compression:
        return None
    require_transform_descriptors(f"compression={compression!r}")
    return int_option("compression_level", level, -(1 << 17)), int_option("compression_threads", threads, 1)


def check_allow_unsafe_byte_items(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"allow_unsafe_byte_items={value!r}: must be True or False")
    return value


def check_share_metadata(value: Any) -> bool | dist.ProcessGroup:
    if not isinstance(value, (bool, dist.ProcessGroup)):
        raise ConfigError(f"share_metadata={value!r}: expected True, False or a ProcessGroup")
    return value


def check_replica_group(value: Any) -> dist.ProcessGroup | None:
    if value is not None and not isinstance(value, dist.ProcessGroup):
        raise ConfigError(f"replica_group={value!r}: expected a ProcessGroup or None")
    return value
