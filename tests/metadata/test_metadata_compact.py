"""The compact ``.metadata`` format: round trips (hand-built and real checkpoints), lazy parts,
the writer's ``metadata_format`` and ``convert --format dcp`` back to the stock format."""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3 import S3StorageReader, S3StorageWriter, ScalableSavePlanner
from dcp_s3 import _layout as layout
from dcp_s3._codec import CODEC_NAME, CODEC_VERSION, GROUP_FLOAT, FrameIndex
from dcp_s3._layout import CODEC_DESCRIPTOR, ItemLocation
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata import formats
from dcp_s3._metadata.compact import MAGIC
from dcp_s3._metadata.compact_chunks import ExplicitChunks, RuleChunks
from dcp_s3._metadata.compact_read import materialize
from dcp_s3._metadata.compact_storage import CompactStorage
from dcp_s3._metadata.compact_write import dump_compact
from dcp_s3._metadata.formats import dump_metadata, load_metadata
from dcp_s3._planners.load import ScalableLoadPlanner
from dcp_s3._torch_compat import _StorageInfo
from dcp_s3.errors import ConfigError
from tests.objects import object_keys

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

S = torch.Size


def fsdp_chunks(size: tuple[int, ...], n: int, dim: int = 0) -> list[ChunkStorageMetadata]:
    """torch.chunk's split along ``dim``, trailing chunks empty, as FSDP2 records it."""
    d = size[dim]
    step = -(-d // n)
    out = []
    for i in range(n):
        lo = min(i * step, d)
        off, sz = [0] * len(size), list(size)
        off[dim], sz[dim] = lo, min(lo + step, d) - lo
        out.append(ChunkStorageMetadata(S(off), S(sz)))
    return out


def hand_built() -> Metadata:
    """Every kind of entry the stock format can hold, with dcp_s3's and torch's storage entries."""
    f32, bf16 = TensorProperties(dtype=torch.float32), TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    odd = TensorProperties(dtype=torch.float16, memory_format=torch.channels_last, pin_memory=True)
    grid = [ChunkStorageMetadata(S([r, c]), S([2, 3])) for r in (0, 2) for c in (0, 3)]
    state: dict[str, Any] = {
        "w": TensorStorageMetadata(f32, S([10, 4]), fsdp_chunks((10, 4), 4)),  # 3,3,3,1
        "tiny": TensorStorageMetadata(bf16, S([2, 5]), fsdp_chunks((2, 5), 4)),  # 1,1,0,0: empty chunks
        "cols": TensorStorageMetadata(odd, S([3, 8, 2, 2]), fsdp_chunks((3, 8, 2, 2), 2, dim=1)),
        "grid": TensorStorageMetadata(f32, S([4, 6]), grid),  # 2-D sharding: explicit arrays
        "scalar": TensorStorageMetadata(f32, S([]), [ChunkStorageMetadata(S([]), S([]))]),
        "partial": TensorStorageMetadata(f32, S([8]), fsdp_chunks((8,), 4)),  # only some chunks stored
        "bytes": BytesStorageMetadata(),
        "unstored": BytesStorageMetadata(),
    }
    frames = FrameIndex(CODEC_NAME, CODEC_VERSION, 4, GROUP_FLOAT, 8, 4, (3, 9), 0b10)
    storage: dict[MetadataIndex, Any] = {}
    pos = 0

    def put(fqn: str, offsets: Any, nbytes: int, index: int | None = None, **kw: Any) -> None:
        nonlocal pos
        cls = kw.pop("cls", ItemLocation)
        extra = {} if cls is _StorageInfo else {"payload_offset": 64, "crc32c": (pos * 2654435761) % (1 << 32)}
        extra.update(kw)
        length = nbytes + (64 if "payload_offset" in extra and extra["payload_offset"] else 0)
        storage[MetadataIndex(fqn, offsets, index)] = cls(
            f"__{pos % 3}_0.0123456789abcdef.distcp", pos, length, **extra
        )
        pos += length + 7

    for c in state["w"].chunks:
        put("w", c.offsets, 12 * c.sizes[0] * 4, index=0)
    for c in state["tiny"].chunks[:3]:  # duplicate offsets (the empty chunks) map to the first of them
        put("tiny", c.offsets, c.sizes[0] * 10, index=None)
    for i, c in enumerate(state["cols"].chunks):
        put("cols", c.offsets, 3 * 4 * 2 * 2 * 2, index=i, cls=_StorageInfo)
    for c in grid:
        put("grid", c.offsets, 24, index=7)
    put("scalar", S([]), 4)
    put("partial", S([2]), 8, payload_offset=None, crc32c=None, frames=None, frame_crc32c=None, cls=ItemLocation)
    del storage[MetadataIndex("partial", S([2]))]
    storage[MetadataIndex("partial", S([2]))] = ItemLocation(
        "p-3/__1_0.0123456789abcdef.distcp", 4096, 31, [CODEC_DESCRIPTOR], frames=frames, frame_crc32c=(1, 2)
    )
    storage[MetadataIndex("partial", S([6]))] = _StorageInfo("__2_0.distcp", 0, 9, ("torch.zstd",))
    storage[MetadataIndex("bytes")] = ItemLocation("__0_0.0123456789abcdef.distcp", 9000, 77, crc32c=5)
    planner = {"w": ("model", "w"), "grid": ("model", 3, "grid"), "nested": [1.5, {"a": None, 4: True}]}
    meta = StorageMeta(
        checkpoint_id=pathlib.PurePosixPath("/ckpt/step"), save_id="s", load_id=None, modules=["dcp_s3/1"]
    )
    md = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage, storage_meta=meta)
    md.version = "1.0.0"
    return md


