"""Object keys of a checkpoint, and ``ItemLocation``: where each item lives in them.

The layout is torch's filesystem layout, so a checkpoint copied to a local
directory loads with stock ``FileSystemReader``::

    <prefix>/.metadata                    pickled ``Metadata``; written last: it is the commit
    <prefix>/__{rank}_{n}.{token}.distcp  data objects; each item is an independent ``torch.save`` blob or raw bytes
    <prefix>/p-{h}/__{rank}_{n}.{token}.distcp  the same, with ``S3StorageWriter(key_prefixes=N)``, N > 1

``{token}`` is random and new for every save (16 hex digits), so two saves to one location
never write the same object: the one whose ``.metadata`` lands last is the checkpoint, and its
data objects are exactly those its ``.metadata`` names. Checkpoints written by torch's
``FileSystemWriter`` (``__{rank}_{n}.distcp``) read the same way.

``Metadata.storage_data`` maps each ``MetadataIndex`` to an ``ItemLocation`` (a
``_StorageInfo`` subclass, so stock readers use its path/offset/length) that also
records where a tensor's raw bytes start inside its blob, letting the reader
fetch them straight into the destination tensor. Stored ``.metadata`` pickles name it
``dcp_s3.layout.ItemLocation`` (every release so far), which is why this module keeps that path
(``dcp_s3._untrusted.pinned_names``, ``tests/test_pinned_names.py``). The ``.metadata`` formats
themselves are :mod:`dcp_s3._metadata`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from crc32c import crc32c
from torch.distributed.checkpoint.metadata import Metadata

from dcp_s3._codec.format import CODEC_NAME, CODEC_VERSION, FrameIndex
from dcp_s3._torch_compat import _StorageInfo
from dcp_s3.errors import ConfigError

__all__ = [
    "METADATA_KEY",
    "DATA_SUFFIX",
    "PROBE_PREFIX",
    "CODEC_DESCRIPTOR",
    "FORMAT_TAG",
    "ItemLocation",
    "new_token",
    "is_token",
    "data_object_name",
    "referenced_objects",
    "replaceable_objects",
    "rank_prefix",
    "check_key_prefixes",
    "is_key_prefix_dir",
    "checksum_error",
    "BLOCK_SIZE",
    "payload_blocks",
]

METADATA_KEY = ".metadata"
DATA_SUFFIX = ".distcp"
#: ``transform_descriptors`` of a compressed item.
CODEC_DESCRIPTOR = f"{CODEC_NAME}/{CODEC_VERSION}"
#: Version of dcp_s3's storage data, recorded in ``Metadata.storage_meta.modules`` (informational: readers
#: go by the fields each ``ItemLocation`` has). ``dcp_s3/2``: raw tensor items carry ``block_size`` and
#: ``block_crc32c``; every reader of ``dcp_s3/1`` data reads it, and ``dcp_s3/1`` checkpoints still load.
FORMAT_TAG = "dcp_s3/2"
#: Bytes of a raw tensor payload that one ``block_crc32c`` checksum covers (the last block may be shorter):
#: the codec's default frame size, so raw and compressed items are checked at the same granularity.
BLOCK_SIZE = 4 << 20
_KEY_PREFIX_DIR = re.compile(r"p-[0-9a-f]+")
_TOKEN = re.compile(r"[0-9a-f]{16}")
#: Name prefix of the short-lived object the writer uses to test whether a server honours ``If-None-Match``.
PROBE_PREFIX = ".dcp_s3-probe."


def new_token() -> str:
    """A fresh random token for the names of one save's data objects (16 lowercase hex digits)."""
    return secrets.token_hex(8)


def is_token(text: object) -> bool:
    """Whether ``text`` is a save token as :func:`new_token` makes them (16 lowercase hex digits)."""
    return isinstance(text, str) and _TOKEN.fullmatch(text) is not None


def data_object_name(rank_prefix: str, n: int, token: str) -> str:
    """``<rank_prefix>{n}.{token}.distcp``, e.g. ``__3_0.5f1c0e9a2b7d4c11.distcp``.

    torch's FileSystemWriter names the same object ``__3_0.distcp``; the token makes the name
    unique to one save, so a save never touches the objects of a checkpoint it replaces.
    """
    if not is_token(token):
        raise ConfigError(f"object name token {token!r}: expected 16 lowercase hex digits")
    return f"{rank_prefix}{n}.{token}{DATA_SUFFIX}"


def referenced_objects(metadata: Metadata) -> set[str]:
    """The object names (relative to the checkpoint) that ``metadata``'s items live in."""
    column = getattr(metadata.storage_data, "referenced_objects", None)  # compact metadata's CompactStorage:
    if column is not None:  # millions of entries: it reads the object column and builds none
        return set(column())
    return {info.relative_path for info in metadata.storage_data.values()}


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


def replaceable_objects(metadata: Metadata) -> set[str]:
    """The objects of ``metadata`` that a save replacing it may delete: its data objects
    (``*.distcp``, directly in the checkpoint or in a ``p-<hex>/`` directory). A crafted
    ``.metadata`` naming another file of the directory (``config.yaml``) gets it left alone."""
    out = set()
    for name in referenced_objects(metadata):
        sub, _, base = name.rpartition("/")
        if base.endswith(DATA_SUFFIX) and (not sub or is_key_prefix_dir(sub)):
            out.add(name)
    return out


def checksum_error(info: _StorageInfo, payload: bytes | memoryview, crc: int | None = None) -> str | None:
    """Why ``payload`` (the item's payload, see ``ItemLocation``) fails its recorded CRC32C, or None.
    ``crc``: the payload's CRC32C, already taken (as its bytes arrived); else it is hashed here."""
    expected = getattr(info, "crc32c", None)
    if expected is None:
        return None
    actual = crc32c(payload) if crc is None else crc
    if actual == expected:
        return None
    return f"checksum mismatch (crc32c {actual:#010x}, expected {expected:#010x}): the stored bytes are corrupt"


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
    ``block_size`` (format ``dcp_s3/2``, raw tensor items): the payload is checked in blocks of this many
    bytes (the last one shorter); ``block_crc32c`` holds each block's CRC32C, or is None when the payload is
    one block (then ``crc32c`` is its checksum). A read of any byte range widens it to whole blocks and
    checks each. Items saved before have neither (None): only a read of the whole payload is checked.
    """

    payload_offset: int | None = None
    crc32c: int | None = None
    frames: FrameIndex | None = None
    frame_crc32c: tuple[int, ...] | None = None
    block_size: int | None = None
    block_crc32c: tuple[int, ...] | None = None


def payload_blocks(info: _StorageInfo, nbytes: int) -> tuple[int, tuple[int, ...]] | None:
    """``(block_size, one CRC32C per block)`` of a raw tensor item whose payload is ``nbytes`` long, or
    None if it was saved without block checksums (``ItemLocation``)."""
    size = getattr(info, "block_size", None)
    crc = getattr(info, "crc32c", None)
    if size is None or crc is None:
        return None
    crcs = getattr(info, "block_crc32c", None)
    return size, (crc,) if crcs is None else crcs


ItemLocation.__module__ = "dcp_s3.layout"  # the pinned stored name (module docstring)
