"""``dcp-s3 ls`` and ``inspect``: what is stored at a location, and what a checkpoint holds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_s3._layout import METADATA_KEY
from dcp_s3._torch_compat import element_size
from dcp_s3.admin._locations import read_metadata as _read_metadata
from dcp_s3.admin._locations import resolve
from dcp_s3.admin._locations import single as _single
from dcp_s3.errors import CheckpointNotFoundError, DcpS3Error

__all__ = ["StepSummary", "TensorInfo", "list_steps", "inspect_checkpoint"]


def _tensor_bytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * element_size(md.properties.dtype)


def _tensor_sizes(metadata: Metadata) -> tuple[int, int]:
    """(tensor bytes per the metadata, stored bytes of the tensor items)."""
    tensors = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    stored = sum(int(info.length) for index, info in metadata.storage_data.items() if index.fqn in tensors)
    return sum(map(_tensor_bytes, tensors.values())), stored


@dataclass
class StepSummary:
    """One row of ``dcp-s3 ls``."""

    name: str
    url: str
    kind: str  # "step" or "dcp"
    complete: bool
    stored_bytes: int
    logical_bytes: int | None  # tensor bytes per metadata; None if a part is not committed
    tensor_stored_bytes: int  # stored bytes of the tensor items (what the ratio compares against)
    objects: int
    mtime: float
    parts: list[str] = field(default_factory=list)
    error: str = ""  # why the metadata (or a re-saved step's marker) could not be read, if it could not
    #: True if reading failed: decided by the failure, not by its message (which may be empty).
    unreadable: bool = False

    @property
    def ratio(self) -> float | None:
        """Tensor bytes / their stored bytes: > 1 for compressed checkpoints, about 1 otherwise."""
        if self.logical_bytes is None or not self.tensor_stored_bytes:
            return None
        return self.logical_bytes / self.tensor_stored_bytes


def list_steps(uri: str, **storage_options: Any) -> list[StepSummary]:
    """The steps and DCP checkpoints under ``uri``, oldest first."""
    store, steps = resolve(uri, **storage_options)
    out = []
    for step in steps:
        logical: int | None = 0
        stored_tensors = 0
        error, unreadable = step.error, bool(step.error)
        for part in [] if unreadable else step.parts.values():
            if not part.committed:
                logical = None
                break
            try:
                part_logical, part_stored = _tensor_sizes(_read_metadata(store, part))
            except (DcpS3Error, OSError) as exc:
                logical, error, unreadable = None, str(exc) or type(exc).__name__, True
                break
            logical = (logical or 0) + part_logical
            stored_tensors += part_stored
        if step.kind == "step" and not step.parts or unreadable:
            logical = None  # a legacy single-file checkpoint: no metadata to read
        out.append(
            StepSummary(
                name=step.name or ".",
                url=store.url(step.name),
                kind=step.kind,
                complete=step.complete,
                stored_bytes=step.stored_bytes,
                logical_bytes=logical,
                tensor_stored_bytes=stored_tensors,
                objects=len(step.objects),
                mtime=step.mtime,
                parts=sorted(step.parts),
                error=error,
                unreadable=unreadable,
            )
        )
    return out


@dataclass
class TensorInfo:
    """One entry of a checkpoint's metadata."""

    part: str
    fqn: str
    kind: str  # "tensor" or "bytes"
    shape: list[int] | None
    dtype: str | None
    chunks: list[dict[str, list[int]]]
    stored_bytes: int
    logical_bytes: int


def inspect_checkpoint(uri: str, **storage_options: Any) -> list[TensorInfo]:
    """Every entry of the checkpoint (every part of a step): shape, dtype, chunks, stored size."""
    store, steps = resolve(uri, **storage_options)
    step = _single(store, steps, uri)
    if not step.parts:
        raise DcpS3Error(f"{store.url(step.name)} is a single-file checkpoint; there is no DCP metadata to inspect")
    out: list[TensorInfo] = []
    for key, part in sorted(step.parts.items()):
        if not part.committed:
            raise CheckpointNotFoundError(f"{store.url(part.name)} is incomplete: {METADATA_KEY} is missing")
        metadata = _read_metadata(store, part)
        stored: dict[str, int] = {}
        for index, info in metadata.storage_data.items():
            stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
        for fqn, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                out.append(
                    TensorInfo(
                        part=key,
                        fqn=fqn,
                        kind="tensor",
                        shape=list(md.size),
                        dtype=str(md.properties.dtype).replace("torch.", ""),
                        chunks=[{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
                        stored_bytes=stored.get(fqn, 0),
                        logical_bytes=_tensor_bytes(md),
                    )
                )
            else:
                out.append(
                    TensorInfo(
                        part=key,
                        fqn=fqn,
                        kind="bytes",
                        shape=None,
                        dtype=None,
                        chunks=[],
                        stored_bytes=stored.get(fqn, 0),
                        logical_bytes=stored.get(fqn, 0),
                    )
                )
    return out
