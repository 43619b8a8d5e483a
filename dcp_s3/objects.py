"""Single objects and step lookup without a :class:`~dcp_s3.checkpointer.Checkpointer`.

``save_object``/``load_object`` ``torch.save``/``torch.load`` one object to ``s3://bucket/key``
or a local file; ``latest_checkpoint`` names the newest complete step under a root.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from .errors import CheckpointFormatError
from .steps import find_complete
from .store import open_object, open_store
from .weights_only import byte_item_problem

__all__ = ["save_object", "load_object", "latest_checkpoint", "torch_load", "torch_save_bytes"]


def save_object(obj: Any, uri: str | os.PathLike[str], **storage_options: Any) -> None:
    """``torch.save`` ``obj`` to ``s3://bucket/key`` or a local file, in one atomic write."""
    store, name = open_object(uri, **storage_options)
    store.write(name, torch_save_bytes(obj))


def load_object(
    uri: str | os.PathLike[str], *, weights_only: bool = True, map_location: Any = "cpu", **storage_options: Any
) -> Any:
    """``torch.load`` an object written by :func:`save_object` (``weights_only=True`` by default)."""
    store, name = open_object(uri, **storage_options)
    return torch_load(store.read(name), store.url(name), weights_only=weights_only, map_location=map_location)


def latest_checkpoint(uri_or_dir: str | os.PathLike[str], **storage_options: Any) -> str | None:
    """The location of the newest complete step under ``uri_or_dir`` (None if there is none).

    A step is complete once its ``<step>.pth`` marker exists (written last, after every
    part committed); steps without a marker (a crash, a save in progress) are never returned.
    """
    store = open_store(uri_or_dir, **storage_options)
    found = find_complete(store)
    return store.url(found[-1].name) if found else None


def torch_save_bytes(obj: Any) -> bytes:
    """``torch.save`` ``obj`` into bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(data: bytes, where: str, *, weights_only: bool = True, map_location: Any = "cpu") -> Any:
    """``torch.load`` ``data`` read from ``where``; an unreadable or refused file is a ``CheckpointFormatError``.

    With ``weights_only`` the file is first checked as a byte item is (:func:`~dcp_s3.weights_only.byte_item_problem`):
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
