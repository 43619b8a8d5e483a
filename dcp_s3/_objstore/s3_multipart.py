"""S3 multipart uploads: the streaming :class:`MultipartWriter` and server-side copies by part.

Abort is registered the moment an upload is created: any failure (or ``abort()``) aborts it,
so no orphan parts are left behind where the server lets us.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from crc32c import crc32c

from dcp_s3._objstore.base import ObjectWriter, PendingUpload, wait_all
from dcp_s3._objstore.buffers import BufferPool, BufferReader, fit_part_size
from dcp_s3._objstore.checksums import crc32c_combine
from dcp_s3._objstore.s3_requests import range_header
from dcp_s3.errors import DcpS3Error

__all__ = ["MultipartWriter", "abort_quietly", "copy_multipart", "direct_part_size", "COPY_PART_SIZE"]

log = logging.getLogger(__name__)

#: Bytes per UploadPartCopy part (enlarged when an object would exceed 10,000 parts).
COPY_PART_SIZE = 512 << 20


class S3Requests(Protocol):
    """What multipart uploads need of the S3 object store (``dcp_s3._objstore.s3.S3ObjectStore``)."""

    bucket: str

    def call(self, op: str, key: str | None, **kwargs: Any) -> Any: ...

    def put(self, key: str, body: bytes | bytearray, *, if_none_match: bool = False) -> str: ...

    def put_views(self, key: str, views: Sequence[memoryview], *, crc: int | None = None) -> str: ...

    def upload_checksum(self, views: Sequence[memoryview], crc: int | None = None) -> dict[str, str]: ...

    def abort_upload(self, upload: PendingUpload) -> None: ...


def abort_quietly(store: S3Requests, key: str, upload_id: str, what: str) -> None:
    try:
        store.abort_upload(PendingUpload(key, upload_id, 0.0))
        log.debug("aborted %s of s3://%s/%s", what, store.bucket, key)
    except DcpS3Error as exc:  # its parts stay stored (and billed) until someone aborts it
        warnings.warn(
            f"could not abort the {what} of s3://{store.bucket}/{key} ({exc}); its parts stay on the "
            "server until aborted (`dcp-s3 gc`, or the server's own tools)",
            RuntimeWarning,
            stacklevel=3,
        )


def copy_multipart(
    store: S3Requests,
    key: str,
    copy_source: dict[str, str],
    size: int,
    extra: dict[str, str],
    executor: ThreadPoolExecutor,
) -> None:
    """Copy ``copy_source`` (``size`` bytes) to ``key`` by concurrent UploadPartCopy requests."""
    part_size = fit_part_size(COPY_PART_SIZE, size)
    upload_id = store.call("create_multipart_upload", key, Key=key)["UploadId"]
    try:

        def copy_part(number: int, start: int) -> dict[str, Any]:
            end = min(size, start + part_size)
            resp = store.call(
                "upload_part_copy",
                key,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=copy_source,
                CopySourceRange=range_header(start, end),
                **extra,
            )
            return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

        futures = [executor.submit(copy_part, i + 1, start) for i, start in enumerate(range(0, size, part_size))]
        wait_all(futures)
        parts = [fut.result() for fut in futures]
        store.call("complete_multipart_upload", key, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
    except BaseException:
        abort_quietly(store, key, upload_id, "multipart copy")
        raise


#: Smallest write taken by reference (``write_stable``): shorter ones are copied, so that a part
#: is sent in a few large pieces rather than thousands of small ones.
MIN_BORROW = 256 << 10

#: Pieces at least this long are hashed once and their CRC combined into the part's (a combination costs
#: ~15 µs of Python, hashing this many bytes about as much); shorter ones are hashed twice instead.
COMBINE_MIN = 256 << 10


def direct_part_size(pool: BufferPool, part_size: int, expected_size: int | None) -> int:
    """The largest part of an object of ``expected_size`` bytes (borrowed views, and at most ``part_size``
    bytes copied): up to ``pool.direct_size``, but no larger than an equal share of the object among the
    pool's places (so that every upload thread still has a part of it), and never below ``part_size``. An
    object of unknown size keeps ``part_size``."""
    if expected_size is None:
        return part_size
    share = -(-expected_size // pool.count)
    share = -(-share // (1 << 20)) << 20  # whole MiB
    return max(part_size, min(pool.direct_size, share))


class _Part:
    """One part being assembled: views of the caller's memory it borrows, and the bytes copied into
    its pool buffer (taken only once something is copied), in object order, and their CRC32C."""

    __slots__ = ("pieces", "buf", "fill", "size", "crc")

    def __init__(self) -> None:
        self.pieces: list[memoryview | tuple[int, int]] = []  # a borrowed view, or (start, end) in ``buf``
        self.buf: memoryview | None = None  # a pool buffer
        self.fill = 0  # bytes of ``buf`` used
        self.size = 0  # bytes of the part
        self.crc = 0  # CRC32C of its ``size`` bytes

    def absorb(self, piece: memoryview) -> int:
        """Add ``piece`` (the part's next bytes, before ``size`` counts them) to the part's CRC32C; returns
        the piece's own CRC32C. Each byte is hashed once (twice only in pieces under ``COMBINE_MIN``)."""
        if self.size == 0:
            self.crc = crc32c(piece)
            return self.crc
        if len(piece) < COMBINE_MIN:
            self.crc = crc32c(piece, self.crc)
            return crc32c(piece)
        crc = crc32c(piece)
        self.crc = crc32c_combine(self.crc, crc, len(piece))
        return crc

    def views(self) -> list[memoryview]:
        buf = self.buf
        return [p if isinstance(p, memoryview) else buf[p[0] : p[1]] for p in self.pieces]  # type: ignore[index]


class MultipartWriter(ObjectWriter):
    """Uploads one object in parts as they fill.

    Small objects go up in one PUT on ``close``; larger ones as a multipart upload whose
    parts upload concurrently on ``executor``. Every part takes one of ``pool``'s places while it
    is assembled and sent, and a buffer of it for the bytes ``write`` copies; ``write_stable``
    bytes (at least ``MIN_BORROW`` long) are sent from the caller's memory without a copy. A part ends
    when its buffer is full (``part_size`` bytes copied) or when it reaches ``direct_part_size`` bytes
    (``pool.direct_size``, larger: the views it borrows cost no buffer). Each
    part carries its CRC32C (``S3Requests.upload_checksum``), which the server checks, made as the
    bytes are written from the CRCs of its pieces, which also give each write's CRC32C
    (``ObjectWriter.write_checked``): a save hashes each byte once.
    """

    def __init__(
        self,
        store: S3Requests,
        key: str,
        *,
        pool: BufferPool,
        executor: ThreadPoolExecutor,
        expected_size: int | None = None,
    ) -> None:
        super().__init__(key, fit_part_size(pool.size, expected_size), f"s3://{store.bucket}/{key}")
        self._direct_size = direct_part_size(pool, self.part_size, expected_size)
        self.store = store
        self._pool = pool
        self._executor = executor
        self._part: _Part | None = None
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._queued: list[_Part] = []  # the part of each future in ``_parts``

    def _open_part(self) -> _Part:
        if self._part is None:
            self._pool.reserve()
            self._part = _Part()
        return self._part

    def _write(self, view: memoryview) -> int:
        crc = 0
        while view:
            part = self._open_part()
            if part.buf is None:
                part.buf = self._pool.buffer(self.part_size)
            # Copies fill the part's buffer (part_size); borrowed views may make the part larger.
            n = min(len(view), self.part_size - part.fill, self._direct_size - part.size)
            part.buf[part.fill : part.fill + n] = view[:n]
            crc = crc32c_combine(crc, part.absorb(part.buf[part.fill : part.fill + n]), n)
            last = part.pieces[-1] if part.pieces else None
            if isinstance(last, tuple) and last[1] == part.fill:
                part.pieces[-1] = (last[0], part.fill + n)
            else:
                part.pieces.append((part.fill, part.fill + n))
            part.fill += n
            part.size += n
            view = view[n:]
            if part.fill == self.part_size or part.size == self._direct_size:
                self._submit_part()
        return crc

    def _write_stable(self, view: memoryview) -> int:
        if len(view) < MIN_BORROW:
            return self._write(view)
        crc = 0
        while view:
            part = self._open_part()
            n = min(len(view), self._direct_size - part.size)
            crc = crc32c_combine(crc, part.absorb(view[:n]), n)
            part.pieces.append(view[:n])
            part.size += n
            view = view[n:]
            if part.size == self._direct_size:
                self._submit_part()
        return crc

    def _submit_part(self) -> None:
        if self._upload_id is None:
            resp = self.store.call("create_multipart_upload", self.key, Key=self.key)
            self._upload_id = resp["UploadId"]
        # Fail fast if an earlier part already failed.
        for fut in self._parts:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        part = self._part
        assert part is not None
        self._part = None
        part_number = len(self._parts) + 1
        self._queued.append(part)
        self._parts.append(self._executor.submit(self._upload_part, part_number, part))

    def _upload_part(self, part_number: int, part: _Part) -> dict[str, Any]:
        try:
            views = part.views()
            # A file over the pieces, not bytes: botocore copies bytes-like bodies (see BufferReader).
            with BufferReader.of(views, send_block=True) as body:
                resp = self.store.call(
                    "upload_part",
                    self.key,
                    Key=self.key,
                    UploadId=self._upload_id,
                    PartNumber=part_number,
                    Body=body,
                    **self.store.upload_checksum(views, part.crc),
                )
            return {"PartNumber": part_number, "ETag": resp["ETag"]}
        finally:
            self._release(part)

    def _release(self, part: _Part) -> None:
        """Give back the part's place and buffer, and drop its views (memory it borrowed may be freed)."""
        buf, part.buf = part.buf, None
        part.pieces.clear()
        self._pool.release(buf)

    def _finish(self) -> None:
        if self._upload_id is None:
            part, self._part = self._part, None
            try:
                self.store.put_views(self.key, part.views() if part is not None else [], crc=part.crc if part else 0)
            finally:
                if part is not None:
                    self._release(part)
            return
        if self._part is not None or not self._parts:
            self._open_part()
            self._submit_part()
        wait_all(self._parts)
        parts = [fut.result() for fut in self._parts]
        self.store.call(
            "complete_multipart_upload",
            self.key,
            Key=self.key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )
        self._upload_id = None

    def _abort(self) -> None:
        """Cancel queued parts and abort the multipart upload."""
        for fut in self._parts:
            fut.cancel()
        for fut, part in zip(self._parts, self._queued, strict=True):
            if fut.cancelled():  # never ran: its place (and buffer) is still taken
                self._release(part)
            else:
                fut.exception()  # wait: a part still uploading would outlive the abort
        self._parts, self._queued = [], []  # a second abort releases nothing twice
        if self._part is not None:
            part, self._part = self._part, None
            self._release(part)
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            abort_quietly(self.store, self.key, upload_id, "multipart upload")
