"""The checkpoint codec: byte-grouped, frame-indexed, parallel zstd (no torch).

The stored format (constants, :class:`FrameIndex`, the registry of decoders) is
:mod:`dcp_s3._codec.format`; :class:`Codec` (:mod:`dcp_s3._codec.engine`) encodes and decodes
items frame by frame on a thread pool; :mod:`dcp_s3._codec.frame_table` holds many frame
indexes as arrays. ``dcp_s3.codec.FrameIndex`` is a pinned stored name.
"""

from dcp_s3._codec.engine import Codec
from dcp_s3._codec.format import (
    CODEC_NAME,
    CODEC_VERSION,
    DECODERS,
    DEFAULT_FRAME_SIZE,
    GROUP_FLOAT,
    GROUP_NONE,
    MAX_FRAME_SIZE,
    FrameIndex,
    accepts,
    decoder_for,
    grouping_for_dtype,
    stored_span,
    supported,
)

__all__ = [
    "CODEC_NAME",
    "CODEC_VERSION",
    "DECODERS",
    "DEFAULT_FRAME_SIZE",
    "GROUP_FLOAT",
    "GROUP_NONE",
    "MAX_FRAME_SIZE",
    "Codec",
    "FrameIndex",
    "accepts",
    "decoder_for",
    "grouping_for_dtype",
    "stored_span",
    "supported",
]
