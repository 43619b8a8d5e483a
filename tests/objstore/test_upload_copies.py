"""Uploads send the caller's memory, not copies of it, and every part carries a CRC32C the server checks.

Against the real SeaweedFS of the test session (it verifies ``x-amz-checksum-crc32c`` on PUT and
UploadPart; moto does not). What would regress: tensor bytes copied into part buffers again (a save
then holds a part buffer per part in flight, 9 x 16 MiB by default), botocore computing its own
software CRC32 again (0.4 s of CPU per GB), or a checksum the server does not check.
"""

from __future__ import annotations

import base64
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crc32c import crc32c

import dcp_s3._dcp.writer as writer_module
from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.buffers import MIN_PART_SIZE, BufferPool
from dcp_s3._objstore.config import ClientConfig
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3._objstore.s3_multipart import direct_part_size
from dcp_s3.errors import S3TransferError

MiB = 1 << 20
PART = MIN_PART_SIZE  # 5 MiB


def _store(server: LocalS3Server, bucket: str, client: Any) -> S3ObjectStore:
    return S3ObjectStore(lambda: client, bucket, max_attempts=3, sleep=lambda s: None)


class _Sent:
    """Records the checksum headers of every PUT/UploadPart a client sends (botocore's before-send)."""

    def __init__(self, client: Any, on_part: Any = None) -> None:
        self.headers: list[dict[str, str]] = []
        self.payload_hashes: list[str] = []
        self.on_part = on_part
        client.meta.events.register("before-send.s3", self)

    def __call__(self, request: Any, **kwargs: Any) -> None:
        if request.method != "PUT":
            return
        self.headers.append(
            {
                k.lower(): v.decode() if isinstance(v, bytes) else v
                for k, v in request.headers.items()
                if k.lower().startswith("x-amz-checksum") or k.lower() == "x-amz-sdk-checksum-algorithm"
            }
        )
        sha = request.headers.get("x-amz-content-sha256", b"")
        self.payload_hashes.append(sha.decode() if isinstance(sha, bytes) else sha)
        if self.on_part is not None:
            self.on_part(request)


