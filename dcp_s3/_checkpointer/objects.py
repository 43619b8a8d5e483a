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
    """``torch.save`` ``obj`` to ``s3://bucket/key`` or a local file, in one atomic write.

    Args:
        obj: what to save (anything ``torch.save`` takes).
        uri: ``s3://bucket/key`` or a local file path; an object already there is replaced.
        **storage_options: ``StorageOptions`` keywords (``endpoint_url``, ``region``, ``options=`` a whole
            ``StorageOptions``...); on a local path only those that mean something there.

    Raises:
        InvalidCheckpointIdError: ``uri`` is neither ``s3://bucket/key`` nor a local path.
        ConfigError: an unknown or refused storage option.
    """
    store, name = open_object(uri, **storage_options)
    store.write(name, torch_save_bytes(obj))


def load_object(
    uri: str | os.PathLike[str], *, weights_only: bool = True, map_location: Any = "cpu", **storage_options: Any
) -> Any:
    """``torch.load`` an object written by `save_object` (``weights_only=True`` by default).

    Args:
        uri: ``s3://bucket/key`` or a local file path.
        weights_only: passed to ``torch.load``; ``True`` also refuses a file whose loading would cost time or
            memory out of proportion to its size. ``False`` only for files you trust.
        map_location: passed to ``torch.load``.
        **storage_options: ``StorageOptions`` keywords, as for `save_object`.

    Returns:
        The loaded object.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``uri``.
        CheckpointFormatError: the object is not a readable ``torch.save`` file, or weights-only loading
            refuses it.
        InvalidCheckpointIdError: ``uri`` is neither ``s3://bucket/key`` nor a local path.
        ConfigError: an unknown or refused storage option.
    """
    store, name = open_object(uri, **storage_options)
    return torch_load(store.read(name), store.url(name), weights_only=weights_only, map_location=map_location)


def latest_checkpoint(uri_or_dir: str | os.PathLike[str], **storage_options: Any) -> str | None:
    """The location of the newest complete step under ``uri_or_dir`` (None if there is none).

    A step is complete once its ``<step>.pth`` marker exists (written last, after every
    part committed); steps without a marker (a crash, a save in progress) are never returned.

    Args:
        uri_or_dir: a ``Checkpointer``'s ``save_dir``: ``s3://bucket/prefix`` or a local directory.
        **storage_options: ``StorageOptions`` keywords, as for `save_object`.

    Returns:
        ``<uri_or_dir>/<step>`` of the newest complete step, or None.

    Raises:
        InvalidCheckpointIdError: ``uri_or_dir`` is neither ``s3://bucket/prefix`` nor a local path.
        ConfigError: an unknown or refused storage option.
    """
    store = open_store(uri_or_dir, **storage_options)
    found = find_complete(store)
    return store.url(found[-1].name) if found else None
