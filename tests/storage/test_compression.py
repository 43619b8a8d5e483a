"""Compressed checkpoints (byte-grouped, frame-indexed zstd) end to end on SeaweedFS."""

from __future__ import annotations

import dataclasses
import pickle
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from hostile import load_direct
from test_multirank import load_job, save_job
from test_storage import assert_same, blank_like, keys, sample_state
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._layout import CODEC_DESCRIPTOR
from dcp_s3._local_server import LocalS3Server
from dcp_s3.admin import convert_checkpoint
from dcp_s3.errors import CheckpointFormatError
from tests.objects import data_key, hooked

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

MiB = 1 << 20


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "bf16": (torch.randn(1536, 1024, generator=g) * 0.02).to(torch.bfloat16),  # 3 MiB: 1 frame
        "fp32": torch.randn(3 * MiB // 4 * 3, generator=g) * 0.02,  # 9 MiB: 3 frames of 4 MiB
        "fp64": torch.randn(100, 30, generator=g, dtype=torch.float64),
        "c64": torch.randn(40, generator=g, dtype=torch.complex64),
        "i32": torch.randint(0, 1000, (5000,), generator=g, dtype=torch.int32),
    }


def test_compressed_round_trip_every_dtype_and_shape(bucket: str, s3_env: LocalS3Server) -> None:
    sd: dict[str, Any] = sample_state() | weights()
    uri = f"s3://{bucket}/z"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = S3StorageReader(uri).read_metadata()
    compressed = [i for i in md.storage_data.values() if i.frames is not None]
    assert compressed and all(i.transform_descriptors == [CODEC_DESCRIPTOR] for i in compressed)
    # New saves write codec version 2 (version 1 checkpoints still load: tests/test_golden.py).
    assert CODEC_DESCRIPTOR == "dcp_s3.zstd-frames/2" and {i.frames.version for i in compressed} == {2}
    for max_range in (16 * MiB, 64 * 1024):  # whole frames per request, and many small requests
        out = blank_like(sd)
        dcp.load(out, storage_reader=S3StorageReader(uri, max_range_size=max_range))
        assert_same(sd, out)


def test_compression_stores_fewer_bytes(bucket: str, s3_env: LocalS3Server) -> None:
    sd = weights()
    dcp.save(sd, storage_writer=S3StorageWriter(f"s3://{bucket}/plain"))
    dcp.save(sd, storage_writer=S3StorageWriter(f"s3://{bucket}/zstd", compression="zstd"))
    plain = sum(v for k, v in keys(s3_env, bucket, "plain/").items() if k.endswith(".distcp"))
    packed = sum(v for k, v in keys(s3_env, bucket, "zstd/").items() if k.endswith(".distcp"))
    assert packed < 0.9 * plain, (packed, plain)


def test_cast_and_partial_reads_fetch_only_needed_frames(bucket: str) -> None:
    sd = {f"w{i}": torch.randn(1024, 1024) * 0.02 for i in range(10)}  # 4 MiB each
    uri = f"s3://{bucket}/zp"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression="zstd"))
    reader = S3StorageReader(uri)
    fetched: list[int] = []
    out = {"w7": torch.zeros(1024, 1024, dtype=torch.float64)}  # staged path: cast on copy
    with hooked(reader, "after-call.s3.GetObject", lambda parsed, **_: fetched.append(int(parsed["ContentLength"]))):
        dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w7"], sd["w7"].double())
    md = reader.read_metadata()
    needed = md.storage_data[next(k for k in md.storage_data if k.fqn == "w7")].length
    assert sum(fetched[1:]) <= 1.2 * needed + 1024, (fetched, needed)


def test_stock_reader_refuses_a_compressed_copy_and_convert_makes_it_readable(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    sd = weights()
    dcp.save(sd, storage_writer=S3StorageWriter(f"s3://{bucket}/zc", compression="zstd"))
    client = s3_env.client()
    packed = tmp_path / "packed"
    packed.mkdir()
    for key in keys(s3_env, bucket, "zc/"):
        client.download_file(bucket, key, str(packed / key.split("/", 1)[1]))
    with pytest.raises(BaseException, match="zstd-frames"):  # a clear refusal, not garbage
        dcp.load(blank_like(sd), storage_reader=FileSystemReader(packed))
    convert_checkpoint(f"s3://{bucket}/zc", str(tmp_path / "plain"), fmt="dcp")
    out = blank_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "plain"))
    assert_same(sd, out)


