"""Where an integration's path points: the one location rule (:func:`dcp_s3._objstore.uri.s3_location`) as the
frameworks need it.

Frameworks pass their paths through ``pathlib`` and ``os.path.normpath``, which fold ``s3://bucket/key`` into
``s3:/bucket/key``; every integration reads that fold as the S3 URI it was (a string too), and refuses the other
look-alikes (``s3//b/k``, ``S3://b/k``) like the core does, never sending them to the node's local disk.
"""

from __future__ import annotations

from dcp_s3._objstore.uri import s3_location as _s3_location

__all__ = ["s3_location"]


def s3_location(path: object) -> str | None:
    """``path`` as an ``s3://bucket/key`` string (no trailing ``/``), or None when it is not an S3 location;
    ``InvalidCheckpointIdError`` for a look-alike other than pathlib's fold."""
    return _s3_location(path, folded=True)