def test_hand_built_metadata_round_trips() -> None:
    md = hand_built()
    blob = dump_metadata(md, "compact")
    assert blob.startswith(MAGIC)
    back = load_metadata(blob, "s3://b/k/.metadata")
    assert type(back) is Metadata and back == md and md == back
    assert back.version == "1.0.0" and back.planner_data == md.planner_data
    assert back.storage_meta == md.storage_meta
    chunks = {k: v.chunks for k, v in back.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert isinstance(chunks["w"], RuleChunks) and isinstance(chunks["cols"], RuleChunks)
    assert isinstance(chunks["tiny"], RuleChunks) and isinstance(chunks["grid"], ExplicitChunks)
    assert isinstance(back.storage_data, CompactStorage) and len(back.storage_data) == len(md.storage_data)
    for key, info in md.storage_data.items():  # every entry, with its exact class and fields
        got = back.storage_data[key]
        assert type(got) is type(info) and got == info, key
    assert dict(back.storage_data.items()) == md.storage_data
    assert {k.index for k in back.storage_data} == {k.index for k in md.storage_data}
    assert MetadataIndex("partial", S([4])) not in back.storage_data
    assert MetadataIndex("w", S([1, 0])) not in back.storage_data
    assert back.storage_data.get(MetadataIndex("unstored")) is None
    # What a replacing save deletes comes from the object column alone, and names the same objects.
    assert layout.referenced_objects(back) == {info.relative_path for info in md.storage_data.values()}
    assert layout.referenced_objects(back) == layout.referenced_objects(md) != set()
    # Torch pickles it compactly (the lazy parts reduce to the compact bytes), and it round-trips.
    assert pickle.loads(pickle.dumps(back)) == md
    # The stock format from a compact load: plain lists and dicts, readable by the restricted unpickler.
    stock = dump_metadata(back, "dcp")
    assert not stock.startswith(MAGIC)
    again = load_metadata(stock, "stock")
    assert again == md and type(again.storage_data) is dict
    assert all(
        type(v.chunks) is list for v in again.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata)
    )
    assert type(materialize(back).storage_data) is dict


def test_rule_chunks_match_the_explicit_list() -> None:
    for size, n, dim in [((10, 4), 4, 0), ((2, 5), 4, 0), ((0, 3), 3, 0), ((7,), 7, 0), ((3, 9), 4, 1), ((5,), 1, 0)]:
        listed = fsdp_chunks(size, n, dim)
        rule = RuleChunks(S(size), dim, n)
        assert rule == listed and list(rule) == listed and rule[-1] == listed[-1] and rule[1:3] == listed[1:3]
        for i, c in enumerate(listed):
            assert rule.find(c.offsets) == next(j for j, d in enumerate(listed) if d.offsets == c.offsets), (size, i)
        for o in range(size[dim] + 2):  # any offset: the first chunk there, or None
            for other in (0, 1):
                probe = [other] * len(size)
                probe[dim] = o
                want = next((j for j, d in enumerate(listed) if list(d.offsets) == probe), None)
                assert rule.find(probe) == want, (size, probe)
        with pytest.raises(IndexError):
            rule[n]


