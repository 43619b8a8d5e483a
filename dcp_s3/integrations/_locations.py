"""Where an integration's path points: the one location rule (:func:`dcp_s3._objstore.uri.s3_location`) as the
frameworks need it.

Frameworks pass their paths through ``pathlib`` and ``os.path.normpath``, which fold ``s3://bucket/key`` into
``s3:/bucket/key``; every integration reads that fold as the S3 URI it was (a string too), and refuses the other
look-alikes (``s3//b/k``, ``S3://b/k``) like the core does, never sending them to the node's local disk.
"""

from __future__ import annotations

from dcp_s3._objstore.uri import parse_s3_uri
from dcp_s3._objstore.uri import s3_location as _s3_location

__all__ = ["s3_location", "s3_root"]


def s3_location(path: object, *, folded: bool = True) -> str | None:
    """``path`` as an ``s3://bucket/key`` string (no trailing ``/``), or None when it is not an S3 location;
    ``InvalidCheckpointIdError`` for a look-alike other than pathlib's fold. ``folded=False``: a *string*
    ``s3:/b/k`` is a look-alike too (where the user's own text arrives untouched, as in ``dcp.save``)."""
    return _s3_location(path, folded=folded)


def s3_root(text: str) -> str:
    """``text``, an ``s3://bucket[/key]`` root (a bucket alone is one), without a trailing ``/``;
    ``InvalidCheckpointIdError`` for anything else."""
    parse_s3_uri(text, require_key=False)
    return text.rstrip("/")
