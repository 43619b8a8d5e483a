"""Integrity against real SeaweedFS: missing objects, crafted metadata, swapped objects, transport checksums."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.exceptions import ClientError
from crc32c import crc32c
from torch.distributed.checkpoint.api import CheckpointException

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3 import _layout as layout
from dcp_s3._dcp.block_checks import BlockLedger
from dcp_s3._local_server import LocalS3Server
from dcp_s3.errors import CheckpointFormatError
from tests.objects import data_key, hooked

MiB = 1 << 20
#: DCP raises CheckpointException, a BaseException, for failures inside the save/load steps.
ERRORS = (CheckpointException, Exception)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 512, generator=g),
        "b": torch.randn(512, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def _zeros_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _save(uri: str, sd: dict[str, Any], **kw: Any) -> None:
    dcp.save(sd, storage_writer=S3StorageWriter(uri, **kw))


# -- (a) a data object deleted after the save ---------------------------------------------------------------
def test_deleted_data_object_fails_load_naming_the_key(bucket: str, s3_env: LocalS3Server) -> None:
    sd = _state(1)
    uri = f"s3://{bucket}/deleted/step-1"
    _save(uri, sd)
    key = data_key(s3_env.client(), bucket, "deleted/step-1")
    s3_env.client().delete_object(Bucket=bucket, Key=key)
    with pytest.raises(ERRORS) as info:
        dcp.load(_zeros_like(sd), storage_reader=S3StorageReader(uri))
    assert key in str(info.value), str(info.value)


# -- (b) crafted .metadata: object paths escaping the checkpoint ---------------------------------------------
@pytest.mark.parametrize("bad_path", ["../other/__0_0.distcp", "s3://evil/x", "/abs"])
def test_crafted_metadata_path_is_refused(bucket: str, s3_env: LocalS3Server, bad_path: str) -> None:
    sd = _state(2)
    uri = f"s3://{bucket}/crafted/step-1"
    _save(uri, sd)
    # A decoy at the place "../other/__0_0.distcp" would resolve to.
    _save(f"s3://{bucket}/crafted/other", _state(3))
    metadata = S3StorageReader(uri).read_metadata()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = bad_path
    s3_env.client().put_object(Bucket=bucket, Key="crafted/step-1/.metadata", Body=pickle.dumps(metadata))

    with pytest.raises(CheckpointFormatError) as info:
        S3StorageReader(uri).read_metadata()
    assert "invalid object path" in str(info.value) and repr(bad_path) in str(info.value), str(info.value)
    out = _zeros_like(sd)
    with pytest.raises(ERRORS) as info2:
        dcp.load(out, storage_reader=S3StorageReader(uri))
    assert bad_path in str(info2.value), str(info2.value)
    for k in out:  # nothing was loaded from anywhere
        assert not out[k].any(), k


# -- (c) an object swapped for another checkpoint's object of the same size ----------------------------------
def test_object_replaced_by_same_size_object_fails_checksum(bucket: str, s3_env: LocalS3Server) -> None:
    a, b = _state(4), _state(5)
    _save(f"s3://{bucket}/swap/a", a)
    _save(f"s3://{bucket}/swap/b", b)
    client = s3_env.client()
    key_a, key_b = data_key(client, bucket, "swap/a"), data_key(client, bucket, "swap/b")
    head_a = client.head_object(Bucket=bucket, Key=key_a)
    head_b = client.head_object(Bucket=bucket, Key=key_b)
    assert head_a["ContentLength"] == head_b["ContentLength"]
    client.copy_object(Bucket=bucket, Key=key_a, CopySource={"Bucket": bucket, "Key": key_b})
    with pytest.raises(ERRORS) as info:
        dcp.load(_zeros_like(a), storage_reader=S3StorageReader(f"s3://{bucket}/swap/a"))
    message = str(info.value)
    assert "checksum mismatch" in message, message
    assert key_a in message, message


def test_payload_checksums_are_taken_as_the_bytes_arrive_and_catch_one_flipped_byte(
    bucket: str, s3_env: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor read straight into its destination is hashed by the reading threads piece by piece as the
    bytes land (in cache), its pieces' CRCs combined: no second pass over the destination once the reads
    are done (``layout.crc32c`` is not called), and one flipped byte in the middle of the payload, read in
    four GETs, still fails the load naming the object."""
    g = torch.Generator().manual_seed(8)
    sd = {"big": torch.randn(1024, 1024, generator=g), "small": torch.randn(10, generator=g)}
    uri = f"s3://{bucket}/hot-crc/step-1"
    _save(uri, sd)

    def reader() -> S3StorageReader:  # 1 MiB GETs: the 4 MiB tensor in four reads, each in several pieces
        return S3StorageReader(uri, max_range_size=MiB, max_direct_range_size=MiB)

    hashed_after: list[int] = []
    real = layout.crc32c
    monkeypatch.setattr(layout, "crc32c", lambda data, *a: hashed_after.append(len(data)) or real(data, *a))
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=reader())
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert hashed_after == [], hashed_after

    client = s3_env.client()
    key = data_key(client, bucket, "hot-crc/step-1")
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01  # inside the big tensor's payload
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(ERRORS) as info:
        dcp.load(_zeros_like(sd), storage_reader=reader())
    assert "checksum mismatch" in str(info.value) and key in str(info.value), str(info.value)