def test_auto_and_stock_formats() -> None:
    md = hand_built()
    assert dump_metadata(md, "auto") == dump_metadata(md, "dcp")  # small: stock, for torch's readers
    with pytest.raises(ConfigError, match="metadata_format='pickle'"):
        dump_metadata(md, "pickle")
    with pytest.raises(ConfigError, match="metadata_format"):
        S3StorageWriter("s3://b/p", metadata_format="zip")
    odd = hand_built()
    odd.planner_data = {"fn": object()}  # not describable: compact refuses, auto falls back to stock
    with pytest.raises(ConfigError, match="compact format"):
        dump_compact(odd)


def test_auto_writes_compact_above_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    md = hand_built()
    monkeypatch.setattr(formats, "AUTO_COMPACT_CHUNKS", 5)
    assert dump_metadata(md, "auto").startswith(MAGIC)
    odd = hand_built()  # a byte item keyed with an offset: valid stock metadata, not describable compactly
    odd.storage_data[MetadataIndex("unstored", S([0]))] = ItemLocation("__0_0.distcp", 0, 3)
    with pytest.raises(ConfigError, match="unstored"):
        dump_compact(odd)
    stock = dump_metadata(odd, "auto")  # auto falls back to the stock pickle
    assert not stock.startswith(MAGIC) and load_metadata(stock, "x") == odd


def fsdp_like_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {
            "w": torch.randn(37, 16),
            "b": torch.randn(16).to(torch.bfloat16),
            "i": torch.arange(12).reshape(3, 4),
        },
        "optim": {"step": 7, "lr": 0.5, "name": "adamw", "m": torch.randn(37, 16)},
    }


def blank(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return type(state)() if isinstance(state, (int, float, str)) else state


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_real_checkpoint_round_trips_and_loads(bucket: str, s3_env: LocalS3Server, compression: str | None) -> None:
    state = fsdp_like_state()
    client = s3_env.client()
    for fmt in ("dcp", "compact"):
        uri = f"s3://{bucket}/{fmt}"
        # The compact save goes through ScalableSavePlanner (packed plans, the array-based global step).
        planner = ScalableSavePlanner() if fmt == "compact" else None
        dcp.save(
            state,
            storage_writer=S3StorageWriter(uri, metadata_format=fmt, compression=compression),
            planner=planner,
            no_dist=True,
        )
        body = client.get_object(Bucket=bucket, Key=f"{fmt}/.metadata")["Body"].read()
        assert body.startswith(MAGIC) == (fmt == "compact")
        md = load_metadata(body, uri)
        assert load_metadata(dump_compact(md), "again") == md  # real metadata: compact round trip
        for planner in (DefaultLoadPlanner(), ScalableLoadPlanner()):
            out = blank(state)
            dcp.load(out, storage_reader=S3StorageReader(uri), planner=planner, no_dist=True)
            assert out["optim"]["step"] == 7 and out["optim"]["name"] == "adamw"
            for part in ("model", "optim"):
                for k, v in state[part].items():
                    if isinstance(v, torch.Tensor):
                        assert torch.equal(out[part][k], v) and out[part][k].dtype == v.dtype, (fmt, k)


def test_small_saves_stay_stock_and_load_with_filesystem_reader(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """metadata_format="auto" (the default) below the threshold: a downloaded copy loads with torch."""
    state = fsdp_like_state()
    uri = f"s3://{bucket}/auto"
    dcp.save(state, storage_writer=S3StorageWriter(uri), no_dist=True)
    download(s3_env, bucket, "auto", tmp_path / "copy")
    assert not (tmp_path / "copy" / ".metadata").read_bytes().startswith(MAGIC)
    out = blank(state)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "copy"), no_dist=True)
    assert torch.equal(out["model"]["w"], state["model"]["w"])


