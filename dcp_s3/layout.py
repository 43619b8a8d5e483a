"""Object keys and the metadata format of a checkpoint.

The layout is torch's filesystem layout, so a checkpoint copied to a local
directory loads with stock ``FileSystemReader``::

    <prefix>/.metadata            pickled ``Metadata``; written last: its presence marks a complete checkpoint
    <prefix>/__{rank}_{n}.distcp  data objects; each item is an independent ``torch.save`` blob or raw bytes
    <prefix>/p-{h}/__{rank}_{n}.distcp  the same, with ``S3StorageWriter(key_prefixes=N)``, N > 1 (see ``rank_prefix``)

``Metadata.storage_data`` maps each ``MetadataIndex`` to an ``ItemLocation`` (a
``_StorageInfo`` subclass, so stock readers use its path/offset/length) that also
records where a tensor's raw bytes start inside its blob, letting the reader
fetch them straight into the destination tensor.
"""

from __future__ import annotations

import io
import pickle
import posixpath
import re
from dataclasses import dataclass
from typing import Any

import torch
from crc32c import crc32c
from torch.distributed.checkpoint.metadata import Metadata

from ._torch_compat import _StorageInfo
from .codec import CODEC_NAME, CODEC_VERSION, FrameIndex
from .errors import CheckpointFormatError, ConfigError

__all__ = [
    "METADATA_KEY", "ItemLocation", "data_object_name", "rank_prefix", "check_key_prefixes", "is_key_prefix_dir", "dump_metadata", "load_metadata", "check_object_name",
    "checksum_error",
]

METADATA_KEY = ".metadata"
DATA_SUFFIX = ".distcp"
#: ``transform_descriptors`` of a compressed item.
CODEC_DESCRIPTOR = f"{CODEC_NAME}/{CODEC_VERSION}"
#: Version of dcp_s3's storage data, recorded in ``Metadata.storage_meta.modules``.
FORMAT_TAG = "dcp_s3/1"
_KEY_PREFIX_DIR = re.compile(r"p-[0-9a-f]+")


def data_object_name(rank_prefix: str, n: int) -> str:
    """``<rank_prefix>{n}.distcp``: ``__{rank}_{n}.distcp`` is the name torch's FileSystemWriter would use."""
    return f"{rank_prefix}{n}{DATA_SUFFIX}"


def check_key_prefixes(key_prefixes: int) -> int:
    """``key_prefixes`` if it is a positive int, else a ``ConfigError`` naming it."""
    if isinstance(key_prefixes, bool) or not isinstance(key_prefixes, int) or key_prefixes < 1:
        raise ConfigError(
            f"key_prefixes={key_prefixes!r}: must be a positive integer (1 = every data object directly "
            "under the checkpoint)"
        )
    return key_prefixes


def rank_prefix(rank: int, key_prefixes: int = 1) -> str:
    """Name prefix of ``rank``'s data objects: ``__{rank}_``, or ``p-{h}/__{rank}_`` when spread.

    S3 partitions a bucket by lexicographic key ranges, each serving ~3,500 PUT/s and
    ~5,500 GET/s. With ``key_prefixes`` N > 1, rank r writes under ``p-<h>``, ``<h>`` being
    ``r % N`` in hex, zero padded to the digits N-1 needs and written backwards, so that
    consecutive slots differ in the first character after ``p-`` and S3 can split the
    checkpoint's range in up to N. The directory stays inside the checkpoint.
    """
    n = check_key_prefixes(key_prefixes)
    if n == 1:
        return f"__{rank}_"
    width = len(f"{n - 1:x}")
    digits = f"{rank % n:0{width}x}"[::-1]
    return f"p-{digits}/__{rank}_"


def is_key_prefix_dir(name: str) -> bool:
    """True for a directory name ``rank_prefix`` makes (``p-`` and lowercase hex digits)."""
    return _KEY_PREFIX_DIR.fullmatch(name) is not None


@dataclass
class ItemLocation(_StorageInfo):
    """Where one item lives: object, offset, length; plus where a tensor's raw bytes start.

    ``payload_offset`` is relative to ``offset``; ``None`` for byte items and for
    items written by other writers (those are read with ``torch.load``).
    ``crc32c`` covers the payload: a tensor's raw bytes, or a byte item's bytes (for
    compressed tensors ``frame_crc32c`` covers them instead, frame by frame).
    ``frames`` is set for compressed tensors: the item is then the codec's frames of
    the raw bytes (no ``torch.save`` envelope), and ``transform_descriptors`` names
    the codec so stock readers refuse it instead of misreading it. ``frame_crc32c``
    holds the CRC32C of each frame's raw bytes, so partial reads are checked too.
    """

    payload_offset: int | None = None
    crc32c: int | None = None
    frames: FrameIndex | None = None
    frame_crc32c: tuple[int, ...] | None = None


def checksum_error(info: _StorageInfo, payload: bytes | memoryview) -> str | None:
    """Why ``payload`` (the item's payload, see ``ItemLocation``) fails its recorded CRC32C, or None."""
    expected = getattr(info, "crc32c", None)
    if expected is None:
        return None
    actual = crc32c(payload)
    if actual == expected:
        return None
    return f"checksum mismatch (crc32c {actual:#010x}, expected {expected:#010x}): the stored bytes are corrupt"


def check_object_name(name: str) -> str:
    """Reject object names from metadata that would escape the checkpoint prefix."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "://" in name
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
        or posixpath.normpath(name) != name
    ):
        raise CheckpointFormatError(f"metadata names an invalid object path {name!r}")
    return name


def dump_metadata(metadata: Metadata) -> bytes:
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


# Classes a checkpoint's .metadata may reference; anything else is refused.
_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
            "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "dcp_s3.layout": frozenset({"ItemLocation"}),
    "dcp_s3.codec": frozenset({"FrameIndex"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the classes DCP metadata is made of: a crafted pickle cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(f"refusing to load {module}.{name}: not a checkpoint metadata class")


def load_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle ``.metadata`` bytes with the restricted unpickler; errors name ``where``."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from None
    except Exception as exc:
        raise CheckpointFormatError(f"{where} is not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointFormatError(f"{where} does not hold DCP Metadata with storage data")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise CheckpointFormatError(f"{where}: storage data entry of type {type(info).__name__}")
        check_object_name(info.relative_path)
    return metadata
