"""Checkpoint URIs: ``s3://bucket/key`` parsed and checked against S3's bucket naming rules.

Nothing here knows about DCP or the S3 client.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from dcp_s3.errors import InvalidCheckpointIdError

__all__ = ["S3Uri", "parse_s3_uri", "bucket_name_problem", "BUCKET_RULES"]


@dataclass(frozen=True, slots=True)
class S3Uri:
    """A parsed ``s3://bucket/key`` location; ``key`` has no leading or trailing slash."""

    bucket: str
    key: str

    def join(self, name: str) -> str:
        """The object key of ``name`` under this prefix."""
        return f"{self.key}/{name}" if self.key else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


_BUCKET_CHARS = re.compile(r"[a-z0-9][a-z0-9.-]*[a-z0-9]")
#: S3's bucket naming rules, quoted in every error about a bucket name.
BUCKET_RULES = (
    "S3 bucket names are 3-63 characters of lowercase letters, digits, dots and hyphens, start and end "
    "with a letter or digit, contain no '..' and are not an IP address"
)


def bucket_name_problem(bucket: str) -> str | None:
    """Why ``bucket`` breaks S3's bucket naming rules, or None if it follows them."""
    if not 3 <= len(bucket) <= 63:
        return f"is {len(bucket)} characters long"
    if not _BUCKET_CHARS.fullmatch(bucket):
        return "holds a character other than a-z, 0-9, '.', '-' or does not start and end with a letter or digit"
    if ".." in bucket:
        return "contains '..'"
    try:
        ipaddress.IPv4Address(bucket)
    except ValueError:
        return None
    return "is formatted as an IP address"


def parse_s3_uri(uri: str | os.PathLike[str], *, require_key: bool = True) -> S3Uri:
    """Parse ``s3://bucket/key...``; reject other schemes, local paths, a missing key and bad bucket names."""
    if not isinstance(uri, str):
        raise InvalidCheckpointIdError(
            f"checkpoint id {os.fspath(uri)!r} is a local path; dcp_s3 needs an s3://bucket/key URI"
        )
    if not uri.startswith("s3://"):
        scheme = uri.split("://", 1)[0] + "://" if "://" in uri else None
        what = f"has scheme {scheme!r}" if scheme else "is not a URI"
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r} {what}; expected s3://bucket/key")
    bucket, _, key = uri[len("s3://") :].partition("/")
    key = key.strip("/")
    if not bucket:
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r} names no bucket; expected s3://bucket/key")
    problem = bucket_name_problem(bucket)
    if problem:
        raise InvalidCheckpointIdError(
            f"checkpoint id {uri!r}: {bucket!r} is not a valid bucket name: it {problem} ({BUCKET_RULES})"
        )
    if require_key and not key:
        raise InvalidCheckpointIdError(
            f"checkpoint id {uri!r} names a bucket but no key prefix; expected s3://{bucket}/some/prefix"
        )
    if any(part in (".", "..") for part in key.split("/")):
        raise InvalidCheckpointIdError(f"checkpoint id {uri!r} contains '.' or '..' path segments")
    return S3Uri(bucket, key)