def download(s3_env: LocalS3Server, bucket: str, prefix: str, dest: Path) -> None:
    client = s3_env.client()
    for key in object_keys(client, bucket, prefix + "/"):
        path = dest / key[len(prefix) + 1 :]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def test_convert_to_dcp_writes_stock_metadata(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compressed, compact checkpoint -> ``convert --format dcp`` -> downloaded -> torch's FileSystemReader."""
    from dcp_s3.admin import convert_checkpoint

    monkeypatch.setattr(formats, "AUTO_COMPACT_CHUNKS", 0)  # every save would be compact with "auto"
    state = {"w": torch.randn(33, 8), "v": torch.arange(10, dtype=torch.int16), "meta": {"epoch": 3}}
    src = f"s3://{bucket}/src"
    dcp.save(state, storage_writer=S3StorageWriter(src, compression="zstd"), no_dist=True)
    client = s3_env.client()
    assert client.get_object(Bucket=bucket, Key="src/.metadata")["Body"].read().startswith(MAGIC)
    convert_checkpoint(src, f"s3://{bucket}/plain", fmt="dcp")
    download(s3_env, bucket, "plain", tmp_path / "plain")
    assert not (tmp_path / "plain" / ".metadata").read_bytes().startswith(MAGIC)
    out = {"w": torch.zeros(33, 8), "v": torch.zeros(10, dtype=torch.int16), "meta": {"epoch": 0}}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "plain"), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["v"], state["v"]) and out["meta"] == {"epoch": 3}


def test_inspect_verify_and_overwrite_on_a_compact_checkpoint(
    bucket: str, s3_env: LocalS3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI reads compact metadata; a save over a compact checkpoint deletes the objects it replaced."""
    from dcp_s3._cli import commands as cli

    state = fsdp_like_state()
    uri = f"s3://{bucket}/ckpt"
    dcp.save(state, storage_writer=S3StorageWriter(uri, metadata_format="compact", compression="zstd"), no_dist=True)
    first = set(object_keys(s3_env.client(), bucket, "ckpt/"))
    assert cli.main(["verify", uri]) == 0, capsys.readouterr()
    assert cli.main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and "37" in out
    # Corrupt one data object: verify (which walks every compact entry) reports it.
    client = s3_env.client()
    data = next(k for k in first if k.endswith(".distcp"))
    body = bytearray(client.get_object(Bucket=bucket, Key=data)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=data, Body=bytes(body))
    assert cli.main(["verify", uri]) != 0
    capsys.readouterr()
    dcp.save(state, storage_writer=S3StorageWriter(uri, metadata_format="compact"), no_dist=True)
    second = set(object_keys(s3_env.client(), bucket, "ckpt/"))
    assert not (first - {"ckpt/.metadata"}) & second  # the replaced save's objects are gone
    out_state = blank(state)
    dcp.load(out_state, storage_reader=S3StorageReader(uri), planner=ScalableLoadPlanner(), no_dist=True)
    assert torch.equal(out_state["model"]["w"], state["model"]["w"])


def test_stock_pickle_of_rule_chunks_is_the_pickle_of_their_list() -> None:
    """The planner's RuleChunks, written in the stock format, give the file the list gives (equal
    offsets and sizes shared, as torch's planner shares them): not a larger one."""
    shapes = {"a": ((64, 8), 0, 16), "b": ((5, 64), 1, 16), "c": ((3,), 0, 16), "s": ((), -1, 1)}
    known: dict[tuple[int, ...], torch.Size] = {}
    lazy, listed = {}, {}
    for fqn, (shape, dim, n) in shapes.items():
        rule = RuleChunks(S(shape), dim, n)
        lazy[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), S(shape), rule)
        listed[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), S(shape), rule.as_list(known))
        assert listed[fqn].chunks == list(rule)
    a = materialize(Metadata(lazy, {}, {}))
    b = materialize(Metadata(listed, {}, {}))  # lists kept as they are
    assert a == b and type(a.state_dict_metadata["a"].chunks) is list
    assert len(pickle.dumps(a)) == len(pickle.dumps(b))
    firsts = [c.offsets for md in a.state_dict_metadata.values() for c in md.chunks[:1] if len(c.offsets) == 2]
    assert firsts[0] is firsts[1]  # (0, 0) shared across tensors
