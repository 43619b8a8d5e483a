"""The ``.metadata`` formats: torch's pickle and dcp_s3's compact format (:mod:`~dcp_s3._metadata.formats`).

The compact format is described in :mod:`~dcp_s3._metadata.compact`, written by
:mod:`~dcp_s3._metadata.compact_write` (its entries: :mod:`~dcp_s3._metadata.compact_entries`), read
lazily from untrusted bytes by :mod:`~dcp_s3._metadata.compact_read`,
:mod:`~dcp_s3._metadata.compact_storage` and :mod:`~dcp_s3._metadata.compact_chunks`.
"""

from dcp_s3._metadata.formats import (
    METADATA_FORMATS,
    compact_wanted,
    dump_metadata,
    load_metadata,
    metadata_format_option,
)

__all__ = [
    "METADATA_FORMATS",
    "compact_wanted",
    "dump_metadata",
    "load_metadata",
    "metadata_format_option",
]
