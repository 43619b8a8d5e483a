"""The stored format of the byte-grouped, frame-indexed, parallel zstd codec (face: :mod:`dcp_s3.codec`).

An item's raw bytes are cut into independent *frames* of ``frame_size`` raw bytes
(a multiple of the element size; the last frame may be shorter). Each frame is
compressed on its own, so a reader fetches and decompresses only the frames a
ranged read touches, and frames (de)compress in parallel on a thread pool
(python-zstandard and numpy release the GIL).

Floating-point frames are *byte grouped* first: every element is rotated left by
one bit (the sign moves next to the mantissa, so the top byte is the whole
exponent for bf16/fp32/fp64-like layouts) and its bytes are split into planes,
most significant plane first. The exponent plane is low-entropy; the mantissa
planes are near-random and zstd stores them as raw blocks at memcpy speed. A
frame whose zstd output does not shrink is stored raw (not grouped).

Stored format of frame ``i``, ``n`` its raw length, ``es`` the element size and
``ne = n // es``, in both versions:

- raw frame (bit ``i`` of ``FrameIndex.raw_frames``): the ``n`` raw bytes;
- ``GROUP_NONE``: one or more concatenated zstd frames decompressing to the raw bytes.

``GROUP_FLOAT`` frames, codec version 1: one or more concatenated zstd frames decompressing
to ``es`` planes of ``ne`` bytes, plane ``p`` holding byte ``es - 1 - p`` (little-endian) of
each element rotated left by one bit, then the ``n - ne * es`` trailing raw bytes. (The
encoder wrote one zstd frame; readers accept several.)

``GROUP_FLOAT`` frames, codec version 2 (what new saves write, :data:`CODEC_VERSION`):

- an 8-byte header: ``T`` and ``R``, little-endian uint32, the stored lengths of the next two sections;
- the *top plane*, ``T`` bytes: byte ``es - 1`` (little-endian, not rotated) of every element,
  ``ne`` bytes; stored raw if ``T == ne``, else (``0 < T < ne``) zstd frames decompressing to them;
- the *rest*, ``R`` bytes: bytes ``0 .. es - 2`` of every element, in element order,
  ``ne * (es - 1)`` bytes; raw if ``R`` equals that, else (``0 < R <`` that) zstd;
- the ``n - ne * es`` trailing raw bytes. ``8 + T + R`` plus their number is the frame's stored length.

Version 2 keeps the byte that compresses (sign and exponent) apart and leaves the mantissa
bytes, which do not, as they are: decoding reads them straight from the stored bytes
(:mod:`dcp_s3._codec.v2`).

Everything a reader needs is in a :class:`FrameIndex` that the writer stores in
the checkpoint metadata; :func:`stored_span` maps a raw byte range to the frame
aligned stored span to fetch and :meth:`Codec.decode_into` decodes it. Decoders
are looked up by ``(codec, version)`` in :data:`DECODERS`, the one list of what a
reader accepts; an unknown pair raises :class:`~dcp_s3.errors.CheckpointFormatError`.

Modules: this one holds the stored format (constants, :class:`FrameIndex`, the
registry); :mod:`dcp_s3._codec.v1` and :mod:`dcp_s3._codec.v2` encode and decode one frame of
versions 1 and 2;
:mod:`dcp_s3._codec.byte_planes` does the byte grouping; :mod:`dcp_s3._codec.engine` holds
:class:`Codec`, which runs frames on a thread pool. Stored ``.metadata`` pickles name
``dcp_s3.codec.FrameIndex`` (every release so far): its ``__module__`` is that path, the face
re-exports it.

This module does not import torch.
"""

from __future__ import annotations

import copyreg
import importlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType, ModuleType
from typing import Any, Final

import numpy as np

from dcp_s3._codec.byte_planes import UINT
from dcp_s3.errors import CheckpointFormatError

__all__ = [
    "CODEC_NAME",
    "CODEC_VERSION",
    "GROUP_NONE",
    "GROUP_FLOAT",
    "DECODERS",
    "FrameIndex",
    "stored_span",
    "grouping_for_dtype",
    "supported",
    "decoder_for",
    "accepts",
]

