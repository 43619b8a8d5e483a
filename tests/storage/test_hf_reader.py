"""``S3HuggingFaceStorageReader``: Hugging Face safetensors exports, written by the released ``safetensors``,
``transformers`` and torch's ``HuggingFaceStorageWriter``, uploaded with boto3 to the local S3 server and
loaded through dcp_s3's reader; hostile headers and indexes refused naming the object; a torn export refused;
a 2-rank FSDP2 load that reads (nearly) only the bytes of each rank's shards."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from counting_proxy import CountingProxy, reset
from dist_utils import run_ranks
from hostile import root_causes
from safetensors.torch import load_file, save, save_file

from dcp_s3 import CheckpointFormatError, CheckpointNotFoundError, S3HuggingFaceStorageReader
from dcp_s3._local_server import LocalS3Server


def _upload(s3: LocalS3Server, bucket: str, prefix: str, folder: Path) -> list[str]:
    client = s3.client()
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    for name in names:
        client.upload_file(os.fspath(folder / name), bucket, f"{prefix}/{name}")
    return names


def _put(s3: LocalS3Server, bucket: str, key: str, body: bytes) -> None:
    s3.client().put_object(Bucket=bucket, Key=key, Body=body)


def _load(uri: str, like: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros(v.shape, dtype=dtype or v.dtype) for k, v in like.items()}
    dcp.load(out, storage_reader=S3HuggingFaceStorageReader(uri), no_dist=True)
    return out


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(-1).view(torch.uint8), v.contiguous().view(-1).view(torch.uint8)), k


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(33, 17, generator=g),
        "w.bf16": torch.randn(8, 5, 3, generator=g).bfloat16(),
        "w.f16": torch.randn(40, generator=g).half(),
        "w.f64": torch.randn(3, 3, generator=g).double(),
        "i.i64": torch.arange(-5, 20),
        "i.i32": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "i.u8": torch.arange(200, dtype=torch.uint8),
        "b.bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_safetensors_save_file_loads_bit_exact(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    want = _tensors()
    save_file(want, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _upload(s3_env, bucket, "single", tmp_path)
    _assert_bit_exact(_load(f"s3://{bucket}/single", want), want)


def test_local_directory_loads_bit_exact(tmp_path: Path) -> None:
    want = _tensors()
    save_file(want, tmp_path / "model.safetensors")
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in want.items()}
    dcp.load(out, storage_reader=S3HuggingFaceStorageReader(os.fspath(tmp_path)), no_dist=True)
    _assert_bit_exact(out, want)


def test_bf16_file_loads_into_fp32(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    want = {"w": torch.randn(64, 48).bfloat16(), "b": torch.randn(48).bfloat16()}
    save_file(want, tmp_path / "model.safetensors")
    _upload(s3_env, bucket, "bf16", tmp_path)
    got = _load(f"s3://{bucket}/bf16", want, dtype=torch.float32)
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k


def test_save_pretrained_sharded_several_dtypes(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.h[0].to(torch.bfloat16)  # several dtypes in one export
    model.transformer.h[1].to(torch.float16)
    model.save_pretrained(tmp_path, max_shard_size="20KB", safe_serialization=True)
    names = _upload(s3_env, bucket, "gpt2", tmp_path)
    shards = [n for n in names if n.endswith(".safetensors")]
    assert "model.safetensors.index.json" in names and len(shards) > 2, names
    want: dict[str, torch.Tensor] = {}
    for shard in shards:
        want.update(load_file(tmp_path / shard))
    assert {torch.float32, torch.bfloat16, torch.float16} <= {v.dtype for v in want.values()}
    got = _load(f"s3://{bucket}/gpt2", want)
    _assert_bit_exact(got, want)
    params = dict(model.state_dict())
    assert all(torch.equal(got[k], params[k]) for k in got)


def test_torch_hf_storage_writer_export_loads_bit_exact(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    want = {"a.weight": torch.randn(16, 8), "a.bias": torch.randn(8).bfloat16(), "b.weight": torch.randn(4, 4)}
    writer = HuggingFaceStorageWriter(
        os.fspath(tmp_path), fqn_to_index_mapping={"a.weight": 1, "a.bias": 1, "b.weight": 2}
    )
    dcp.save(dict(want), storage_writer=writer, no_dist=True)
    names = _upload(s3_env, bucket, "torchhf", tmp_path)
    assert "model.safetensors.index.json" in names, names
    _assert_bit_exact(_load(f"s3://{bucket}/torchhf", want), want)


def test_torn_export_is_refused(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    """Shards without an index (and no model.safetensors): an incomplete export, never globbed."""
    want = {"w": torch.randn(4, 4)}
    save_file(want, tmp_path / "model-00001-of-00002.safetensors")
    _upload(s3_env, bucket, "torn", tmp_path)
    with pytest.raises(BaseException) as info:
        _load(f"s3://{bucket}/torn", want)
    (cause,) = root_causes(info.value)
    assert isinstance(cause, CheckpointNotFoundError)
    assert f"s3://{bucket}/torn" in str(cause)


# -- hostile headers and indexes -----------------------------------------------------------------------------
def _raw(header: dict[str, Any], data: bytes, declared: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if declared is None else declared) + text + data


def _spec(dtype: str, shape: list[int], lo: int, hi: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [lo, hi]}


HOSTILE = {
    # 2**40 declared: would be a terabyte-sized header allocation if believed
    "oversized_header_length": _raw({"w": _spec("F32", [4], 0, 16)}, bytes(16), declared=1 << 40),
    "header_past_object_end": _raw({"w": _spec("F32", [4], 0, 16)}, bytes(16), declared=10_000),
    "offsets_outside_object": _raw({"w": _spec("F32", [4], 0, 16), "v": _spec("F32", [4], 16, 32)}, bytes(16)),
    "overlapping_offsets": _raw({"w": _spec("F32", [4], 0, 16), "v": _spec("F32", [2, 2], 8, 24)}, bytes(24)),
    "dtype_shape_mismatch": _raw({"w": _spec("F32", [5], 0, 16)}, bytes(16)),
    "huge_shape": _raw({"w": _spec("F32", [1 << 62, 1 << 62], 0, 16)}, bytes(16)),
    "negative_shape": _raw({"w": _spec("F32", [-4], 0, 16)}, bytes(16)),
    "unknown_dtype": _raw({"w": _spec("X128", [1], 0, 16)}, bytes(16)),
    "torch_per_rank_piece": _raw(
        {
            "__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [4]}})},
            "w": _spec("F32", [4], 0, 16),
        },
        bytes(16),
    ),
    "not_json": struct.pack("<Q", 5) + b"{nope" + bytes(4),
    "deep_nesting": struct.pack("<Q", 200_000) + b"[" * 200_000,
    "not_utf8": struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc",
    "duplicate_name": struct.pack("<Q", 0) + b"",  # replaced below (json.dumps cannot repeat a key)
}
_dup = b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
HOSTILE["duplicate_name"] = struct.pack("<Q", len(_dup)) + _dup + bytes(2)
_nan = b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}'
HOSTILE["non_finite_number"] = struct.pack("<Q", len(_nan)) + _nan + bytes(4)


def _expect_format_error(uri: str, like: dict[str, torch.Tensor], where: str) -> CheckpointFormatError:
    with pytest.raises(BaseException) as info:
        _load(uri, like)
    (cause,) = root_causes(info.value)
    assert isinstance(cause, CheckpointFormatError), repr(cause)
    assert where in str(cause), str(cause)
    return cause


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_is_refused_naming_the_object(s3_env: LocalS3Server, bucket: str, case: str) -> None:
    _put(s3_env, bucket, f"{case}/model.safetensors", HOSTILE[case])
    _expect_format_error(f"s3://{bucket}/{case}", {"w": torch.zeros(4)}, f"s3://{bucket}/{case}/model.safetensors")


@pytest.mark.parametrize(
    "target", ["../x.safetensors", "sub/x.safetensors", "/abs.safetensors", "x.bin", "..safetensors", 7]
)
def test_index_naming_a_file_outside_the_prefix_is_refused(s3_env: LocalS3Server, bucket: str, target: Any) -> None:
    _put(s3_env, bucket, "x.safetensors", save({"w": torch.zeros(4)}))  # what ../x.safetensors would reach
    _put(s3_env, bucket, "idx/x.safetensors", save({"w": torch.zeros(4)}))
    index = {"metadata": {}, "weight_map": {"w": target}}
    _put(s3_env, bucket, "idx/model.safetensors.index.json", json.dumps(index).encode())
    _expect_format_error(f"s3://{bucket}/idx", {"w": torch.zeros(4)}, f"s3://{bucket}/idx/model.safetensors.index.json")


def test_index_naming_too_many_shards_is_refused_before_any_shard_is_read(s3_env: LocalS3Server, bucket: str) -> None:
    from dcp_s3._dcp.safetensors_header import MAX_SHARDS

    index = {"weight_map": {f"w{i}": f"s{i}.safetensors" for i in range(MAX_SHARDS + 1)}}
    _put(s3_env, bucket, "many/model.safetensors.index.json", json.dumps(index).encode())
    cause = _expect_format_error(f"s3://{bucket}/many", {"w0": torch.zeros(4)}, "model.safetensors.index.json")
    assert str(MAX_SHARDS) in str(cause)


def test_index_and_headers_must_agree(s3_env: LocalS3Server, bucket: str) -> None:
    """A weight_map name its shard does not hold, and a tensor in two shards, are refused."""
    _put(s3_env, bucket, "ag/a.safetensors", save({"w": torch.zeros(4)}))
    _put(s3_env, bucket, "ag/b.safetensors", save({"w": torch.ones(4), "v": torch.ones(2)}))
    index = {"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}
    _put(s3_env, bucket, "ag/model.safetensors.index.json", json.dumps(index).encode())
    _expect_format_error(f"s3://{bucket}/ag", {"w": torch.zeros(4)}, f"s3://{bucket}/ag/")


# -- 2 ranks, FSDP2: bytes read per rank ---------------------------------------------------------------------
DIM = 256
LAYERS = 4


def _fsdp_job(rank: int, world: int, env: dict[str, str], uri: str, urls: list[str]) -> dict[str, int]:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    os.environ.update(env)
    torch.manual_seed(123)  # the same model on every rank, then its shard kept
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)])
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    state = model.state_dict()
    needed = sum(v.to_local().numel() * v.element_size() for v in state.values())
    reset(urls[rank])
    dcp.load(state, storage_reader=S3HuggingFaceStorageReader(uri, endpoint_url=urls[rank]))
    read = reset(urls[rank])
    for k, v in state.items():
        assert torch.equal(v.full_tensor(), want[k]), k
    return {
        "needed": needed,
        "read": read.bytes(),
        "ranged_gets": read.requests("GetObjectRange"),
        "heads": read.requests("HeadObject"),
    }


@pytest.mark.multiproc
def test_fsdp2_two_ranks_read_only_their_shards(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    from torch import nn

    torch.manual_seed(123)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)])
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    half = LAYERS // 2
    shards = {"model-00001-of-00002.safetensors": [], "model-00002-of-00002.safetensors": []}
    for k in state:
        shards[sorted(shards)[int(k.split(".")[0]) >= half]].append(k)
    for name, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / name)
    weight_map = {k: name for name, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _upload(seaweed, bucket, "fsdp", tmp_path)
    proxies = [CountingProxy(seaweed.endpoint_url) for _ in range(2)]
    for p in proxies:
        p.__enter__()
    try:
        figures = run_ranks(_fsdp_job, 2, seaweed.env(), f"s3://{bucket}/fsdp", [p.url for p in proxies])
    finally:
        for p in proxies:
            p.__exit__(None, None, None)
    total = sum(v.numel() * v.element_size() for v in state.values())
    print("bytes per rank:", figures, "model bytes:", total)
    for fig in figures:
        assert fig["needed"] == total // 2
        assert fig["read"] <= 1.1 * fig["needed"], figures
    # The index and headers are read by the coordinator and shared; every other rank reads one range per tensor.
    assert figures[1]["heads"] == 0 and figures[1]["ranged_gets"] == len(state), figures


def _replicated_job(rank: int, world: int, env: dict[str, str], uri: str, urls: list[str]) -> dict[str, int]:
    import torch.distributed as dist

    os.environ.update(env)
    want = load_file(env["HF_TEST_FILE"])
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    reset(urls[rank])
    reader = S3HuggingFaceStorageReader(uri, endpoint_url=urls[rank], replica_group=dist.group.WORLD)
    dcp.load(state, storage_reader=reader)
    read = reset(urls[rank])
    _assert_bit_exact(state, want)
    return {"read": read.bytes()}


@pytest.mark.multiproc
def test_replicated_ranks_read_each_byte_once(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    """Two ranks loading the whole model with ``replica_group``: each reads about half, and both get all of it."""
    want = {f"w{i}": torch.randn(128, 128) for i in range(8)}
    save_file(want, tmp_path / "model.safetensors")
    _upload(seaweed, bucket, "rep", tmp_path)
    env = {**seaweed.env(), "HF_TEST_FILE": os.fspath(tmp_path / "model.safetensors")}
    proxies = [CountingProxy(seaweed.endpoint_url) for _ in range(2)]
    for p in proxies:
        p.__enter__()
    try:
        figures = run_ranks(_replicated_job, 2, env, f"s3://{bucket}/rep", [p.url for p in proxies])
    finally:
        for p in proxies:
            p.__exit__(None, None, None)
    total = sum(v.numel() * v.element_size() for v in want.values())
    print("replicated bytes per rank:", figures, "model bytes:", total)
    assert sum(f["read"] for f in figures) <= 1.1 * total, figures
    assert all(f["read"] <= 0.6 * total for f in figures), figures


def test_header_longer_than_the_first_read(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    """A header past the first GET's bytes is read with a second GET, and loads."""
    want = {f"layers.{i}.a_rather_long_parameter_name.weight": torch.full((2,), float(i)) for i in range(600)}
    save_file(want, tmp_path / "model.safetensors")
    assert int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little") > 16 << 10
    _upload(s3_env, bucket, "long", tmp_path)
    _assert_bit_exact(_load(f"s3://{bucket}/long", want), want)