def test_a_save_sends_contiguous_tensors_from_their_memory(
    bucket: str, s3_env: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40 MiB contiguous tensor (8 parts of 5 MiB) is sent from its own memory: the save's part buffers
    hold at most two parts (the first and last, where the torch.save header and trailer and the small
    tensors are copied), where copying its bytes filled one buffer per part in flight (the pool's 9)."""
    pools: list[BufferPool] = []

    class RecordingPool(BufferPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(writer_module, "BufferPool", RecordingPool)
    gen = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(10 * MiB, generator=gen),  # 40 MiB, contiguous
        "small": torch.randn(1000, generator=gen),
        "strided": torch.randn(64, 32, generator=gen).t(),  # not contiguous: compacted, copied
    }
    path = f"s3://{bucket}/ck-{uuid.uuid4().hex[:8]}"
    dcp.save(state, storage_writer=S3StorageWriter(path, part_size=PART), no_dist=True)
    assert len(pools) == 1
    assert pools[0].count >= 8  # enough places for every part in flight: a copying save would fill 8 buffers
    assert 0 < pools[0].peak_bytes <= 2 * PART, f"part buffers held {pools[0].peak_bytes / MiB:.0f} MiB"

    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=S3StorageReader(path), no_dist=True)
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_parts_carry_our_crc32c_and_botocore_computes_none(bucket: str, s3_env: LocalS3Server) -> None:
    """Every part and single PUT carries ``x-amz-checksum-crc32c`` of its bytes; botocore adds no
    ``x-amz-checksum-crc32`` of its own (it would hash every byte again, in software), and signs no
    payload hash."""
    client = ClientConfig(endpoint_url=s3_env.endpoint_url).make_client()
    sent = _Sent(client)
    store = _store(s3_env, bucket, client)
    data = bytes(range(256)) * (13 * MiB // 256)  # 13 MiB: 3 parts
    with ThreadPoolExecutor(2) as ex:
        writer = store.open_writer("multi", pool=BufferPool(3, PART), executor=ex)
        writer.write(data[:1000])
        writer.write_stable(memoryview(data)[1000:])
        writer.close()
    store.put("single", b"hello")
    assert store.get("multi") == data and store.get("single") == b"hello"
    expected = [crc32c(data[i : i + PART]) for i in range(0, len(data), PART)] + [crc32c(b"hello")]
    assert [h.get("x-amz-checksum-crc32c") for h in sent.headers] == [
        base64.b64encode(c.to_bytes(4, "big")).decode() for c in expected
    ]
    assert not any("x-amz-checksum-crc32" in h for h in sent.headers)
    assert set(sent.payload_hashes) == {"UNSIGNED-PAYLOAD"}  # no SHA-256 of every byte over plain HTTP


def test_parts_of_borrowed_memory_grow_to_the_direct_part_size_while_copies_stay_in_one_buffer(
    bucket: str, s3_env: LocalS3Server
) -> None:
    """A part grows past ``part_size`` with views of the caller's memory, up to ``pool.direct_size`` (fewer
    UploadParts: each costs ~4 ms of botocore), while the bytes copied into it never exceed its one buffer
    of ``part_size``: the pool's memory bound is unchanged. With the old rule every part was 5 MiB (9 here)."""
    client = ClientConfig(endpoint_url=s3_env.endpoint_url).make_client()
    sizes: list[int] = []
    sent = _Sent(client, lambda request: sizes.append(int(request.headers["Content-Length"])))
    store = _store(s3_env, bucket, client)
    gen = torch.Generator().manual_seed(3)
    pieces = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes()
        for n in (1000, 30 * MiB, 6 * MiB, 8 * MiB)
    ]
    data = b"".join(pieces)
    pool = BufferPool(2, PART, direct_size=4 * PART)
    with ThreadPoolExecutor(2) as ex:
        writer = store.open_writer("grown", pool=pool, executor=ex, expected_size=len(data))
        writer.write(pieces[0])  # copied: the first part takes a buffer
        writer.write_stable(memoryview(pieces[1]))  # borrowed: the first part grows to 20 MiB
        writer.write(pieces[2])  # copied: fills the second part's buffer (5 MiB), the rest starts a third
        writer.write_stable(memoryview(pieces[3]))
        writer.close()
    assert store.get("grown") == data
    assert sizes == [20 * MiB, 15 * MiB + 1000, 9 * MiB], [s / MiB for s in sizes]
    assert pool.peak_bytes <= 2 * PART  # one buffer per place, of part_size
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    assert [h.get("x-amz-checksum-crc32c") for h in sent.headers] == [
        base64.b64encode(crc32c(data[a : a + n]).to_bytes(4, "big")).decode()
        for a, n in zip(starts, sizes, strict=True)
    ]


def test_the_direct_part_size_leaves_every_upload_place_a_part() -> None:
    """Parts of borrowed memory grow only while the object still has a part per place of the pool (the
    upload threads stay busy on a small object), never past ``direct_size``, never below ``part_size``."""
    pool = BufferPool(9, 16 * MiB, direct_size=64 * MiB)
    assert direct_part_size(pool, 16 * MiB, None) == 16 * MiB  # size unknown: as before
    assert direct_part_size(pool, 16 * MiB, 100 * MiB) == 16 * MiB  # 12 MiB shares: part_size
    assert direct_part_size(pool, 16 * MiB, 512 * MiB) == 57 * MiB  # 9 parts, each a whole MiB
    assert direct_part_size(pool, 16 * MiB, 8 << 30) == 64 * MiB
    assert direct_part_size(BufferPool(9, 16 * MiB, direct_size=8 * MiB), 16 * MiB, 8 << 30) == 16 * MiB


def test_a_part_changed_after_its_checksum_is_refused(bucket: str, s3_env: LocalS3Server) -> None:
    """Bytes that differ from the CRC32C sent with them (here: the borrowed memory changes between the
    checksum and the send, as damage in transit would) are refused by the server (``BadDigest``): the
    upload fails with ``S3TransferError`` naming the key, and leaves no object and no pending upload."""
    source = bytearray(b"x" * (12 * MiB))
    flipped: list[int] = []

    def corrupt(request: Any) -> None:
        if "partNumber=2" in request.url and not flipped:
            source[PART + 7] ^= 0xFF  # inside part 2, after its checksum was computed
            flipped.append(1)

    client = ClientConfig(endpoint_url=s3_env.endpoint_url, retry_attempts=1).make_client()
    _Sent(client, corrupt)
    store = _store(s3_env, bucket, client)
    with ThreadPoolExecutor(1) as ex:
        writer = store.open_writer("damaged", pool=BufferPool(2, PART), executor=ex)
        writer.write_stable(memoryview(source))
        with pytest.raises(S3TransferError, match="damaged"):
            writer.close()
    assert flipped
    assert store.head("damaged") is None
    assert not [u for u in store.list_uploads("damaged")]


def test_no_checksum_where_the_client_asks_only_when_required(
    bucket: str, s3_env: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` (the setting for servers that refuse checksum
    headers) keeps uploads free of them, ours included."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    client = ClientConfig(endpoint_url=s3_env.endpoint_url).make_client()
    sent = _Sent(client)
    store = _store(s3_env, bucket, client)
    data = b"y" * (6 * MiB)
    with ThreadPoolExecutor(1) as ex:
        writer = store.open_writer("plain", pool=BufferPool(2, PART), executor=ex)
        writer.write_stable(memoryview(data))
        writer.close()
    assert store.get("plain") == data
    assert sent.headers and not any(sent.headers)
