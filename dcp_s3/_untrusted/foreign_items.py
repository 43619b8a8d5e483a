"""Items written by torch's own ``FileSystemWriter``: a ``torch.save`` archive per tensor chunk,
possibly behind torch's transforms (``FileSystemWriter(_extensions=[ZStandard()])``).

Decoding is bounded by what the metadata says the item holds, checked while decoding, before
more is allocated: a tensor chunk decodes to at most its bytes plus the ``torch.save``
container's overhead (:func:`~dcp_s3._torch_compat.torch_save_bound`); a byte item (whose
size the metadata does not give) to at most ``BYTE_ITEM_RATIO`` times its stored bytes, and
never less than ``BYTE_ITEM_FLOOR``. A tensor archive is then checked like a byte item
(:mod:`dcp_s3._untrusted.weights_only`: only what weights-only loading allows, at a cost linear in its
size) and loaded with ``torch.load(weights_only=True)``; what it holds must be a dense tensor
of the chunk's shape and dtype.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import torch

from dcp_s3._torch_compat import decode_torch_transforms, element_size, torch_save_bound
from dcp_s3._untrusted.weights_only import byte_item_problem
from dcp_s3.errors import CheckpointFormatError

__all__ = ["BYTE_ITEM_FLOOR", "BYTE_ITEM_RATIO", "byte_item_limit", "decode_byte_item", "load_tensor_archive"]

#: A byte item behind torch's transforms decodes to at most this many times its stored bytes
#: (zstd reaches ~32,000:1 on zeros; pickles of optimizer state compress 2-10:1)...
BYTE_ITEM_RATIO = 64
#: ...or this many bytes, whichever is larger.
BYTE_ITEM_FLOOR = 64 << 20


def byte_item_limit(stored: int) -> int:
    """Most bytes a byte item of ``stored`` stored bytes may decode to."""
    return max(BYTE_ITEM_FLOOR, BYTE_ITEM_RATIO * stored)


def decode_byte_item(transforms: list[str], stored: bytearray, where: str) -> bytearray:
    """A byte item's stored bytes with torch's ``transforms`` undone (bounded by :func:`byte_item_limit`)."""
    return decode_torch_transforms(transforms, stored, where, byte_item_limit(len(stored)))


def load_tensor_archive(
    stored: bytearray, transforms: list[str], sizes: Sequence[int], dtype: torch.dtype, where: str
) -> torch.Tensor:
    """The chunk of ``sizes`` and ``dtype`` a ``torch.save`` archive (behind ``transforms``) holds."""
    bound = torch_save_bound(math.prod(sizes) * element_size(dtype), len(sizes))
    blob = decode_torch_transforms(transforms, stored, where, bound) if transforms else stored
    problem = byte_item_problem(blob)
    if problem is not None:
        raise CheckpointFormatError(f"{where}: the torch.save archive of a tensor chunk is refused: {problem}")
    tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if not (
        isinstance(tensor, torch.Tensor)
        and tensor.layout == torch.strided
        and tensor.dtype == dtype
        and tuple(tensor.shape) == tuple(sizes)
    ):
        is_tensor = isinstance(tensor, torch.Tensor)
        got = f"a {list(tensor.shape)} {tensor.dtype} tensor" if is_tensor else type(tensor).__name__
        raise CheckpointFormatError(f"{where}: the archive holds {got}, its chunk is {list(sizes)} {dtype}")
    return tensor