def test_unknown_codec_is_a_clear_error(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/zu"
    dcp.save({"w": torch.randn(100)}, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = S3StorageReader(uri).read_metadata()
    for info in md.storage_data.values():
        info.transform_descriptors = ["dcp_s3.zstd-frames/9"]
    s3_env.client().put_object(Bucket=bucket, Key="zu/.metadata", Body=pickle.dumps(md))
    with pytest.raises(BaseException, match="zstd-frames/9"):
        dcp.load({"w": torch.zeros(100)}, storage_reader=S3StorageReader(uri))


def test_corrupt_compressed_frame_is_detected(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/zx"
    sd = {"w": torch.randn(2 * MiB // 4)}
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression="zstd"))
    client = s3_env.client()
    body = bytearray(client.get_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "zx"))["Body"].read())
    body[len(body) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "zx"), Body=bytes(body))
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(2 * MiB // 4)}, storage_reader=S3StorageReader(uri))
    assert data_key(s3_env.client(), bucket, "zx") in str(info.value) or "corrupt" in str(info.value)


@pytest.mark.multiproc
def test_compressed_fsdp2_save_on_2_ranks_resharded_load_on_3(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/zfsdp"
    ref = str(tmp_path / "ref.pt")
    run_ranks(save_job, 2, s3_env.env(), uri, ref, "zstd")
    run_ranks(load_job, 3, s3_env.env(), uri, ref)


def test_each_frame_is_checksummed(bucket: str, s3_env: LocalS3Server) -> None:
    """Mantissa planes of random floats are stored as raw zstd blocks: a flipped bit there still
    decodes, so only the frame's CRC can catch it."""
    uri = f"s3://{bucket}/zcrc"
    sd = {"w": torch.randn(3 * MiB)}  # 12 MiB of fp32: 3 frames of 4 MiB
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = S3StorageReader(uri).read_metadata()
    (info,) = md.storage_data.values()
    assert len(info.frame_crc32c) == info.frames.num_frames == 3
    client = s3_env.client()
    body = bytearray(client.get_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "zcrc"))["Body"].read())
    start, end = info.frames.stored_range(1)
    body[info.offset + (start + end) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "zcrc"), Body=bytes(body))
    with pytest.raises(BaseException, match="frame 1 of the item .* fails its checksum"):
        dcp.load({"w": torch.zeros(3 * MiB)}, storage_reader=S3StorageReader(uri, max_range_size=4 * MiB))


def _load_counting(uri: str, out: dict[str, torch.Tensor], **reader_args: Any) -> tuple[list[int], int]:
    """Load ``uri`` into ``out``: the body sizes of its data GETs, and the most Python-allocated memory
    (tracemalloc: numpy and bytearray buffers included) held at once during ``dcp.load``."""
    reader = S3StorageReader(uri, **reader_args)
    sizes: list[int] = []
    with hooked(reader, "after-call.s3.GetObject", lambda parsed, **_: sizes.append(int(parsed["ContentLength"]))):
        tracemalloc.start()
        try:
            dcp.load(out, storage_reader=reader)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return sizes[1:], peak  # the first GET is .metadata


def test_compressed_load_makes_as_few_gets_as_a_plain_one_and_holds_one_frame_per_thread(bucket: str) -> None:
    """Issue 39: a compressed item's frames are read in GETs as large as raw ones (``max_direct_range_size``),
    each frame decoded into the destination as soon as it is in, from a buffer reused frame after frame; before,
    GETs were cut at ``max_range_size`` and each held all of its stored bytes until decoded."""
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(12 * MiB, generator=g) * 0.02}  # 48 MiB of fp32: 12 frames
    for name, options in (("plain", {}), ("zstd", {"compression": "zstd"})):
        dcp.save(sd, storage_writer=S3StorageWriter(f"s3://{bucket}/{name}", **options))
    got: dict[str, tuple[list[int], int]] = {}
    for name in ("plain", "zstd"):
        out = {"w": torch.zeros(12 * MiB)}
        got[name] = _load_counting(f"s3://{bucket}/{name}", out, max_concurrency=2, max_range_size=16 * MiB)
        assert torch.equal(out["w"], sd["w"])
    (plain_gets, _), (zstd_gets, peak) = got["plain"], got["zstd"]
    assert len(plain_gets) == 1 and len(zstd_gets) == 1, got  # before: 3 GETs of at most 16 MiB
    assert sum(zstd_gets) < 0.9 * sum(plain_gets)  # still fewer bytes fetched
    # At most one 4 MiB frame buffer per reading thread, plus the codec's per-thread scratch for a top plane
    # (2 MiB) and what any GET holds (see below); before: 16 MiB held per GET in flight.
    assert peak < 2 * (4 + 2) * MiB + 3 * MiB, peak


