"""The naive S3 backend common in training code: a ``FileSystemBase`` with a ``BytesIO`` per file.

Writing buffers the whole data file in memory and uploads it with boto3's
``upload_fileobj`` when DCP closes the stream; reading downloads the whole
object into memory before DCP parses a single item. It plugs into torch's
``FileSystemWriter``/``FileSystemReader`` the way ``FsspecWriter`` plugs fsspec in
(``torch/distributed/checkpoint/_fsspec_filesystem.py``): construct the stock
class, then swap ``self.fs`` and re-run ``init_path``. Commit is torch's
``.metadata.tmp`` + rename, i.e. a server-side copy and a delete.

Memory: a save holds the whole ``__0_0.distcp`` (all of a rank's tensors) plus
s3transfer's in-flight part copies; a load holds the whole object plus one
``torch.load``-ed item at a time. Only the client settings are shared with
dcp_s3 (path-style addressing, no SHA-256 payload signing over plain HTTP) so
the benchmark compares designs, not signing.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

__all__ = ["NaiveS3FileSystem", "NaiveS3Writer", "NaiveS3Reader"]


def _split(path: str | os.PathLike[str]) -> tuple[str, str]:
    s = os.fspath(path)
    if not s.startswith("s3://"):
        raise ValueError(f"not an s3:// path: {s!r}")
    bucket, _, key = s[len("s3://") :].partition("/")
    return bucket, key


class _UploadOnClose(io.BytesIO):
    """A ``BytesIO`` that uploads its content when closed (DCP closes the stream itself)."""

    def __init__(self, fs: NaiveS3FileSystem, path: str) -> None:
        super().__init__()
        self._fs, self._path, self._uploaded = fs, path, False

    def discard(self) -> None:
        """Close without uploading (the write failed)."""
        self._uploaded = True
        super().close()

    def close(self) -> None:
        if not self._uploaded and not self.closed:
            self._uploaded = True
            self.seek(0)
            bucket, key = _split(self._path)
            self._fs.client.upload_fileobj(self, bucket, key)
        super().close()


class NaiveS3FileSystem(FileSystemBase):
    """Whole-file buffering over boto3; ``credential_path`` is a JSON of boto3 client kwargs."""

    def __init__(self, credential_path: str | None = None, client_kwargs: dict[str, Any] | None = None) -> None:
        self._credential_path = credential_path
        self._client_kwargs = dict(client_kwargs or {})
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            kwargs = dict(self._client_kwargs)
            if self._credential_path:
                with open(self._credential_path) as f:
                    kwargs.update(json.load(f))
            kwargs.setdefault("config", Config(s3={"addressing_style": "path", "payload_signing_enabled": False}))
            self._client = boto3.client("s3", **kwargs)
        return self._client

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if mode == "wb":
            stream = _UploadOnClose(self, path)
            try:
                yield stream
            except BaseException:
                stream.discard()
                raise
            stream.close()  # a no-op when DCP already closed it
        elif mode == "rb":
            buf = io.BytesIO()
            bucket, key = _split(path)
            self.client.download_fileobj(bucket, key, buf)
            buf.seek(0)
            yield buf
        else:
            raise ValueError(f"unsupported mode {mode!r}")

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return os.fspath(path).rstrip("/")

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        bucket, key = _split(path)
        _, new_key = _split(new_path)
        self.client.copy_object(Bucket=bucket, Key=new_key, CopySource={"Bucket": bucket, "Key": key})
        self.client.delete_object(Bucket=bucket, Key=key)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass  # object stores have no directories

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str) and checkpoint_id.startswith("s3://")

    def exists(self, path: str | os.PathLike[str]) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = _split(path)
        try:
            self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise
        return True

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        bucket, key = _split(path)
        self.client.delete_object(Bucket=bucket, Key=key)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        bucket, key = _split(path)
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/")
        return [f"s3://{bucket}/{o['Key']}" for page in pages for o in page.get("Contents", [])]


class NaiveS3Writer(FileSystemWriter):
    """``FileSystemWriter`` over ``NaiveS3FileSystem`` (torch defaults: one file per rank, one thread)."""

    def __init__(
        self,
        path: str,
        *,
        credential_path: str | None = None,
        client_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # No fsync: a BytesIO has no file descriptor, and torch would fall back to os.sync().
        kwargs.setdefault("sync_files", False)
        super().__init__(path, **kwargs)
        self.fs = NaiveS3FileSystem(credential_path, client_kwargs)  # type: ignore[assignment]
        self.path = self.fs.init_path(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return NaiveS3FileSystem.validate_checkpoint_id(checkpoint_id)


class NaiveS3Reader(FileSystemReader):
    """``FileSystemReader`` over ``NaiveS3FileSystem``: whole-object downloads, one file at a time."""

    def __init__(
        self, path: str, *, credential_path: str | None = None, client_kwargs: dict[str, Any] | None = None
    ) -> None:
        super().__init__(path)
        self.fs = NaiveS3FileSystem(credential_path, client_kwargs)  # type: ignore[assignment]
        self.path = self.fs.init_path(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return NaiveS3FileSystem.validate_checkpoint_id(checkpoint_id)
