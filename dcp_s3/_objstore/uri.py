"""Checkpoint locations: ``s3://bucket/key`` told apart from local paths, parsed and checked against S3's
bucket naming rules.

:func:`s3_location` is the one place that decides whether a location is an S3 one: every writer, reader,
manager, command and integration asks it. A location that only *looks* like an ``s3://`` URI (``s3:/b/k``,
``s3//b/k``, ``S3://b/k``, ``s3:b/k``) is refused with the URI it probably meant, never taken for a local
directory named ``s3:`` (where a save would "succeed" on the node's disk and nothing would reach S3). The
one look-alike read as S3 is the fold ``pathlib`` makes of ``s3://`` (``PosixPath("s3://b/k")`` is
``s3:/b/k``): from a ``PathLike`` always, from a string where the caller says the framework folds its paths.

Nothing here knows about DCP or the S3 client.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from dcp_s3.errors import InvalidCheckpointIdError

__all__ = ["S3Uri", "parse_s3_uri", "s3_location", "bucket_name_problem", "BUCKET_RULES"]


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


#: What an S3 look-alike starts with: a scheme of any case written ``s3:`` or ``s3//`` (ASCII only).
_LOOKS_LIKE_S3 = re.compile(r"[sS]3(?::|//)")
_SCHEME = "s3://"


def s3_location(location: object, *, folded: bool = False) -> str | None:
    """The ``s3://bucket/key`` text ``location`` denotes, or None when it is not an S3 location (a local
    path, another type; another scheme is the caller's to refuse).

    A ``PathLike`` spelling ``s3:/bucket/key`` is pathlib's fold of ``s3://bucket/key`` and is read as
    that; so is such a string when ``folded`` (a framework that passes paths through ``pathlib`` or
    ``os.path.normpath`` itself). Any other look-alike (``s3:/b/k`` as a string, ``s3//b/k``, ``S3://b/k``,
    ``s3:b/k``) raises ``InvalidCheckpointIdError`` saying which URI was probably meant. The text returned
    starts with ``s3://`` and has no trailing ``/``; :func:`parse_s3_uri` checks the rest.
    """
    if not isinstance(location, (str, os.PathLike)):
        return None
    text = os.fspath(location)
    if not isinstance(text, str):
        return None
    if text.startswith(_SCHEME):
        stripped = text.rstrip("/")
        return stripped if len(stripped) > len(_SCHEME) else text
    if not _LOOKS_LIKE_S3.match(text):
        return None
    rest = text[3:].lstrip(":").lstrip("/")
    if text.startswith("s3:/") and not text.startswith("s3://") and (folded or not isinstance(location, str)):
        return (_SCHEME + rest).rstrip("/")
    raise InvalidCheckpointIdError(
        f"location {text!r} looks like an S3 URI but is not one (dcp_s3 does not take it for a local "
        f"directory); did you mean {(_SCHEME + rest)!r}?"
    )


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