def test_compressed_load_reads_raw_frames_straight_into_the_destination(bucket: str, s3_env: LocalS3Server) -> None:
    """Frames that did not shrink are stored raw: a load reads them into the destination tensor itself,
    holding no buffer of their bytes, and still checks each one's CRC32C."""
    g = torch.Generator().manual_seed(4)
    bits = torch.randint(-(2**31), 2**31 - 1, (6 * MiB,), generator=g, dtype=torch.int32)  # incompressible
    sd = {"w": bits.view(torch.float32)}  # 24 MiB: 6 raw frames
    uri = f"s3://{bucket}/zraw"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = S3StorageReader(uri).read_metadata()
    (info,) = md.storage_data.values()
    assert all(info.frames.is_raw(i) for i in range(info.frames.num_frames)) and info.frames.num_frames == 6
    out = {"w": torch.zeros(6 * MiB)}
    gets, peak = _load_counting(uri, out)
    assert torch.equal(out["w"].view(torch.int32), bits) and len(gets) == 1
    # What a plain GET holds (its 1 MiB gap buffer, urllib3's 1 MiB read); before: each frame's 4 MiB also
    # fetched into a buffer of its own, then copied.
    assert peak < 3 * MiB, peak
    client = s3_env.client()
    key = data_key(client, bucket, "zraw")
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    start, end = info.frames.stored_range(4)
    body[info.offset + (start + end) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(BaseException, match="frame 4 of the item .* fails its checksum"):
        dcp.load({"w": torch.zeros(6 * MiB)}, storage_reader=S3StorageReader(uri))


def test_a_frame_claiming_more_stored_than_raw_bytes_is_refused(bucket: str, s3_env: LocalS3Server) -> None:
    """A frame is read into a buffer of its stored size: a frame index claiming more stored bytes than the
    frame's raw size (which no codec version writes: such a frame is stored raw) is refused before any read."""
    uri = f"s3://{bucket}/zbig"
    g = torch.Generator().manual_seed(5)
    dcp.save({"w": torch.randn(3 * MiB, generator=g) * 0.02}, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = S3StorageReader(uri).read_metadata()
    (info,) = md.storage_data.values()
    ends = info.frames.ends
    info.frames = dataclasses.replace(info.frames, ends=(ends[1] - 1, ends[1], ends[2]))
    s3_env.client().put_object(Bucket=bucket, Key="zbig/.metadata", Body=pickle.dumps(md))
    with pytest.raises(BaseException, match=r"frame 0 of the item .* claims \d+ stored bytes for 4194304 raw"):
        dcp.load({"w": torch.zeros(3 * MiB)}, storage_reader=S3StorageReader(uri))


@pytest.mark.parametrize("dest", ["bf16", "fp32 (cast, staged)"])
def test_a_frame_of_other_bytes_is_an_error_naming_the_object_and_range(
    bucket: str, s3_env: LocalS3Server, dest: str
) -> None:
    """A server answering a range with other bytes (a shifted 206), played by a data object whose bytes are
    rotated: the codec's error (it knows frames, not objects) is raised again naming the object and the bytes
    read (issue 50, item 11), on the path that decodes into the destination and on the staged one."""
    uri = f"s3://{bucket}/zshift"
    g = torch.Generator().manual_seed(6)
    sd = {"w": (torch.randn(2 * MiB, generator=g) * 0.02).to(torch.bfloat16)}  # 4 MiB: one grouped frame
    dcp.save(sd, storage_writer=S3StorageWriter(uri, compression="zstd"))
    (info,) = S3StorageReader(uri).read_metadata().storage_data.values()
    assert not info.frames.is_raw(0)
    client = s3_env.client()
    key = data_key(client, bucket, "zshift")
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=body[7:] + body[:7])
    out = {"w": torch.zeros(2 * MiB, dtype=torch.bfloat16 if dest == "bf16" else torch.float32)}
    with pytest.raises(CheckpointFormatError) as raised:
        load_direct(uri, out)
    s0, s1 = info.frames.stored_range(0)
    assert str(raised.value).startswith(
        f"s3://{bucket}/{key}: bytes [{info.offset + s0}, {info.offset + s1}) (frames of the item at "
        f"[{info.offset}, {info.offset + info.length}), its raw bytes [0, {4 * MiB})) do not decode: frame 0"
    ), str(raised.value)
    assert isinstance(raised.value.__cause__, CheckpointFormatError)
    assert str(raised.value).endswith(str(raised.value.__cause__))
