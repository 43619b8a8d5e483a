"""Ranged GETs of the S3 backend (:class:`dcp_s3._objstore.s3.S3ObjectStore`): a group of coalesced reads of
one object fetched with one ranged GET, its body read straight into the reads' destinations (gaps discarded),
resumed from the last byte received when it is cut short, under the request deadline of
:mod:`dcp_s3._objstore.deadline`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from botocore.exceptions import IncompleteReadError

from dcp_s3._objstore.base import RangeRead, open_destination
from dcp_s3._objstore.deadline import body_deadline
from dcp_s3._objstore.s3_requests import BODY_ERRORS, range_header, status_of, translate_error
from dcp_s3.errors import CheckpointFormatError, S3TransferError

__all__ = ["read_group", "BODY_READ_SIZE"]

log = logging.getLogger(__name__)


class S3Reads(Protocol):
    """What ranged reads need of the S3 object store."""

    bucket: str
    max_attempts: int

    def call(self, op: str, key: str | None, **kwargs: Any) -> Any: ...

    def url(self, key: str = "") -> str: ...

    def backoff(self, attempt: int) -> None: ...


def read_group(store: S3Reads, group: list[RangeRead]) -> None:
    """Read ``group`` (coalesced reads of one object, in order) with ranged GETs into its destinations, resuming
    from the last byte received when a body is cut short, each body read under its request's deadline."""
    key = group[0].key
    start, end = group[0].start, group[-1].end
    pos = start  # next object byte to receive
    index = 0  # read in ``group`` that holds ``pos`` (or the gap before it)
    dest: memoryview | None = None
    scratch = bytearray(min(1 << 20, max(1, end - start)))
    attempt = 0
    while pos < end:
        try:
            try:
                resp = store.call("get_object", key, Key=key, Range=range_header(pos, end))
            except S3TransferError as exc:
                if status_of(exc.__cause__) != 416:  # Range Not Satisfiable: starts past the end
                    raise
                length = 0
            else:
                length = int(resp.get("ContentLength", -1))
            if length != end - pos:  # checked before any destination is opened (allocated)
                raise CheckpointFormatError(
                    f"GET s3://{store.bucket}/{key} bytes {pos}-{end}: server sent {length} bytes, "
                    f"expected {end - pos} (object shorter than the checkpoint metadata says?)"
                )
            readinto = _body_readinto(resp["Body"])
            with body_deadline("GetObject", f"{store.url(key)} bytes {pos}-{end}"):
                while pos < end:
                    read = group[index]
                    if pos < read.start:  # a gap between coalesced reads: discard
                        n = _readinto_some(readinto, memoryview(scratch)[: min(len(scratch), read.start - pos)])
                        pos += n
                        continue
                    if dest is None:
                        dest = open_destination(read, store.url(key))
                    n = _readinto_some(readinto, dest[pos - read.start :])
                    if read.received is not None:
                        read.received(dest[pos - read.start : pos - read.start + n])
                    pos += n
                    if pos == read.end:
                        if read.done is not None:
                            read.done()
                        dest = None
                        index += 1
            resp["Body"].close()  # its connection is back in the pool: urllib3 saw the body end
        except BODY_ERRORS as exc:
            attempt += 1
            if attempt >= store.max_attempts:
                raise translate_error(exc, "GET", store.bucket, key) from exc
            log.debug("GET s3://%s/%s from byte %d failed (%s); retrying", store.bucket, key, pos, exc)
            store.backoff(attempt)


#: The most one read of a GET body asks for: urllib3 reads into a new bytes object and then copies it
#: (so a read's size is transient memory per concurrent GET), and at 1 MiB the extra copy costs nothing
#: measurable (``benchmarks/README.md``, "Reading GET bodies").
BODY_READ_SIZE = 1 << 20


def _body_readinto(body: Any) -> Callable[[memoryview], int]:
    """A ``readinto`` for a botocore streaming body, through its public ``readinto`` (botocore's,
    then urllib3's): urllib3 sees the body end, and hands its connection back to the pool then, so
    the next GET reuses the kept-alive connection instead of opening one (and, over HTTPS, a TLS
    session)."""

    def readinto(buf: memoryview) -> int:
        return int(body.readinto(buf[:BODY_READ_SIZE]))

    def read_and_copy(buf: memoryview) -> int:  # botocore < 1.38.20: its StreamingBody has no readinto
        data = body.read(min(len(buf), BODY_READ_SIZE))
        buf[: len(data)] = data
        return len(data)

    return readinto if hasattr(body, "readinto") else read_and_copy


def _readinto_some(readinto: Callable[[memoryview], int], buf: memoryview) -> int:
    """Receive up to ``len(buf)`` bytes; the caller advances by what arrived, so a body
    cut short is resumed from the last byte received."""
    n = readinto(buf)
    if not n:
        raise IncompleteReadError(actual_bytes=0, expected_bytes=len(buf))
    return n
