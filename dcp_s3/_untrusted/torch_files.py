"""Small ``torch.save`` files (step markers, ``save_object``) to and from bytes; loading checks them first.

``torch_load`` runs the byte-item checker (:mod:`dcp_s3._untrusted.weights_only`) before
``torch.load(weights_only=True)``, so a crafted file costs time and memory linear in its size.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from dcp_s3._untrusted.weights_only import byte_item_problem
from dcp_s3.errors import CheckpointFormatError

__all__ = ["torch_load", "torch_save_bytes"]


def torch_save_bytes(obj: Any) -> bytes:
    """``torch.save`` ``obj`` into bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(data: bytes, where: str, *, weights_only: bool = True, map_location: Any = "cpu") -> Any:
    """``torch.load`` ``data`` read from ``where``; an unreadable or refused file is a ``CheckpointFormatError``.

    With ``weights_only`` the file is first checked as a byte item is (:func:`~dcp_s3._untrusted.weights_only.byte_item_problem`):
    besides torch's weights-only rules, its loading costs time and memory linear in its size.
    """
    if weights_only:
        problem = byte_item_problem(data)
        if problem is not None:
            raise CheckpointFormatError(
                f"{where} is refused: {problem}; if you trust the file and it holds other classes, register them "
                "with torch.serialization.add_safe_globals([...])"
            )
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointFormatError(
            f"{where}: weights_only loading refused it ({first}); if you trust the file, register its classes "
            "with torch.serialization.add_safe_globals([...])"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointFormatError(f"{where} is not a readable torch.save file ({exc})") from exc
