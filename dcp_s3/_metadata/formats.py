"""The ``.metadata`` formats: torch's pickle (any reader) and dcp_s3's compact format.

``dump_metadata`` writes either; ``load_metadata`` reads either from untrusted bytes and
validates every field (:mod:`dcp_s3._untrusted.metadata_pickle` for what the unpickler admits,
:mod:`dcp_s3._untrusted.metadata_check` for what is validated, :mod:`dcp_s3._metadata.compact` for
the compact format).
"""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.metadata import Metadata

from dcp_s3._layout import ItemLocation
from dcp_s3._metadata.compact import MAGIC as COMPACT_MAGIC
from dcp_s3._metadata.compact import chunk_count
from dcp_s3._metadata.compact_read import load_compact, materialize
from dcp_s3._metadata.compact_write import dump_compact
from dcp_s3._untrusted.metadata_check import check_metadata
from dcp_s3._untrusted.metadata_pickle import budget_for, describe, unpickle_metadata
from dcp_s3.errors import CheckpointFormatError, ConfigError

__all__ = [
    "METADATA_FORMATS",
    "AUTO_COMPACT_CHUNKS",
    "metadata_format_option",
    "compact_wanted",
    "dump_metadata",
    "load_metadata",
]


#: ``metadata_format`` values of ``dump_metadata`` (and ``S3StorageWriter``).
METADATA_FORMATS = ("dcp", "compact", "auto")
#: ``"auto"`` writes the compact format above this many tensor chunks: a stock pickle of that many is
#: ~8 MB, ~2 s of restricted unpickling on every rank (docs/many-ranks.md, "Compact metadata").
AUTO_COMPACT_CHUNKS = 50_000


def metadata_format_option(metadata_format: object) -> str:
    """``metadata_format`` if it is one of ``METADATA_FORMATS``, else a ``ConfigError`` naming it."""
    if metadata_format not in METADATA_FORMATS:
        raise ConfigError(f"metadata_format={metadata_format!r}: expected one of {', '.join(METADATA_FORMATS)}")
    return str(metadata_format)


def compact_wanted(metadata: Metadata, metadata_format: str) -> bool:
    """Whether ``metadata_format`` asks for the compact format for ``metadata`` (``"auto"``: above
    ``AUTO_COMPACT_CHUNKS`` chunks; the writer falls back to the pickle where it cannot be)."""
    metadata_format_option(metadata_format)
    return metadata_format == "compact" or (metadata_format == "auto" and chunk_count(metadata) > AUTO_COMPACT_CHUNKS)


def dump_metadata(metadata: Metadata, metadata_format: str = "dcp") -> bytes:
    """``.metadata`` bytes: ``"dcp"`` torch's pickle (any reader), ``"compact"`` dcp_s3's compact
    format (:mod:`dcp_s3._metadata.compact`), ``"auto"`` compact above ``AUTO_COMPACT_CHUNKS`` when it can be."""
    if compact_wanted(metadata, metadata_format):
        try:
            return dump_compact(metadata)
        except ConfigError:
            if metadata_format == "compact":
                raise
    return pickle.dumps(materialize(metadata), protocol=pickle.HIGHEST_PROTOCOL)


def load_metadata(data: bytes, where: str) -> Metadata:
    """Decode ``.metadata`` bytes, compact or pickled (restricted unpickler), and validate every field.

    Any failure is a ``CheckpointFormatError`` naming ``where`` (module docstring).
    """
    try:
        if data[: len(COMPACT_MAGIC)] == COMPACT_MAGIC:
            return load_compact(data, where)
        return check_metadata(unpickle_metadata(data, (ItemLocation,)), budget_for(len(data)))
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from None
    except Exception as exc:
        raise CheckpointFormatError(
            f"{where} is not a DCP metadata file ({type(exc).__name__}: {describe(str(exc))})"
        ) from None