def test_block_fragments_combine_whatever_the_pieces_and_a_read_seen_twice_is_rehashed() -> None:
    """Reads hashed in pieces of any size and order combine into each block's CRC32C; a read whose bytes
    were reported twice is hashed from its buffer instead; a block short of bytes is refused."""
    data = bytes(range(256)) * 40
    block = 1024
    crcs = tuple(crc32c(data[i : i + block]) for i in range(0, len(data), block))
    ledger = BlockLedger(block, crcs, len(data), 0, len(data), lambda a, b: f"x {a}-{b}")
    cuts = [0, 1000, 5000, len(data)]
    for i in (2, 0, 1):
        lo, hi = cuts[i], cuts[i + 1]
        hasher = ledger.hasher(lo, hi)
        for a in range(lo, hi, 700):
            hasher(memoryview(data)[a : min(hi, a + 700)])
        if i == 1:
            hasher(memoryview(data)[1000:1001])  # one byte reported twice
        hasher.finish(memoryview(data)[lo:hi])
    ledger.check()
    short = BlockLedger(block, crcs, len(data), 0, 2000, lambda a, b: f"x {a}-{b}")
    short.hasher(0, 1500).finish(memoryview(data)[0:1500])
    with pytest.raises(CheckpointFormatError, match="not read whole"):
        short.check()


# -- (d) transport checksums ---------------------------------------------------------------------------------
def test_server_rejects_put_with_wrong_checksum(bucket: str, s3_env: LocalS3Server) -> None:
    """The premise of relying on x-amz-checksum-*: SeaweedFS refuses bytes that do not match."""
    client = s3_env.client()
    with pytest.raises(ClientError):
        client.put_object(Bucket=bucket, Key="bad-crc", Body=b"hello world", ChecksumCRC32="AAAAAA==")
    client.put_object(Bucket=bucket, Key="good-crc", Body=b"hello world", ChecksumCRC32="DUoRhQ==")


_CHECKSUM_HEADERS = ("content-md5", "x-amz-trailer")


def _has_checksum(headers: dict[str, str]) -> bool:
    return any(h.startswith("x-amz-checksum-") or h in _CHECKSUM_HEADERS for h in headers)


def test_uploads_carry_a_checksum_header(bucket: str) -> None:
    uri = f"s3://{bucket}/crc/step-1"
    writer = S3StorageWriter(uri, part_size=5 * MiB, max_concurrency=2)
    seen: list[tuple[str, dict[str, str]]] = []

    def record(request: Any, event_name: str, **kwargs: Any) -> None:
        headers = {k.lower(): str(v) for k, v in request.headers.items()}
        seen.append((event_name.rsplit(".", 1)[-1], headers))

    sd = {"big": torch.randn(12 * MiB // 4), "small": torch.randn(16)}
    with hooked(writer, "before-send.s3.UploadPart", record), hooked(writer, "before-send.s3.PutObject", record):
        dcp.save(sd, storage_writer=writer)

    ops = [op for op, _ in seen]
    assert ops.count("UploadPart") >= 3, ops  # 12 MiB in 5 MiB parts
    assert "PutObject" in ops, ops  # .metadata
    missing = [(op, sorted(h)) for op, h in seen if not _has_checksum(h)]
    assert not missing, missing
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
