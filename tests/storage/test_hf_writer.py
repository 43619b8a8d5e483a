"""``S3HuggingFaceStorageWriter``: exports from 1 and 2 real gloo ranks to the local S3 servers, loaded back
with the released ``safetensors.safe_open`` (on a downloaded copy), dcp_s3's reader and torch's
``HuggingFaceStorageReader``, bit-exact; the index is the commit (conditional, last, never left by a failed
save); shards composed server-side by UploadPartCopy from the ranks' pieces, staging deleted after."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from counting_proxy import CountingProxy
from dist_utils import run_ranks
from fault_proxy import FaultProxy, Rule
from hostile import root_causes
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

from dcp_s3 import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    S3HuggingFaceStorageReader,
    S3HuggingFaceStorageWriter,
    S3TransferError,
)
from dcp_s3._local_server import LocalS3Server
from dcp_s3._torch_compat import checkpoint_failures

MiB = 1 << 20


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big.f32": torch.randn(8192, 1024, generator=g),  # 32 MiB: each of 2 ranks' halves over S3's 5 MiB parts
        "w.bf16": torch.randn(64, 48, generator=g).bfloat16(),
        "i.i64": torch.arange(-7, 57, dtype=torch.int64).reshape(16, 4),
        "tiny.f32": torch.tensor([1.5]),
        "scalar.f32": torch.tensor(2.5),
    }


def _download(s3: LocalS3Server, bucket: str, prefix: str, folder: Path) -> list[str]:
    client = s3.client()
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])]
    folder.mkdir(parents=True, exist_ok=True)
    for key in names:
        client.download_file(bucket, key, os.fspath(folder / key.rsplit("/", 1)[1]))
    return sorted(k[len(prefix) + 1 :] for k in names)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].contiguous().view(-1).view(torch.uint8), v.contiguous().view(-1).view(torch.uint8)), k


def _check_export(s3: LocalS3Server, bucket: str, prefix: str, tmp: Path, want: dict[str, torch.Tensor]) -> list[str]:
    names = _download(s3, bucket, prefix, tmp)
    assert not any(n.startswith(".dcp_s3") for n in names), names  # staging deleted
    index = json.loads((tmp / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    got = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(os.fspath(tmp / file), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is no dict: keys() is its API)
                got[k] = f.get_tensor(k)
    _assert_bit_exact(got, want)
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=S3HuggingFaceStorageReader(f"s3://{bucket}/{prefix}"), no_dist=True)
    _assert_bit_exact(out, want)
    return names


def test_one_rank_export_loads_everywhere(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    want = _tensors()
    dcp.save(want, storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/one"), no_dist=True)
    names = _check_export(s3_env, bucket, "one", tmp_path, want)
    assert names == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]  # index even for one
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:  # pragma: no cover - older torch
        return
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=HuggingFaceStorageReader(os.fspath(tmp_path)), no_dist=True)
    _assert_bit_exact(out, want)


def test_shards_split_by_max_shard_size(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    want = _tensors()
    writer = S3HuggingFaceStorageWriter(f"s3://{bucket}/split", max_shard_size=1 * MiB)
    dcp.save(want, storage_writer=writer, no_dist=True)
    names = _check_export(s3_env, bucket, "split", tmp_path, want)
    assert names[:2] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], names


def _two_rank_job(rank: int, world: int, env: dict[str, str], uri: str, mode: str) -> bytes:
    os.environ.update(env)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _tensors()
    state: dict[str, Any] = {}
    for k, v in full.items():
        if mode == "fsdp2":
            continue
        placement = Shard(0) if v.dim() and v.shape[0] % world == 0 else Replicate()
        state[k] = distribute_tensor(v, mesh, [placement])
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Sequential(torch.nn.Linear(1024, 8192), torch.nn.Linear(8192, 3, dtype=torch.bfloat16))
        torch.manual_seed(1)
        for p in model.parameters():
            torch.nn.init.normal_(p)
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        assert state["0.weight"].to_local().shape[0] == 8192 // world  # each rank holds half
    dcp.save(state, storage_writer=S3HuggingFaceStorageWriter(uri))
    buf = io.BytesIO()
    torch.save(full, buf)  # bytes, not tensors: shared tensor memory dies with the rank's process
    return buf.getvalue() if rank == 0 else b""


@pytest.mark.parametrize("mode", ["dtensor", "fsdp2"])
def test_two_ranks_export_consolidated_tensors(seaweed: LocalS3Server, bucket: str, tmp_path: Path, mode: str) -> None:
    """Each rank's half of the 32 MiB tensor reaches the shard by UploadPartCopy: the coordinator reads only
    the ~5 MiB that tops the header up to S3's minimum part (and the small tensors), not the 32 MiB."""
    uri = f"s3://{bucket}/{mode}"
    with CountingProxy(seaweed.endpoint_url) as proxy:
        env = {**seaweed.env(), "AWS_ENDPOINT_URL": proxy.url}
        want = torch.load(io.BytesIO(run_ranks(_two_rank_job, 2, env, uri, mode)[0]))
        rows = dict(proxy.requests), dict(proxy.body_bytes)
    total = sum(v.nbytes for v in want.values())
    copies = sum(n for (op, key), n in rows[0].items() if op == "UploadPartCopy")
    read_back = sum(n for (op, key), n in rows[1].items() if op.startswith("GetObject") and "/.dcp_s3-hf-" in key)
    assert copies >= 2
    assert read_back <= 6 * MiB < total - 24 * MiB, (read_back, total)
    _check_export(seaweed, bucket, mode, tmp_path, want)


