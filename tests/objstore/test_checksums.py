"""One CRC32C pass on a save (issue 39): ``crc32c_combine`` against direct CRCs, and a save to SeaweedFS
(which checks every part's ``x-amz-checksum-crc32c``) that hashes each byte once, yet stores the same
item and part checksums as hashing the item's and the part's bytes on their own (the former two passes)."""

from __future__ import annotations

import base64
import itertools
import sys
import threading
from typing import Any

import awscrt.checksums
import crc32c as crc32c_module
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.checksums import crc32c_combine
from dcp_s3.errors import ConfigError
from tests.objects import data_key, hooked

crc32c = crc32c_module.crc32c
MiB = 1 << 20


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096), st.lists(st.integers(min_value=0, max_value=4096), max_size=6))
def test_combine_matches_the_crc_of_the_whole(data: bytes, cuts: list[int]) -> None:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    combined = 0
    for lo, hi in itertools.pairwise(points):
        combined = crc32c_combine(combined, crc32c(data[lo:hi]), hi - lo)
    assert combined == crc32c(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**45))
def test_combine_matches_awscrt_on_any_length(crc_a: int, crc_b: int, len_b: int) -> None:
    """Lengths far beyond what a test can hash (a 32 TiB part): against awscrt's C implementation."""
    expected = awscrt.checksums.combine_crc32c(crc_a, crc_b, len_b) if len_b else crc_a
    assert crc32c_combine(crc_a, crc_b if len_b else 0, len_b) == expected


def test_combine_refuses_a_negative_length() -> None:
    with pytest.raises(ConfigError, match="len_b"):
        crc32c_combine(1, 2, -1)


class _CountingCrc:
    """Wraps ``crc32c.crc32c`` wherever a dcp_s3 module imported it: counts the bytes hashed."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def __call__(self, data: Any, value: int = 0, *args: Any) -> int:
        with self._lock:
            self.bytes += memoryview(data).nbytes
        return crc32c(data, value, *args)


def _state() -> dict[str, Any]:
    torch.manual_seed(3)
    return {
        # Items spanning parts, parts spanning items (5 MiB parts), borrowed and copied (non-contiguous) bytes.
        "big": torch.randn(3 * MiB),  # 12 MiB
        "odd": torch.randn(777_777, dtype=torch.float64),
        "t": torch.randn(1024, 1536).t(),  # 6 MiB, written through a compact copy
        "small": [torch.randn(100 + i) for i in range(20)],
        "bf16": torch.randn(2 * MiB, dtype=torch.bfloat16),
        "extra": {"step": 7, "name": "run"},  # a byte item
    }


def test_a_save_hashes_each_byte_once_and_stores_the_same_checksums(
    bucket: str, s3_env: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _CountingCrc()
    patched = [
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("dcp_s3") and getattr(mod, "crc32c", None) is crc32c
    ]
    assert patched, "no dcp_s3 module uses crc32c.crc32c"
    for name in patched:
        monkeypatch.setattr(sys.modules[name], "crc32c", counter)
    sd = _state()
    uri = f"s3://{bucket}/once"
    writer = S3StorageWriter(uri, part_size=5 * MiB)
    sent: dict[tuple[str, int], str] = {}

    def record(params: dict[str, Any], **_: Any) -> None:
        sent[(params["Key"], params.get("PartNumber", 0))] = params["ChecksumCRC32C"]

    with (
        hooked(writer, "before-parameter-build.s3.UploadPart", record),
        hooked(writer, "before-parameter-build.s3.PutObject", record),
    ):
        dcp.save(sd, storage_writer=writer, no_dist=True)
    for name in patched:
        monkeypatch.setattr(sys.modules[name], "crc32c", crc32c)

    client = s3_env.client()
    key = data_key(client, bucket, "once")
    stored = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    tensor_bytes = sum(t.nbytes for t in (sd["big"], sd["odd"], sd["t"], sd["bf16"], *sd["small"]))
    # Every byte of the data object hashed once (small header/trailer pieces twice), not twice over.
    size = len(stored)
    print(f"CRC32C bytes hashed per byte saved: {counter.bytes / size:.3f}")  # 2.0 with the former two passes
    assert tensor_bytes < size and counter.bytes <= 1.05 * size, (counter.bytes, size)

    # Each part's checksum is the CRC32C of its bytes, as hashing the part on its own gives (the old path's).
    parts = [(p, c) for (k, p), c in sorted(sent.items()) if k == key]
    assert [p for p, _ in parts] == list(range(1, len(stored) // (5 * MiB) + 2)), parts
    for number, checksum in parts:
        body = stored[(number - 1) * 5 * MiB : number * 5 * MiB]
        assert checksum == _b64(crc32c(body)), number
    # Each item's checksum is the CRC32C of its payload bytes alone (the old path's), and loads check it.
    reader = S3StorageReader(uri)
    metadata = reader.read_metadata()
    expected = {"big": sd["big"], "odd": sd["odd"], "t": sd["t"].contiguous(), "bf16": sd["bf16"]}
    expected.update({f"small.{i}": t for i, t in enumerate(sd["small"])})
    seen = set()
    for index, info in metadata.storage_data.items():
        if index.fqn in expected:
            payload = expected[index.fqn].contiguous().view(torch.uint8).numpy().tobytes()
            assert stored[info.offset + info.payload_offset :][: len(payload)] == payload, index.fqn
            assert info.crc32c == crc32c(payload), index.fqn
            seen.add(index.fqn)
        else:  # a byte item: its checksum covers its stored bytes
            assert info.crc32c == crc32c(stored[info.offset : info.offset + info.length]), index.fqn
    assert seen == set(expected)
    out = {k: v for k, v in _state().items() if k != "extra"} | {"extra": {"step": 0, "name": ""}}
    for v in (out["big"], out["odd"], out["t"], out["bf16"], *out["small"]):
        v.zero_()
    dcp.load(out, storage_reader=S3StorageReader(uri), no_dist=True)
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["t"], sd["t"]) and out["extra"] == sd["extra"]


def _b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")
