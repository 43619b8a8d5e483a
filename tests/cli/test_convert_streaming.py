"""``dcp-s3 convert --format dcp``, streamed: from a Hugging Face safetensors export (written by the released
``safetensors``) or a DCP checkpoint to a new DCP checkpoint, chunk by chunk, with memory bounded by the chunk and
not by the largest tensor; every byte checked as the source's reader checks it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3 import CheckpointFormatError, CheckpointNotFoundError, S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3.admin import convert_checkpoint
from dcp_s3.admin._streaming import chunk_rows

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _export() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(5, 40, 30, generator=g),
        "model.layers.0.norm": torch.randn(64, generator=g).to(torch.float16),
        "model.positions": torch.arange(1000, dtype=torch.int64),
        "lm_head.scale": torch.tensor(0.5),
    }


def _put_export(client: object, bucket: str, prefix: str, tensors: dict[str, torch.Tensor], index: bool = True) -> None:
    from safetensors.torch import save

    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{shard}", Body=save({k: tensors[k] for k in keys}))  # type: ignore[attr-defined]
    if index:
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
        body = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
        client.put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors.index.json", Body=body)  # type: ignore[attr-defined]


def _load(uri: str, like: dict[str, torch.Tensor], reader: object = None) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=reader or S3StorageReader(uri), no_dist=True)
    return out


def test_a_hugging_face_export_converts_to_dcp_in_chunks_bit_exact(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """Two shards and their index -> a DCP checkpoint: every tensor bit-exact in its stored dtype (bf16, fp16, int64,
    0-d, 3-d), a tensor larger than a chunk stored as several chunks of whole rows, stock ``.metadata`` (a
    downloaded copy loads with torch's ``FileSystemReader``)."""
    tensors = _export()
    _put_export(s3_env.client(), bucket, "hf", tensors)
    seen: list[tuple[int, int]] = []
    report = convert_checkpoint(
        f"s3://{bucket}/hf", f"s3://{bucket}/dcp", fmt="dcp", chunk_bytes=8 << 10, progress=lambda *a: seen.append(a)
    )
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert (report.tensors, report.bytes) == (5, total)
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)  # the progress told
    loaded = _load(f"s3://{bucket}/dcp", tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    metadata = S3StorageReader(f"s3://{bucket}/dcp").read_metadata()
    embed = metadata.state_dict_metadata["model.embed.weight"]
    assert len(embed.chunks) == 300 * 64 * 2 // (8 << 10) + 1  # 64 rows of 128 bytes per 8 KiB chunk: 5 chunks
    client = s3_env.client()
    local = tmp_path / "dcp"
    for obj in client.list_objects_v2(Bucket=bucket, Prefix="dcp/")["Contents"]:
        path = local / obj["Key"][len("dcp/") :]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
    assert torch.equal(_load("", tensors, FileSystemReader(local))["model.embed.weight"], tensors["model.embed.weight"])


def test_a_torn_export_and_a_flipped_bit_are_refused_and_nothing_is_committed(
    bucket: str, s3_env: LocalS3Server
) -> None:
    """Shards without their index are not an export: refused as incomplete, naming the prefix, nothing written; a
    flipped bit in a DCP source is caught by its block checksums (naming the object and byte range) and the copy
    commits nothing. (A safetensors export carries no checksum: what it holds is copied as it is.)"""
    client = s3_env.client()
    _put_export(client, bucket, "torn", _export(), index=False)
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{bucket}/torn"):
        convert_checkpoint(f"s3://{bucket}/torn", f"s3://{bucket}/out", fmt="dcp")
    assert client.list_objects_v2(Bucket=bucket, Prefix="out/").get("KeyCount", 0) == 0

    state = {"w": torch.randn(512, 256)}
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/src"), no_dist=True)
    (key,) = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix="src/")["Contents"]
        if o["Key"].endswith(".distcp")
    ]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(CheckpointFormatError, match=r"src/__0_0\.[0-9a-f]{16}\.distcp bytes [0-9]+-[0-9]+: checksum"):
        convert_checkpoint(f"s3://{bucket}/src", f"s3://{bucket}/copy", fmt="dcp", chunk_bytes=64 << 10)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="copy/").get("Contents", [])]
    assert "copy/.metadata" not in keys


def test_a_dcp_checkpoint_converts_to_a_hugging_face_export_streamed(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """``--format safetensors`` to a prefix: a compressed DCP checkpoint -> shards and their index written by
    ``S3HuggingFaceStorageWriter`` from chunks read as written; the export loads with the released ``safetensors``
    (downloaded) and dcp_s3's reader bit-exact; the non-tensor entry is left out and said."""
    from safetensors import safe_open

    tensors = _export()
    state = {**tensors, "extra": {"epoch": 3}}
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/ck", compression="zstd"), no_dist=True)
    report = convert_checkpoint(f"s3://{bucket}/ck", f"s3://{bucket}/hf", fmt="safetensors", chunk_bytes=8 << 10)
    assert report.skipped == ["extra.epoch"] and report.tensors == len(tensors)
    from dcp_s3 import S3HuggingFaceStorageReader

    loaded = _load(f"s3://{bucket}/hf", tensors, S3HuggingFaceStorageReader(f"s3://{bucket}/hf"))
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    client = s3_env.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="hf/")["Contents"]]
    assert "hf/model.safetensors.index.json" in keys
    (shard,) = [k for k in keys if k.endswith(".safetensors")]
    path = tmp_path / "shard.safetensors"
    path.write_bytes(client.get_object(Bucket=bucket, Key=shard)["Body"].read())
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.mlp.weight"), tensors["model.layers.0.mlp.weight"])


def test_chunks_are_whole_rows_of_at_most_the_chunk_size() -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([10, 3]), [])
    chunks = chunk_rows(md, 25)  # 12 bytes a row: 2 rows a chunk
    assert [(c.offsets[0], c.sizes[0]) for c in chunks] == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2)]
    assert [c.sizes[0] for c in chunk_rows(md, 1)] == [1] * 10  # a row larger than a chunk: one row each
    scalar = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]), [])
    assert [tuple(c.sizes) for c in chunk_rows(scalar, 1)] == [()]


_CHILD = r"""
import json, resource, sys, gc
import torch
from dcp_s3.admin import convert_checkpoint
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
convert_checkpoint(sys.argv[1], sys.argv[2], fmt="dcp", chunk_bytes=int(sys.argv[3]))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"added": after - before}))
"""


def test_a_conversion_holds_a_chunk_not_the_largest_tensor(tmp_path: Path) -> None:
    """Issue 52's bound, in a fresh process: converting an export holding one 256 MiB tensor with 16 MiB chunks
    adds well under the tensor's size to the peak RSS (the chunk, the writer's part buffers, the reader's)."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"big": torch.ones(64 << 20)}, str(src / "model.safetensors"))  # 256 MiB of float32
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(tmp_path / "dcp"), str(16 * MiB)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    added = json.loads(out.stdout.strip().splitlines()[-1])["added"]
    assert added < 160 * MiB, f"{added / MiB:.0f} MiB added for a 256 MiB tensor"
    loaded = {"big": torch.zeros(64 << 20)}
    dcp.load(loaded, storage_reader=S3StorageReader(str(tmp_path / "dcp")), no_dist=True)
    assert bool((loaded["big"] == 1).all())
