"""The transport ceiling: the same tensor bytes moved by boto3's own parallel multipart transfer.

No DCP, no planning, no serialization: the tensors' memory is streamed as one
object with ``upload_fileobj`` and written back in place with
``download_fileobj`` (s3transfer, 16 MiB parts, 8 threads — dcp_s3's defaults),
through file-like views over the tensors so nothing is staged whole. A partial
load is one ranged GET per wanted tensor. What this cannot beat is the server,
loopback TCP and botocore; a DCP backend close to it has little left to gain.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["save", "load"]

PART = 16 << 20
CONCURRENCY = 8


def _views(sd: dict[str, Any]) -> list[tuple[str, memoryview]]:
    import torch

    out = []
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out.append((k, v.detach().reshape(-1).view(torch.uint8).numpy().data if v.nbytes else memoryview(b"")))
    return out


class _Concat(io.RawIOBase):
    """One seekable stream over many buffers: reads copy out of them, writes copy into them."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts: list[int] = []
        pos = 0
        for v in views:
            self._starts.append(pos)
            pos += len(v)
        self._size = pos
        self._pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def _locate(self, pos: int) -> int:
        import bisect

        return max(0, bisect.bisect_right(self._starts, pos) - 1)

    def _spans(self, length: int) -> Iterator[tuple[memoryview, int, int, int]]:
        """(tensor view, offset in it, bytes, offset in the caller's buffer) from the position on."""
        n = 0
        i = self._locate(self._pos)
        while n < length and self._pos < self._size and i < len(self._views):
            v, start = self._views[i], self._starts[i]
            off = self._pos - start
            k = min(len(v) - off, length - n)
            if k > 0:
                yield v, off, k, n
                n += k
                self._pos += k
            i += 1

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        for v, off, k, at in self._spans(len(out)):
            out[at : at + k] = v[off : off + k]
            n += k
        return n

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        n = 0
        for v, off, k, at in self._spans(len(data)):
            v[off : off + k] = data[at : at + k]
            n += k
        if n != len(data):
            raise ValueError("write past the end of the destination tensors")
        return n


def _client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        config=Config(
            max_pool_connections=CONCURRENCY + 2, s3={"addressing_style": "path", "payload_signing_enabled": False}
        ),
    )


def _config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)


def save(sd: dict[str, Any], bucket: str, prefix: str) -> None:
    views = _views(sd)
    layout, pos = {}, 0
    for k, v in views:
        layout[k] = [pos, len(v)]
        pos += len(v)
    client = _client()
    client.upload_fileobj(_Concat([v for _, v in views]), bucket, f"{prefix}/blob", Config=_config())
    client.put_object(Bucket=bucket, Key=f"{prefix}/layout.json", Body=json.dumps(layout).encode())


def load(sd: dict[str, Any], bucket: str, prefix: str) -> None:
    client = _client()
    layout = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/layout.json")["Body"].read())
    views = _views(sd)
    if [k for k, _ in views] == list(layout)[: len(views)] and len(views) == len(layout):
        client.download_fileobj(bucket, f"{prefix}/blob", _Concat([v for _, v in views]), Config=_config())
        return

    # A subset of the keys: one ranged GET per tensor, straight into it.
    def fetch(item: tuple[str, memoryview]) -> None:
        key, view = item
        off, n = layout[key]
        if n == 0:
            return
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/blob", Range=f"bytes={off}-{off + n - 1}")["Body"]
        got = 0
        while got < n:
            chunk = body.read(min(1 << 20, n - got))
            if not chunk:
                raise OSError(f"short read of {key}")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(fetch, views))