def test_header_length_cap_holds_however_large_the_object() -> None:
    """The 100 MiB cap, not only the object's size, bounds the header read (a 1 TiB object declaring 2**40)."""
    from dcp_s3._dcp.safetensors_header import MAX_HEADER_BYTES, header_length

    assert header_length(struct.pack("<Q", MAX_HEADER_BYTES), 1 << 50, "obj") == MAX_HEADER_BYTES
    with pytest.raises(CheckpointFormatError, match="at most") as info:
        header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1), 1 << 50, "s3://b/obj.safetensors")
    assert "s3://b/obj.safetensors" in str(info.value)


def _placements_job(rank: int, world: int, env: dict[str, str], uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(env)
    want = load_file(env["HF_TEST_FILE"])
    mesh = init_device_mesh("cpu", (world,))
    placements = {"rows": Shard(0), "cols": Shard(1), "rep": Replicate(), "odd": Shard(0)}
    state = {
        k: distribute_tensor(torch.zeros(v.shape, dtype=torch.float32), mesh, [placements[k]]) for k, v in want.items()
    }
    dcp.load(state, storage_reader=S3HuggingFaceStorageReader(uri))
    for k, v in want.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k].full_tensor(), v.float()), k


@pytest.mark.multiproc
def test_dtensor_placements_cast_from_bf16(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    """Row, column, replicated and uneven DTensor pieces on 2 ranks, fp32 destinations from a bf16 file."""
    want = {
        "rows": torch.randn(64, 24).bfloat16(),
        "cols": torch.randn(10, 32).bfloat16(),
        "rep": torch.randn(7, 3).bfloat16(),
        "odd": torch.randn(5, 6).bfloat16(),
    }
    save_file(want, tmp_path / "model.safetensors")
    _upload(s3_env, bucket, "place", tmp_path)
    env = {**s3_env.env(), "HF_TEST_FILE": os.fspath(tmp_path / "model.safetensors")}
    run_ranks(_placements_job, 2, env, f"s3://{bucket}/place")


def test_takes_the_readers_options_and_pickles(tmp_path: Path) -> None:
    """The same keyword options as ``S3StorageReader`` (one settings path), checked the same way; a copy loads."""
    import inspect
    import pickle

    from dcp_s3 import ConfigError, S3StorageReader

    assert inspect.signature(S3HuggingFaceStorageReader) == inspect.signature(S3StorageReader)
    with pytest.raises(ConfigError, match="max_concurrency"):
        S3HuggingFaceStorageReader(os.fspath(tmp_path), max_concurrency=0)
    want = {"w": torch.randn(3, 5)}
    save_file(want, tmp_path / "model.safetensors")
    reader = pickle.loads(pickle.dumps(S3HuggingFaceStorageReader(os.fspath(tmp_path), max_concurrency=3)))
    assert isinstance(reader, S3HuggingFaceStorageReader) and "S3HuggingFaceStorageReader" in repr(reader)
    out = {"w": torch.zeros(3, 5)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    _assert_bit_exact(out, want)