def test_second_export_is_refused_and_overwrite_replaces(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/twice"
    first = _tensors()
    dcp.save(first, storage_writer=S3HuggingFaceStorageWriter(uri), no_dist=True)
    second = {k: v + 1 for k, v in first.items()}
    with pytest.raises(BaseException) as info:
        dcp.save(second, storage_writer=S3HuggingFaceStorageWriter(uri), no_dist=True)
    assert any(isinstance(c, CheckpointExistsError) for c in root_causes(info.value))
    _check_export(s3_env, bucket, "twice", tmp_path / "a", first)  # untouched
    dcp.save(second, storage_writer=S3HuggingFaceStorageWriter(uri, overwrite=True), no_dist=True)
    _check_export(s3_env, bucket, "twice", tmp_path / "b", second)


class _RacingPlanner(dcp.DefaultSavePlanner):
    """Commits another export's index at the prefix while this save writes its data (after planning)."""

    def __init__(self, s3: LocalS3Server, bucket: str, key: str) -> None:
        super().__init__()
        self.s3, self.bucket, self.key = s3, bucket, key

    def resolve_data(self, write_item: Any) -> Any:
        client = self.s3.client()
        client.put_object(Bucket=self.bucket, Key=self.key, Body=b'{"weight_map": {"x": "other.safetensors"}}')
        return super().resolve_data(write_item)


def test_index_is_written_conditionally(s3_env: LocalS3Server, bucket: str) -> None:
    """Past the planning check, the index PUT itself (If-None-Match) refuses to replace a racing export's."""
    key = "race/model.safetensors.index.json"
    planner = _RacingPlanner(s3_env, bucket, key)
    with pytest.raises(BaseException) as info:
        dcp.save(_tensors(), storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/race"), planner=planner)
    assert any(isinstance(c, CheckpointExistsError) for c in root_causes(info.value))
    body = s3_env.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert b"other.safetensors" in body  # the racing export's index stands


def test_failed_save_leaves_no_index_and_is_refused(moto_server: LocalS3Server, monkeypatch: Any) -> None:
    """The second shard's completion fails for good: the first shard is there, the index is not, and the
    reader refuses the prefix as an incomplete export; the staging pieces are deleted."""
    bucket = moto_server.create_bucket(f"fail-{os.getpid()}-{id(monkeypatch)}")
    rules = [Rule({"CompleteMultipartUpload", "PutObject"}, "500", key_contains="model-00002")]
    with FaultProxy(moto_server.endpoint_url, rules) as proxy:
        for name, value in moto_server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        uri = f"s3://{bucket}/torn"
        writer = S3HuggingFaceStorageWriter(uri, max_shard_size=1 * MiB)
        with pytest.raises(CheckpointException) as info:
            dcp.save(_tensors(), storage_writer=writer, no_dist=True)
        assert any(isinstance(c, S3TransferError) for c in checkpoint_failures(info.value))
        assert proxy.injected("500") >= 1
        keys = [o["Key"] for o in moto_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert "torn/model-00001-of-00002.safetensors" in keys
        assert "torn/model.safetensors.index.json" not in keys
        assert not [k for k in keys if "/.dcp_s3" in k], keys
        with pytest.raises(BaseException) as info:
            dcp.load({"tiny.f32": torch.zeros(1)}, storage_reader=S3HuggingFaceStorageReader(uri), no_dist=True)
        (cause,) = root_causes(info.value)
        assert isinstance(cause, CheckpointNotFoundError) and uri in str(cause)


def test_local_directory_export(tmp_path: Path) -> None:
    want = {**_tensors(), "empty.f32": torch.zeros(0, 3)}  # a zero-element tensor has a header entry, no bytes
    dcp.save(want, storage_writer=S3HuggingFaceStorageWriter(os.fspath(tmp_path / "ex")), no_dist=True)
    got = {}
    with safe_open(os.fspath(tmp_path / "ex" / "model-00001-of-00001.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is no dict: keys() is its API)
            got[k] = f.get_tensor(k)
    _assert_bit_exact(got, want)
    assert sorted(os.listdir(tmp_path / "ex")) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


def test_options_of_another_format_are_refused() -> None:
    with pytest.raises(ConfigError, match="compression"):
        S3HuggingFaceStorageWriter("s3://bkt/x", compression="zstd")
    with pytest.raises(ConfigError, match="max_shard_size"):
        S3HuggingFaceStorageWriter("s3://bkt/x", max_shard_size=0)


def test_takes_the_writers_options_and_pickles(tmp_path: Path) -> None:
    """``S3StorageWriter``'s keyword options pass through (checked by it); a pickled copy saves."""
    import pickle

    from dcp_s3 import ClientConfig, TransferConfig

    with pytest.raises(ConfigError, match="max_concurrency"):
        S3HuggingFaceStorageWriter(os.fspath(tmp_path), max_concurrency=0)
    writer = S3HuggingFaceStorageWriter(
        "s3://bkt/x",
        endpoint_url="http://127.0.0.1:9",
        region="eu-west-1",
        client=ClientConfig(read_timeout=7.0),
        transfer=TransferConfig(part_size=8 * MiB),
        max_concurrency=3,
    )
    assert writer._session.transfer.max_concurrency == 3 and writer._session.transfer.part_size == 8 * MiB
    assert repr(writer) == "S3HuggingFaceStorageWriter('s3://bkt/x', overwrite=False)"
    copy = pickle.loads(pickle.dumps(S3HuggingFaceStorageWriter(os.fspath(tmp_path / "p"), max_shard_size=99)))
    assert isinstance(copy, S3HuggingFaceStorageWriter) and copy.max_shard_size == 99 and "HuggingFace" in repr(copy)
    want = _tensors()
    dcp.save(want, storage_writer=copy, no_dist=True)
    assert (
        len({n for n in os.listdir(tmp_path / "p") if n.endswith(".safetensors")}) == 4
    )  # 99-byte shards: tiny + scalar share one


def test_export_loads_with_transformers_from_pretrained(s3_env: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    """A model's state dict exported, downloaded beside its config.json, loads with ``from_pretrained``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save(want, storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/llama"), no_dist=True)
    _download(s3_env, bucket, "llama", tmp_path)
    config.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    got = loaded.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


_KILLED_CHILD = """
import sys, torch, torch.distributed.checkpoint as dcp
from dcp_s3 import S3HuggingFaceStorageWriter
g = torch.Generator().manual_seed(0)
state = {"big.f32": torch.randn(2048, 1024, generator=g), "small.bf16": torch.randn(64, 48, generator=g).bfloat16()}
dcp.save(state, storage_writer=S3HuggingFaceStorageWriter(sys.argv[1], max_shard_size=1 << 20), no_dist=True)
"""


def test_killed_save_leaves_no_index(s3_env: LocalS3Server, bucket: str) -> None:
    """SIGKILL while the second shard is being written (its request held by a proxy): the first shard is
    there, the index is not, and the reader refuses the prefix."""
    import subprocess
    import sys
    import time

    rules = [Rule({"CompleteMultipartUpload", "PutObject"}, "stall", key_contains="model-00002", stall_s=30)]
    uri = f"s3://{bucket}/killed"
    with FaultProxy(s3_env.endpoint_url, rules, lifetime_s=120) as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, uri], env=env)
        try:
            deadline = time.monotonic() + 120
            while proxy.injected("stall") == 0 and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proxy.injected("stall") == 1, child.poll()
        finally:
            child.kill()
            child.wait()
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "killed/model-00001-of-00002.safetensors" in keys
    assert "killed/model.safetensors.index.json" not in keys
    with pytest.raises(BaseException) as info:
        dcp.load({"small.bf16": torch.zeros(64, 48)}, storage_reader=S3HuggingFaceStorageReader(uri), no_dist=True)
    assert any(isinstance(c, CheckpointNotFoundError) for c in root_causes(info.value))


def test_server_ignoring_if_none_match_is_refused(moto_server: LocalS3Server, monkeypatch: Any) -> None:
    """A server that ignores If-None-Match (played by a proxy dropping the header) cannot hold the commit's
    promise: refused with ServerCapabilityError before anything is written, unless the caller accepts a HEAD."""
    from dcp_s3 import ServerCapabilityError

    bucket = moto_server.create_bucket(f"nocond-{os.getpid()}-{id(monkeypatch)}")
    with FaultProxy(moto_server.endpoint_url, drop_request_headers={"if-none-match"}) as proxy:
        for name, value in moto_server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with pytest.raises(BaseException) as info:
            dcp.save(_tensors(), storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/a"), no_dist=True)
        assert any(isinstance(c, ServerCapabilityError) for c in root_causes(info.value))
        assert not moto_server.client().list_objects_v2(Bucket=bucket).get("Contents")
        with pytest.warns(RuntimeWarning, match="If-None-Match"):
            writer = S3HuggingFaceStorageWriter(f"s3://{bucket}/b", require_conditional_writes=False)
            dcp.save(_tensors(), storage_writer=writer, no_dist=True)
        keys = [o["Key"] for o in moto_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert "b/model.safetensors.index.json" in keys


def test_shard_replaced_by_a_racing_export_is_refused(s3_env: LocalS3Server, bucket: str) -> None:
    """Shard names are fixed by the format: an export racing to the same prefix can replace a shard after
    this export's index was committed. Every shard carries the export id its index records, so the reader
    refuses the mix, naming the shard, instead of loading another export's tensors."""
    from dcp_s3 import CheckpointFormatError

    want = _tensors()
    dcp.save(want, storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/a"), no_dist=True)
    other = {k: v + 1 for k, v in want.items()}
    dcp.save(other, storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/b"), no_dist=True)
    name = "model-00001-of-00001.safetensors"
    s3_env.client().copy_object(Bucket=bucket, Key=f"a/{name}", CopySource={"Bucket": bucket, "Key": f"b/{name}"})
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    with pytest.raises(BaseException) as info:
        dcp.load(out, storage_reader=S3HuggingFaceStorageReader(f"s3://{bucket}/a"), no_dist=True)
    (cause,) = root_causes(info.value)
    assert isinstance(cause, CheckpointFormatError) and f"s3://{bucket}/a/{name}" in str(cause)
