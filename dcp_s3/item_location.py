"""``ItemLocation``: the storage entry of every item dcp_s3 writes (a leaf: the metadata readers,
writers and the pinned-name table all import it, and it imports none of them).

Stored ``.metadata`` pickles name it ``dcp_s3.layout.ItemLocation`` (every release so far): its
``__module__`` stays that path, and :mod:`dcp_s3.layout` re-exports it there, so new pickles name
it the same way and plain ``pickle`` (torch's ``FileSystemReader``) still finds it
(``dcp_s3.metadata_names``, ``tests/test_pinned_names.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._torch_compat import _StorageInfo
from .codec import FrameIndex

__all__ = ["ItemLocation"]


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


ItemLocation.__module__ = "dcp_s3.layout"  # the pinned stored name (see the module docstring)
