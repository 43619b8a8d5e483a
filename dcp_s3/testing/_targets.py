"""Where :class:`~dcp_s3.testing.StoreConformance` runs: a :class:`Target`, one place checkpoints are stored.

A target is a root location (``s3://bucket/prefix`` or a local directory), the storage options that
reach it, and :class:`Raw` access to its objects that does not go through dcp_s3 (boto3 or ``os``:
:class:`S3Raw`, :class:`LocalRaw`, or a class of the backend's own). The suite stores and loads through
the target's writer and reader, and with its raw access looks at what was stored and damages it the
way a crash or a bad disk would. These live apart from the suite's tests so that a backend's own
test module builds its ``target`` fixture from them alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from botocore.exceptions import ClientError
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_s3 import S3StorageReader, S3StorageWriter

__all__ = ["Raw", "S3Raw", "LocalRaw", "Target"]


# -- access to stored objects that bypasses dcp_s3 ----------------------------------------------------
class Raw(Protocol):
    """Objects under a target's root, named relative to it with ``/``."""

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` and its size."""

    def read(self, name: str) -> bytes: ...

    def write(self, name: str, data: bytes) -> None: ...

    def start_upload(self, name: str) -> str | None:
        """Start a multipart upload of ``name`` and leave it unfinished (None: the backend has no uploads)."""

    def uploads(self) -> list[str] | None:
        """Names with an unfinished multipart upload; None if the server cannot list them."""


class S3Raw:
    """A bucket prefix through a boto3 client of the test's own."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix.strip("/") + "/"

    def sizes(self, prefix: str = "") -> dict[str, int]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        return {o["Key"][len(self.prefix) :]: int(o["Size"]) for p in pages for o in p.get("Contents", [])}

    def read(self, name: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read())

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data)

    def start_upload(self, name: str) -> str | None:
        return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=self.prefix + name)["UploadId"])

    def uploads(self) -> list[str] | None:
        try:
            resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NotImplemented":
                return None
            raise
        return [u["Key"][len(self.prefix) :] for u in resp.get("Uploads", [])]


class LocalRaw:
    """Files under a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def sizes(self, prefix: str = "") -> dict[str, int]:
        out = {}
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                name = Path(dirpath, f).relative_to(self.root).as_posix()
                if name.startswith(prefix):
                    out[name] = os.path.getsize(Path(dirpath, f))
        return out

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def write(self, name: str, data: bytes) -> None:
        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        (self.root / name).write_bytes(data)

    def start_upload(self, name: str) -> str | None:
        return None

    def uploads(self) -> list[str] | None:
        return []


@dataclass
class Target:
    """One place checkpoints are stored, as a user reaches it.

    ``options`` are the storage options a user passes to ``Checkpointer`` and the admin
    functions, and to ``S3StorageWriter``/``S3StorageReader`` (the same classes on every backend:
    a local directory goes through the local object store).
    """

    name: str
    root: str
    raw: Raw
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_s3(self) -> bool:
        return self.root.startswith("s3://")

    def url(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def writer(self, name: str, *, overwrite: bool = True, part_size: int | None = None, **s3: Any) -> StorageWriter:
        """The writer dcp_s3 uses at this location."""
        return S3StorageWriter(self.url(name), overwrite=overwrite, part_size=part_size, **s3, **self.options)

    def reader(self, name: str, *, max_range_size: int | None = None) -> StorageReader:
        return S3StorageReader(self.url(name), max_range_size=max_range_size, **self.options)
