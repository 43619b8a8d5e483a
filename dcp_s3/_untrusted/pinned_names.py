"""The names stored ``.metadata`` pickles give their classes, pinned: moving a class never breaks a checkpoint.

A pickle names every class by the module path and name it had when the checkpoint was
written: every dcp_s3 release so far stores ``dcp_s3.layout.ItemLocation`` and (compressed
items) ``dcp_s3.codec.format.FrameIndex``. The restricted unpickler (``dcp_s3._untrusted.metadata_pickle``) resolves a
stored name through the table below (``pinned()``), never through a class's ``__module__``, so the checkpoints
already written keep loading wherever the classes live in the code. Rules for a refactor:

- never remove or change an entry of ``_frozen()``: existing checkpoints carry these names;
- keep each pinned module path importable with the class under that name (a re-export at the
  old path): torch's own ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle``,
  which imports the stored path;
- new pickles name a class by its ``__module__``: keep it the pinned path (assign it after
  moving the class) or add the new name here too.

tests/test_pinned_names.py checks all three, and tests/test_golden.py loads checkpoints that
released versions wrote.
"""

from __future__ import annotations

import collections
import functools
import pathlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3._codec.format import FrameIndex
from dcp_s3._layout import ItemLocation
from dcp_s3._torch_compat import MEM_FORMAT_ENCODING, _StorageInfo, get_layout

__all__ = ["pinned", "metadata_classes", "DCP_S3_NAMES"]

_DCP = "torch.distributed.checkpoint.metadata"

#: The stored names of dcp_s3's own classes (frozen: 0.1.0 and 0.2.0 checkpoints carry them).
DCP_S3_NAMES = (("dcp_s3.layout", "ItemLocation"), ("dcp_s3.codec", "FrameIndex"))


def _frozen() -> dict[tuple[str, str], Any]:
    """Stored (module, name), as a pickle's GLOBAL / STACK_GLOBAL holds it -> the object it means."""
    return {
        # dcp_s3's storage entries, by the paths they had when 0.1.0 and 0.2.0 wrote them.
        ("dcp_s3.layout", "ItemLocation"): ItemLocation,
        ("dcp_s3.codec", "FrameIndex"): FrameIndex,
        # torch DCP's metadata classes, as torch 2.7-2.15 name them.
        (_DCP, "Metadata"): Metadata,
        (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
        (_DCP, "TensorProperties"): TensorProperties,
        (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
        (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
        (_DCP, "MetadataIndex"): MetadataIndex,
        (_DCP, "StorageMeta"): StorageMeta,
        (_DCP, "_MEM_FORMAT_ENCODING"): MEM_FORMAT_ENCODING,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): get_layout,
        # StorageMeta.checkpoint_id of torch's FileSystemWriter (pathlib._local from Python 3.13).
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,
        ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "tuple"): tuple,
        ("builtins", "list"): list,
        ("builtins", "dict"): dict,
    }


@functools.cache
def pinned() -> Mapping[tuple[str, str], Any]:
    """Stored ``(module, name)`` -> object, for every global a metadata pickle may name.

    The frozen table above, plus torch's dtypes (``torch.float32``...: only what ``vars(torch)``
    already holds, never ``getattr(torch, name)``, which can import modules) and, for torch's
    own classes only, the name the running torch gives them (if a torch release moves one,
    pickles it writes name the new path; the old path stays above).
    """
    table = _frozen()
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            table.setdefault(("torch", name), value)
    for value in list(table.values()):
        if isinstance(value, type) and value.__module__.startswith("torch."):
            table.setdefault((value.__module__, value.__qualname__), value)
    return MappingProxyType(table)


@functools.cache
def metadata_classes() -> tuple[type, ...]:
    """The classes a metadata pickle may instantiate (NEWOBJ) and give state (BUILD)."""
    table = pinned()
    return tuple(
        table[key]
        for key in (
            (_DCP, "Metadata"),
            (_DCP, "TensorStorageMetadata"),
            (_DCP, "TensorProperties"),
            (_DCP, "ChunkStorageMetadata"),
            (_DCP, "BytesStorageMetadata"),
            (_DCP, "MetadataIndex"),
            (_DCP, "StorageMeta"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            *DCP_S3_NAMES,
        )
    )
