"""The byte streams behind :class:`dcp_s3.integrations.torch_checkpointing.S3Storage`: bounded memory both ways.

torch_checkpointing serializes each item with ``torch.save`` into the stream ``Storage.stream_write``
returns, and loads either with ``torch.load`` on the stream ``Storage.stream_read`` returns (small
reads and seeks through the zip container) or by ``readinto`` of the whole file into one mmap-like
buffer. Both are served here without holding an object in memory:

- :class:`ObjectWriteStream` feeds an :class:`~dcp_s3._objstore.base.ObjectWriter` (a multipart upload on
  S3, parts sent concurrently from the store's buffer pool: at most ``max_concurrency + 2`` parts in
  memory). The object appears whole on a clean ``close``; an exception inside the ``with`` block
  aborts it, leaving no object and no orphan upload.
- :class:`ObjectReadStream` is a seekable ``RawIOBase``: a ``readinto`` of at least one range
  (``max_range_size``) goes straight into the caller's buffer as concurrent ranged GETs; smaller reads
  come from one cached window of ``max_range_size`` bytes. The object's size and ETag were fixed when
  the stream was opened (by the caller, from the commit marker); every range is checked against that
  size, so a shorter object fails instead of returning short data.
"""

from __future__ import annotations

import io
from typing import Any

from dcp_s3._dcp.store import Store
from dcp_s3._objstore.base import ObjectWriter, RangeRead
from dcp_s3.errors import CheckpointFormatError, ConfigError

__all__ = ["ObjectWriteStream", "ObjectReadStream"]


class ObjectWriteStream(io.RawIOBase):
    """A write-only stream creating one object; it appears on ``close`` (aborted if the ``with`` block raises)."""

    def __init__(self, writer: ObjectWriter, where: str) -> None:
        super().__init__()
        self._writer = writer
        self._where = where
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._writer.write(data)

    def tell(self) -> int:
        return self._writer.tell()

    def abort(self) -> None:
        """Drop the object being written (nothing becomes visible)."""
        if not self._done:
            self._done = True
            self._writer.abort()
        super().close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._writer.close()
        super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __del__(self) -> None:  # an abandoned stream never publishes a partial object
        if not self._done:
            try:  # noqa: SIM105 -- not contextlib.suppress: at interpreter shutdown that global may be gone
                self._writer.abort()
            except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
                pass


class ObjectReadStream(io.RawIOBase):
    """A seekable read stream over ``name`` of ``store`` (``size`` bytes), served by ranged GETs."""

    def __init__(self, store: Store, name: str, size: int) -> None:
        super().__init__()
        self._store = store
        self._name = name
        self._size = size
        self._pos = 0
        self._step = max(1, store.session.transfer.max_range_size)
        self._window_start = 0
        self._window = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ConfigError(f"seek to {base + offset} before the start of {self._store.url(self._name)}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        want = min(len(target), max(0, self._size - self._pos))
        if want == 0:
            return 0
        if want >= self._step:
            self._fetch(self._pos, target[:want])
        else:
            cached = self._pos - self._window_start
            if cached < 0 or cached + want > len(self._window):
                end = min(self._size, self._pos + self._step)
                window = bytearray(end - self._pos)
                self._fetch(self._pos, memoryview(window))
                self._window_start, self._window = self._pos, bytes(window)
                cached = 0
            target[:want] = self._window[cached : cached + want]
        self._pos += want
        return want

    def readall(self) -> bytes:
        out = bytearray(max(0, self._size - self._pos))
        if out:
            self._fetch(self._pos, memoryview(out))
            self._pos = self._size
        return bytes(out)

    def _fetch(self, start: int, into: memoryview) -> None:
        """Fill ``into`` with bytes ``[start, start + len(into))``, ``max_range_size`` per GET, concurrently."""
        reads = [
            RangeRead(
                self._store.key(self._name),
                start + off,
                start + min(len(into), off + self._step),
                _view(into, off, self._step),
            )
            for off in range(0, len(into), self._step)
        ]
        try:
            self._store.object_store.read_ranges(
                reads, executor=self._store.session.executor, max_gap=0, max_size=self._step
            )
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(
                f"{self._store.url(self._name)} is shorter than the {self._size} bytes its commit recorded: {exc}"
            ) from exc


def _view(into: memoryview, off: int, step: int) -> Any:
    return lambda: into[off : off + step]
