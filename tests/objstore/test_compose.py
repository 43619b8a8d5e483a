"""``dcp_s3._objstore.compose``: one object made of given bytes and ranges of stored objects.

The plan obeys S3's part rules (every part but the last >= the minimum) and copies large spans; on SeaweedFS
and moto the parts are UploadPartCopy requests (the server's bytes, never this process's) and the result is
bit-exact; a server answering UploadPartCopy with 501 gets the same object streamed; a local directory too.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from fault_proxy import FaultProxy, Rule

from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.base import ObjectStore, Span
from dcp_s3._objstore.buffers import MIN_PART_SIZE
from dcp_s3._objstore.compose import Piece, batches, compose, plan_parts
from dcp_s3._objstore.local import LocalObjectStore
from dcp_s3._objstore.s3 import S3ObjectStore

MiB = 1 << 20


def _bytes_of(pieces: list[Piece], objects: dict[str, bytes]) -> bytes:
    return b"".join(p if isinstance(p, bytes) else objects[p.key][p.start : p.end] for p in pieces)


def test_plan_keeps_s3_part_rules_and_copies_large_spans() -> None:
    objects = {"a": os.urandom(30), "b": os.urandom(40)}
    pieces: list[Piece] = [b"HDR", Span("a", 0, 2), Span("b", 0, 40), Span("a", 2, 5), Span("a", 5, 30), b"T"]
    parts = plan_parts(pieces, 10, max_copy=20)
    for part in parts[:-1]:
        assert part.size >= 10
    assert _bytes_of([p for part in parts for p in part.pieces], objects) == _bytes_of(pieces, objects)
    copies = [part for part in parts if part.copy]
    assert copies and all(len(c.pieces) == 1 and c.size <= 20 for c in copies)
    assert len(copies) == 3  # b[5:40] in two, a[12:30] in one
    # The header and the small span are topped up from b's head: 5 bytes of b sent, the rest copied.
    assert parts[0] == type(parts[0])((b"HDR", Span("a", 0, 2), Span("b", 0, 5)))
    assert sum(c.size for c in copies) == 35 + 18  # b[5:40] and a[12:30]; a[5:12] tops a[2:5] up


def test_batches_split_pieces_at_the_limit() -> None:
    objects = {"a": os.urandom(25)}
    pieces: list[Piece] = [b"0123456", Span("a", 0, 25)]
    got = list(batches(pieces, 10))
    assert [sum(len(p) if isinstance(p, bytes) else p.size for p in b) for b in got] == [10, 10, 10, 2]
    assert _bytes_of([p for b in got for p in b], objects) == _bytes_of(pieces, objects)


def _pieces(store: ObjectStore, sources: dict[str, bytes]) -> list[Piece]:
    for key, body in sources.items():
        store.put(key, body)
    return [
        b"header" * 100,
        Span("src/a", 0, 3 * MiB),  # under the minimum: sent, topped up from b
        Span("src/b", 0, 12 * MiB),  # copied after the top-up
        Span("src/a", 3 * MiB, 4 * MiB + 7),
        Span("src/b", 12 * MiB, 13 * MiB),
        Span("src/a", 4 * MiB + 7, 16 * MiB),  # topped-up part, then copied
        b"trailer",
    ]


def _sources() -> dict[str, bytes]:
    return {"src/a": os.urandom(16 * MiB), "src/b": os.urandom(13 * MiB)}


def _s3_store(server: LocalS3Server, bucket: str, endpoint: str | None = None) -> S3ObjectStore:
    client = server.client()
    if endpoint is not None:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=server.region,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            config=Config(s3={"addressing_style": "path"}),
        )
    return S3ObjectStore(lambda: client, bucket, max_attempts=2, sleep=lambda s: None)


class _Ops:
    """The S3 operations a client sends (botocore's before-call)."""

    def __init__(self, client: Any) -> None:
        self.names: list[str] = []
        client.meta.events.register("before-call.s3", self)

    def __call__(self, model: Any, **kwargs: Any) -> None:
        self.names.append(model.name)


@pytest.mark.parametrize("server", ["seaweed", "moto_server"])
def test_compose_on_s3_copies_spans_server_side(server: str, request: pytest.FixtureRequest) -> None:
    s3: LocalS3Server = request.getfixturevalue(server)
    bucket = s3.create_bucket(f"c-{uuid.uuid4().hex[:12]}")
    store = _s3_store(s3, bucket)
    sources = _sources()
    pieces = _pieces(store, sources)
    ops = _Ops(store.client)
    with ThreadPoolExecutor(4) as pool:
        size = compose(store, "out", pieces, executor=pool, chunk=8 * MiB, max_buffered=2)
    want = _bytes_of(pieces, sources)
    assert size == len(want)
    assert store.get("out") == want
    assert ops.names.count("UploadPartCopy") >= 2
    sent = ops.names.count("UploadPart")
    assert 1 <= sent <= 3, ops.names  # the header, small spans, a trailer: 5 MiB each, not the 29 MiB
    assert "AbortMultipartUpload" not in ops.names


def test_server_without_upload_part_copy_gets_the_object_streamed(moto_server: LocalS3Server) -> None:
    bucket = moto_server.create_bucket(f"nocopy-{uuid.uuid4().hex[:12]}")
    with FaultProxy(moto_server.endpoint_url, [Rule({"UploadPartCopy"}, "501")]) as proxy:
        store = _s3_store(moto_server, bucket, proxy.url)
        sources = _sources()
        pieces = _pieces(store, sources)
        with ThreadPoolExecutor(4) as pool:
            compose(store, "out", pieces, executor=pool, chunk=6 * MiB, max_buffered=2)
            assert proxy.injected("501") >= 1
            assert store.get("out") == _bytes_of(pieces, sources)
            assert store.list_uploads("") == []  # the copying upload was aborted
            # Learnt: the next object is streamed without trying UploadPartCopy again.
            before = proxy.injected("501")
            compose(store, "out2", pieces, executor=pool, chunk=6 * MiB, max_buffered=2)
            assert proxy.injected("501") == before
            assert store.get("out2") == _bytes_of(pieces, sources)


def test_compose_in_a_local_directory(tmp_path: Path) -> None:
    store = LocalObjectStore(os.fspath(tmp_path))
    sources = _sources()
    pieces = _pieces(store, sources)
    with ThreadPoolExecutor(2) as pool:
        compose(store, "out", pieces, executor=pool, chunk=4 * MiB, max_buffered=2)
    assert (tmp_path / "out").read_bytes() == _bytes_of(pieces, sources)


def test_small_object_is_one_put(tmp_path: Path) -> None:
    store = LocalObjectStore(os.fspath(tmp_path))
    store.put("x", b"abcdef")
    with ThreadPoolExecutor(2) as pool:
        assert compose(store, "y", [b"<", Span("x", 1, 4), b">"], executor=pool, chunk=MIN_PART_SIZE, max_buffered=1)
    assert (tmp_path / "y").read_bytes() == b"<bcd>"