CODEC_NAME: Final = "dcp_s3.zstd-frames"
CODEC_VERSION: Final = 2
"""The version new saves write (every version in :data:`DECODERS` is read)."""
GROUP_NONE: Final = 0
"""Frames hold plain zstd of the raw bytes."""
GROUP_FLOAT: Final = 1
"""Frames hold zstd of the byte planes of the elements rotated left by one bit."""

DEFAULT_FRAME_SIZE: Final = 4 << 20
#: Largest frame a reader accepts: bounds the scratch memory a (lying) frame index can ask for.
MAX_FRAME_SIZE: Final = 64 << 20

#: The registry: ``(codec, version)`` -> the module that decodes its frames (``check_index``,
#: ``decode_frame``). What a reader accepts is exactly this; nothing else lists codecs.
DECODERS: Final[Mapping[tuple[str, int], str]] = MappingProxyType(
    {
        (CODEC_NAME, 1): "dcp_s3._codec.v1",
        (CODEC_NAME, 2): "dcp_s3._codec.v2",
    }
)


@dataclass(frozen=True, slots=True)
class FrameIndex:
    """Where each frame of one encoded item is stored. Picklable and compact.

    Frame ``i`` covers raw bytes ``[i * frame_size, min((i + 1) * frame_size,
    raw_length))`` and stored bytes ``[ends[i - 1] (0 for i == 0), ends[i])``,
    both relative to the item start.
    """

    codec: str
    version: int
    element_size: int
    grouping: int
    """``GROUP_NONE`` or ``GROUP_FLOAT``."""
    raw_length: int
    frame_size: int
    ends: tuple[int, ...]
    """Stored end offset of every frame (end exclusive, relative to the item start)."""
    raw_frames: int = 0
    """Bit mask: bit ``i`` set means frame ``i`` is stored raw (uncompressed, ungrouped)."""

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        # Values come from checkpoint metadata: check types first (bool is not an int here).
        ints = (self.version, self.element_size, self.grouping, self.raw_length, self.frame_size, self.raw_frames)
        if type(self.codec) is not str or any(type(v) is not int for v in ints) or type(self.ends) is not tuple:
            raise CheckpointFormatError("bad frame index: a field has the wrong type")
        if not 1 <= self.element_size <= self.frame_size <= MAX_FRAME_SIZE or self.frame_size % self.element_size:
            raise CheckpointFormatError(
                f"bad frame index: frame_size {self.frame_size} must be a multiple of element_size "
                f"{self.element_size} and at most {MAX_FRAME_SIZE}"
            )
        if self.raw_length < 0 or len(self.ends) != -(-self.raw_length // self.frame_size):
            raise CheckpointFormatError(
                f"bad frame index: {len(self.ends)} frames for {self.raw_length} raw bytes "
                f"in frames of {self.frame_size}"
            )
        if any(type(e) is not int for e in self.ends):
            raise CheckpointFormatError("bad frame index: a stored offset is not an integer")
        if (
            any(b < a for a, b in itertools.pairwise((0, *self.ends)))
            or self.raw_frames < 0
            or self.raw_frames >> len(self.ends)
        ):
            raise CheckpointFormatError("bad frame index: stored offsets decrease or raw_frames has extra bits")

    # Pickled as the class plus a state tuple, so a restricted unpickler only has
    # to allow ``dcp_s3.codec.format.FrameIndex``, and an index written by a newer codec
    # (with other fields) fails with a message naming that codec.
    def __reduce__(self) -> tuple[Any, ...]:
        state = tuple(getattr(self, f) for f in _FIELDS)
        return (copyreg.__newobj__, (type(self),), state)  # type: ignore[attr-defined]

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        if not isinstance(state, tuple) or len(state) != len(_FIELDS):
            codec, version = (state[0], state[1]) if isinstance(state, tuple) and len(state) > 1 else ("?", "?")
            codec = codec if isinstance(codec, str) and len(codec) <= 60 else "?"
            version = version if type(version) is int and abs(version) < 1 << 32 else "?"
            raise CheckpointFormatError(
                f"cannot read the frame index of codec {codec!r} version {version}: this dcp_s3 reads {supported()}"
            )
        for name, value in zip(_FIELDS, state, strict=True):
            object.__setattr__(self, name, value)
        self._validate()

    @property
    def num_frames(self) -> int:
        return len(self.ends)

    @property
    def stored_length(self) -> int:
        """Total stored bytes of the item."""
        return self.ends[-1] if self.ends else 0

    def is_raw(self, i: int) -> bool:
        return bool(self.raw_frames >> i & 1)

    def stored_range(self, i: int) -> tuple[int, int]:
        """Stored bytes ``[start, end)`` of frame ``i``."""
        return (self.ends[i - 1] if i else 0, self.ends[i])

    def raw_range(self, i: int) -> tuple[int, int]:
        """Raw bytes ``[start, end)`` of frame ``i``."""
        start = i * self.frame_size
        return (start, min(start + self.frame_size, self.raw_length))


_FIELDS: Final = tuple(f.name for f in fields(FrameIndex))


FrameIndex.__module__ = "dcp_s3.codec"  # the pinned stored name (module docstring)


def stored_span(index: FrameIndex, raw_start: int, raw_end: int) -> tuple[int, int]:
    """The frame-aligned stored byte span ``[start, end)`` holding raw ``[raw_start, raw_end)``.

    Offsets are relative to the item start; an empty range gives ``(0, 0)``.
    """
    first, last = frame_range(index, raw_start, raw_end)
    if first > last:
        return (0, 0)
    return (index.stored_range(first)[0], index.ends[last])


def grouping_for_dtype(dtype: Any) -> tuple[int, bool]:
    """``(element_size, floating)`` to pass to :meth:`Codec.encode` for a torch (or numpy) dtype.

    Complex dtypes are grouped per real component; 1-byte types (bool, int8,
    fp8) are not grouped. Does not import torch.
    """
    itemsize = int(dtype.itemsize)
    if isinstance(dtype, np.dtype):
        floating, complex_ = dtype.kind == "f", dtype.kind == "c"
    else:
        floating, complex_ = bool(dtype.is_floating_point), bool(dtype.is_complex)
    if complex_:
        return (itemsize // 2, True)
    return (itemsize, floating and itemsize in UINT)


def supported() -> str:
    """The codecs this dcp_s3 reads, for error messages."""
    return ", ".join(f"{name!r} version {v}" for name, v in sorted(DECODERS))


def accepts(descriptors: Sequence[str], index: FrameIndex) -> bool:
    """Whether a reader decodes an item stored with ``transform_descriptors`` ``descriptors`` and
    frame index ``index``: the descriptors name exactly the index's codec (``<codec>/<version>``)
    and :data:`DECODERS` has it."""
    return list(descriptors) == [f"{index.codec}/{index.version}"] and (index.codec, index.version) in DECODERS


def decoder_for(index: FrameIndex) -> ModuleType:
    """The module decoding ``index``'s frames; ``CheckpointFormatError`` for a codec/version not in :data:`DECODERS`."""
    module = DECODERS.get((index.codec, index.version))
    if module is None:
        raise CheckpointFormatError(
            f"unknown codec {index.codec!r} version {index.version}: this dcp_s3 reads {supported()}"
        )
    return importlib.import_module(module)


def frame_range(index: FrameIndex, raw_start: int, raw_end: int) -> tuple[int, int]:
    """The first and last frame holding raw ``[raw_start, raw_end)``; ``(1, 0)`` for an empty range."""
    if not 0 <= raw_start <= raw_end <= index.raw_length:
        raise CheckpointFormatError(
            f"raw range [{raw_start}, {raw_end}) is outside the item's {index.raw_length} bytes (frame index)"
        )
    if raw_start == raw_end:
        return (1, 0)
    return (raw_start // index.frame_size, (raw_end - 1) // index.frame_size)
