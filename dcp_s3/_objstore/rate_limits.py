"""What S3 rate-limits together, and which of its answers mean "slow down".

S3 limits request rates per partitioned key prefix, for reads (GET/HEAD) and writes (PUT/POST/DELETE)
apart: a :class:`RateKey` is that unit (bucket, the key's directory, class), :func:`rate_key` the key of
one request. :func:`is_throttle` tells a refusal from an answer by error code and HTTP status, never by
message text. Shared by the pacing (:mod:`dcp_s3._objstore.throttle`), the hooks that connect it to a
client (:mod:`dcp_s3._objstore.rate_hooks`) and the retries of :mod:`dcp_s3._objstore.s3_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "RateKey",
    "is_throttle",
    "rate_key",
    "THROTTLE_CODES",
    "THROTTLE_STATUSES",
]

#: Error codes that mean "too many requests" (S3's SlowDown and the codes botocore treats as throttling).
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "SlowDownRead",
        "SlowDownWrite",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestThrottled",
        "LimitExceededException",
        "ProvisionedThroughputExceededException",
    }
)
#: HTTP statuses that mean the same whatever the code (a 503 without a body, a proxy's 429).
THROTTLE_STATUSES = frozenset({429, 503})
#: Operations of the read class (S3's GET/HEAD limit); every other one is a write (PUT/POST/DELETE).
READ_OPERATIONS = frozenset(
    {
        "GetObject",
        "HeadObject",
        "HeadBucket",
        "ListObjects",
        "ListObjectsV2",
        "ListParts",
        "ListMultipartUploads",
    }
)


@dataclass(frozen=True, slots=True)
class RateKey:
    """What S3 rate-limits together: a bucket, a key prefix (the key's directory) and a request class."""

    bucket: str
    prefix: str
    kind: str  # "read" or "write"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} ({self.kind})"

    @property
    def parent(self) -> tuple[str, str, str]:
        """Bucket, parent prefix and class: what the keys of successive checkpoints under one root share."""
        return self.bucket, self.prefix.rstrip("/").rpartition("/")[0], self.kind


def rate_key(operation: str, bucket: str, key: str | None) -> RateKey:
    """The :class:`RateKey` of ``operation`` on ``key`` (a listing's prefix, or None for the bucket)."""
    prefix = key.rpartition("/")[0] + "/" if key and "/" in key else ""
    return RateKey(bucket, prefix, "read" if operation in READ_OPERATIONS else "write")


def is_throttle(status: int | None, code: str | None) -> bool:
    """Whether an answer tells the client to slow down (decided by code and status, never by message)."""
    return (code or "") in THROTTLE_CODES or status in THROTTLE_STATUSES
