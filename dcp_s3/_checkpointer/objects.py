"""Single objects and step lookup without a :class:`~dcp_s3._checkpointer.manager.Checkpointer`.

``save_object``/``load_object`` ``torch.save``/``torch.load`` one object to ``s3://bucket/key``
or a local file; ``latest_checkpoint`` names the newest complete step under a root.
"""

from __future__ import annotations

import os
from typing import Any

from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._dcp import open_object, open_store
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes

__all__ = ["save_object", "load_object", "latest_checkpoint"]


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
