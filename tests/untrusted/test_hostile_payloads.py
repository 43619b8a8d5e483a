"""Hostile stored bytes (issue 12, classes 1-3 and malformed metadata): real servers, real payloads.

Each payload is a genuine checkpoint tampered with as someone with write access to the
bucket would (see ``hostile.py``). A payload that runs creates a marker file; every test
asserts the marker never appears, on every path that reads a checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
import pickle
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hostile import (
    Call,
    CallWith,
    MiB,
    PeakRss,
    colliding_offsets,
    get_op,
    global_op,
    int_op,
    load_direct,
    pickle_ops,
    put_op,
    read_metadata,
    replace_byte_items,
    root_causes,
    torch_saved,
    touch,
    unicode_op,
    with_pickle,
    write_metadata,
)
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
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
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from dcp_s3 import CheckpointFormatError, S3StorageReader, S3StorageWriter
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._codec import CODEC_NAME, CODEC_VERSION, GROUP_FLOAT, FrameIndex
from dcp_s3._layout import CODEC_DESCRIPTOR, ItemLocation
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._untrusted.byte_items import byte_item_problem
from dcp_s3.admin import convert_checkpoint, inspect_checkpoint, verify_checkpoint


def state() -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(3, 4), "cfg": {"lr": 0.1, "name": "run"}, "step": 7}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "cfg": {"lr": 0.0, "name": ""}, "step": 0}


def skeleton(value: Any) -> Any:
    """The structure DCP flattens (dicts, lists of dicts) with every byte item replaced by None."""
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return [skeleton(v) for v in value]
    return None


def poisoned(uri: str, payload: Any) -> list[str]:
    dcp.save(state(), storage_writer=S3StorageWriter(uri))
    return replace_byte_items(uri, torch_saved(payload))


class RawPlanner(DefaultLoadPlanner):
    """A careless custom planner: unpickles byte items with plain pickle."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = pickle.loads(value.read())


# -- class 1: no code execution from any stored byte ------------------------------------------------
@pytest.mark.parametrize("planner", [DefaultLoadPlanner, RawPlanner])
def test_reduce_payload_in_byte_items_never_runs_through_dcp_load(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, planner: type
) -> None:
    marker = tmp_path / "pwned"
    uri = f"s3://{bucket}/ck"
    assert set(poisoned(uri, touch(marker))) == {"cfg.lr", "cfg.name", "step"}
    with pytest.raises(BaseException) as info:
        dcp.load(blank(), storage_reader=S3StorageReader(uri), planner=planner())
    (cause,) = root_causes(info.value)
    assert isinstance(cause, CheckpointFormatError)
    assert "posix.system" in str(cause) and f"s3://{bucket}/ck/" in str(cause)
    assert any(name in str(cause) for name in ("cfg.lr", "cfg.name", "step"))
    assert not marker.exists()


class TrainState:
    """The stateful train state of torch's own DCP end-to-end tests: ``losses`` travels as an ``io.BytesIO``."""

    def __init__(self, step: int = 0, losses: list[float] | None = None) -> None:
        self.step, self.losses = step, losses or []

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": self.step, "losses": buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state["losses"].seek(0)
        self.step, self.losses = state["step"], torch.load(state["losses"], weights_only=True)


def test_torchs_own_train_state_with_a_bytesio_loads_by_default(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/train"
    dcp.save({"w": torch.ones(3), "train": TrainState(5, [0.5, 0.25])}, storage_writer=S3StorageWriter(uri))
    out: dict[str, Any] = {"w": torch.zeros(3), "train": TrainState()}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert out["train"].step == 5 and out["train"].losses == [0.5, 0.25] and torch.equal(out["w"], torch.ones(3))


def test_opt_in_and_safe_globals_load_trusted_byte_items(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/frac"
    dcp.save({"w": torch.ones(2), "ratio": Fraction(1, 3)}, storage_writer=S3StorageWriter(uri))
    with pytest.raises(CheckpointFormatError, match=r"ratio .*fractions\.Fraction.*allow_unsafe_byte_items"):
        load_direct(uri, {"w": torch.zeros(2), "ratio": None})
    out: dict[str, Any] = {"w": torch.zeros(2), "ratio": None}
    dcp.load(out, storage_reader=S3StorageReader(uri, allow_unsafe_byte_items=True))
    assert out["ratio"] == Fraction(1, 3)
    out = {"w": torch.zeros(2), "ratio": None}
    with torch.serialization.safe_globals([Fraction]):  # the narrow way: allowlist one class
        dcp.load(out, storage_reader=S3StorageReader(uri))
    assert out["ratio"] == Fraction(1, 3)
    # The opt-in really switches the check off (so it must be asked for explicitly).
    marker = tmp_path / "ran"
    poisoned(f"s3://{bucket}/ok", touch(marker))
    out = blank()
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/ok", allow_unsafe_byte_items=True))
    assert marker.exists()


def test_legitimate_byte_items_still_load(bucket: str, s3_env: LocalS3Server) -> None:
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(3))], lr=0.1, betas=(0.8, 0.9))
    values = {
        "param_groups": opt.state_dict()["param_groups"],
        "i": 3,
        "s": "text",
        "f": 0.5,
        "b": b"raw",
        "t": (1, "two"),
        "none": None,
        "flag": True,
        "big": 2**80,
        "c": 1 + 2j,
        "set": {1, 2},
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "dev": torch.device("cpu"),
        "ba": bytearray(b"xy"),
    }
    uri = f"s3://{bucket}/legit"
    dcp.save({"w": torch.ones(2), "v": values}, storage_writer=S3StorageWriter(uri))
    out: dict[str, Any] = {"w": torch.zeros(2), "v": skeleton(values)}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert out["v"] == values


def test_checkpointer_load_refuses_poisoned_optimizer_state(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    model = nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    Checkpointer(f"s3://{bucket}/run").save({"m": model}, {"m": optim}, iteration=5)
    run = Checkpointer(f"s3://{bucket}/run")
    optim_part = next(
        e.name.rpartition("/")[0]
        for e in run.store.list_objects()
        if e.name.endswith("/.metadata") and "_optim" in e.name
    )
    uri = f"s3://{bucket}/run/{optim_part}"
    assert "param_groups" in " ".join(replace_byte_items(uri, torch_saved(touch(marker))))
    with pytest.raises(BaseException) as info:
        run.load({"m": model}, {"m": optim})
    assert any(isinstance(c, CheckpointFormatError) and "posix.system" in str(c) for c in root_causes(info.value))
    assert not marker.exists()
    # storage_options reach the reader: the opt-in lets the payload through.
    # param_groups is then os.system's return value: torch trips on it where it first looks (no one error type).
    with pytest.raises(BaseException):  # noqa: B017 -- the marker file below is what this asserts
        Checkpointer(f"s3://{bucket}/run", allow_unsafe_byte_items=True).load({"m": model}, {"m": optim})
    assert marker.exists()


def test_convert_inspect_and_verify_never_run_payloads(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    uri = f"s3://{bucket}/ck"
    poisoned(uri, touch(marker))
    with pytest.raises(BaseException) as info:
        convert_checkpoint(uri, str(tmp_path / "out.pt"))
    assert any(isinstance(c, CheckpointFormatError) and "posix.system" in str(c) for c in root_causes(info.value))
    assert not (tmp_path / "out.pt").exists()
    assert {e.fqn for e in inspect_checkpoint(uri)} == {"w", "cfg.lr", "cfg.name", "step"}
    report = verify_checkpoint(uri)
    flagged = {p.item for p in report.problems if "posix.system" in p.message}
    assert flagged == {"cfg.lr", "cfg.name", "step"}
    assert not marker.exists()
    convert_checkpoint(uri, str(tmp_path / "trusted.pt"), src_options={"allow_unsafe_byte_items": True})
    assert marker.exists()  # the opt-in reaches convert's reader


def test_metadata_payload_never_runs_through_inspect_verify_or_load(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    uri = f"s3://{bucket}/ck"
    dcp.save(state(), storage_writer=S3StorageWriter(uri))
    write_metadata(uri, pickle.dumps(touch(marker)))
    with pytest.raises(CheckpointFormatError, match="refusing to load posix.system"):
        inspect_checkpoint(uri)
    (problem,) = verify_checkpoint(uri).problems
    assert "posix.system" in problem.message
    with pytest.raises(BaseException, match="posix.system"):
        dcp.load(blank(), storage_reader=S3StorageReader(uri))
    assert not marker.exists()


def test_local_checkpoints_are_checked_too(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ck"
    dcp.save(state(), storage_writer=FileSystemWriter(str(ckpt)), no_dist=True)
    assert replace_byte_items(str(ckpt), torch_saved(touch(marker)))
    with pytest.raises(BaseException) as info:
        convert_checkpoint(str(ckpt), str(tmp_path / "out.pt"))
    assert any(isinstance(c, CheckpointFormatError) and "posix.system" in str(c) for c in root_causes(info.value))
    assert {p.item for p in verify_checkpoint(str(ckpt)).problems} == {"cfg.lr", "cfg.name", "step"}
    assert not marker.exists()


def test_byte_item_forms_torch_load_would_run_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(touch(marker), buf, _use_new_zipfile_serialization=False)
    legacy = buf.getvalue()
    scripted = io.BytesIO()
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), scripted)
    assert "legacy" in str(byte_item_problem(legacy))
    assert "legacy or raw" in str(byte_item_problem(pickle.dumps(touch(marker))))
    assert "TorchScript" in str(byte_item_problem(scripted.getvalue()))
    assert "torch.nn.modules.linear.Linear" in str(byte_item_problem(torch_saved(nn.Linear(2, 2))))
    # a storage claiming more bytes than its record holds (torch would allocate the claim)
    ones = torch_saved(torch.ones(2))
    assert byte_item_problem(with_pickle(ones, lambda pkl: pkl)) is None
    claim = with_pickle(
        ones, lambda pkl: pkl.replace(b"K\x02t", pickle.BININT + (1 << 28).to_bytes(4, "little") + b"t")
    )
    assert "claims 1073741824 bytes, its record holds 8" in str(byte_item_problem(claim))
    assert not marker.exists()


def test_byte_item_keys_that_collide_by_design_are_refused() -> None:
    pairs = colliding_offsets(100)  # int pairs with one tuple hash: a quadratic dict to build
    assert "share one hash" in str(byte_item_problem(torch_saved({p: 1 for p in pairs})))
    assert "share one hash" in str(byte_item_problem(torch_saved(set(pairs))))
    # ordinary keys of every kind, and one key repeated across many dicts, are fine
    assert byte_item_problem(torch_saved({(1, "a"): 2, 2.5: 1, 2**70: 3, None: 0, b"k": 1})) is None
    assert byte_item_problem(torch_saved([{("a", 1): i} for i in range(40)])) is None


# -- class 2: .metadata cannot change anything outside the object it builds ---------------------------
_TARGETS = [
    ("dcp_s3.layout", "ItemLocation", ItemLocation),
    ("dcp_s3.codec", "FrameIndex", FrameIndex),
    ("torch.distributed.checkpoint.metadata", "Metadata", Metadata),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex", MetadataIndex),
    ("torch.distributed.checkpoint.metadata", "TensorProperties", TensorProperties),
    ("pathlib", "PosixPath", pathlib.PosixPath),
    ("torch.serialization", "_get_layout", torch.serialization._get_layout),
    ("collections", "OrderedDict", collections.OrderedDict),
]


@pytest.mark.parametrize(("module", "name", "target"), _TARGETS, ids=[t[1] for t in _TARGETS])
def test_metadata_cannot_set_attributes_on_a_class(
    bucket: str, s3_env: LocalS3Server, module: str, name: str, target: Any
) -> None:
    uri = f"s3://{bucket}/ck"
    dcp.save({"w": torch.ones(2)}, storage_writer=S3StorageWriter(uri))
    body = pickle.dumps(read_metadata(uri), protocol=2)[2:-1]  # the genuine metadata, minus PROTO/STOP
    before = dict(vars(target))
    for state in (  # slot state (setattr) and dict state (__dict__.update)
        pickle.NONE + pickle.EMPTY_DICT + unicode_op("__reduce_ex__") + pickle.NONE + pickle.SETITEM + pickle.TUPLE2,
        pickle.EMPTY_DICT + unicode_op("payload_offset") + int_op(5) + pickle.SETITEM,
    ):
        # BUILD on the class object, POP it, then the genuine metadata: the load would "succeed".
        write_metadata(uri, pickle_ops(global_op(module, name), state, pickle.BUILD, pickle.POP, body))
        with pytest.raises(CheckpointFormatError, match=f"refusing to set state on .*{name}"):
            S3StorageReader(uri).read_metadata()
        assert dict(vars(target)) == before
    # The process still saves and loads (the class was not poisoned).
    dcp.save({"w": torch.ones(2)}, storage_writer=S3StorageWriter(f"s3://{bucket}/after"))
    out = {"w": torch.zeros(2)}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/after"))
    assert torch.equal(out["w"], torch.ones(2))


def test_metadata_name_lookup_imports_nothing() -> None:
    """``torch.<name>`` resolves only dtypes, from a table: a lazy torch submodule is never imported."""
    script = textwrap.dedent(
        """
        import sys, pickle
        import dcp_s3._metadata.formats as layout
        from dcp_s3 import CheckpointFormatError
        lazy = [m for m in ("_dynamo", "_inductor", "_export", "onnx") if f"torch.{m}" not in sys.modules]
        assert lazy, "every lazy submodule is already imported"
        for m in lazy:
            data = b"\\x80\\x02" + pickle.GLOBAL + f"torch\\n{m}\\n".encode() + pickle.STOP
            try:
                layout.load_metadata(data, "crafted")
            except CheckpointFormatError as exc:
                assert f"torch.{m}" in str(exc), exc
            else:
                raise AssertionError("loaded")
            assert f"torch.{m}" not in sys.modules, m
        print("ok", lazy)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr


@pytest.mark.parametrize(
    ("ops", "match"),
    [
        # a dataclass created through its constructor (REDUCE) rather than NEWOBJ
        (global_op("dcp_s3.layout", "ItemLocation") + pickle.EMPTY_TUPLE + pickle.REDUCE, "refusing to call"),
        # BUILD twice on one instance, and a dunder attribute
        (
            global_op("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + pickle.EMPTY_DICT
            + pickle.BUILD
            + pickle.EMPTY_DICT
            + pickle.BUILD,
            "state set twice",
        ),
        (
            global_op("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + pickle.EMPTY_DICT
            + unicode_op("__class__")
            + pickle.NONE
            + pickle.SETITEM
            + pickle.BUILD,
            "sets attribute '__class__'",
        ),
        # NEWOBJ of a builtin, extension codes, persistent ids
        (global_op("builtins", "set") + pickle.EMPTY_TUPLE + pickle.NEWOBJ, "refusing to create"),
        (pickle.EXT1 + b"\x01", "EXT1"),
        (pickle.NONE + pickle.BINPERSID, "BINPERSID"),
        # appending to a non-list, items on a non-dict, a torch.Size of floats
        (global_op("collections", "OrderedDict") + pickle.NONE + pickle.APPEND, "refusing to add items"),
        (
            global_op("torch", "Size") + pickle.BINFLOAT + b"\0" * 8 + pickle.TUPLE1 + pickle.TUPLE1 + pickle.REDUCE,
            "non-integer",
        ),
    ],
    ids=["reduce-dataclass", "build-twice", "dunder-state", "newobj-builtin", "ext", "persid", "append", "size"],
)
def test_restricted_unpickler_refuses(ops: bytes, match: str) -> None:
    with pytest.raises(CheckpointFormatError, match=match):
        load_metadata(pickle_ops(ops), "crafted")


# -- class 3: resource bounds from untrusted sizes ------------------------------------------------------
@pytest.mark.timeout(120)
def test_lying_frame_index_is_refused_before_any_allocation(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/z"
    dcp.save({"w": torch.randn(4096)}, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = read_metadata(uri)
    (info,) = md.storage_data.values()
    for raw_length, frame_size, match in ((512 * MiB, 512 * MiB, "at most"), (512 * MiB, 4 * MiB, "decodes to")):
        lie = object.__new__(FrameIndex)  # bypass validation, as a crafted pickle would
        for field in dataclasses.fields(FrameIndex):
            object.__setattr__(lie, field.name, getattr(info.frames, field.name))
        object.__setattr__(lie, "raw_length", raw_length)
        object.__setattr__(lie, "frame_size", frame_size)
        object.__setattr__(lie, "ends", tuple(range(1, -(-raw_length // frame_size) + 1)))
        info.frames, info.frame_crc32c = lie, (0,) * len(lie.ends)
        write_metadata(uri, md)
        with PeakRss().watch() as rss, pytest.raises(CheckpointFormatError, match=match):
            load_direct(uri, {"w": torch.zeros(4096)})
        assert rss.growth < 128 * MiB, rss.growth


def test_compressed_item_without_checksums_is_refused(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/z"
    dcp.save({"w": torch.randn(4096)}, storage_writer=S3StorageWriter(uri, compression="zstd"))
    md = read_metadata(uri)
    (info,) = md.storage_data.values()
    info.frame_crc32c = None
    write_metadata(uri, md)
    with pytest.raises(CheckpointFormatError, match=r"storage entry w\[0\]: frame_crc32c is None"):
        load_direct(uri, {"w": torch.zeros(4096)})


@pytest.mark.timeout(120)
def test_byte_item_length_lie_allocates_nothing(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/ck"
    dcp.save(state(), storage_writer=S3StorageWriter(uri))
    for offset, length in ((None, 512 * MiB), (1 << 40, 16)):  # runs off the end; starts past it
        md = read_metadata(uri)
        (info,) = [info for index, info in md.storage_data.items() if index.fqn == "step"]
        info.offset, info.length = info.offset if offset is None else offset, length  # the object holds ~4 KiB
        write_metadata(uri, md)
        with (
            PeakRss().watch() as rss,
            pytest.raises(CheckpointFormatError, match="shorter than the checkpoint metadata"),
        ):
            load_direct(uri, blank())
        assert rss.growth < 128 * MiB, rss.growth
        assert any("truncated" in p.message for p in verify_checkpoint(uri).problems)


def _shared_chunks_bomb(tensors: int, chunks: int) -> Metadata:
    """Every tensor shares one list of ``chunks`` references to one chunk: 10^8 chunks to iterate."""
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
    shared = [chunk] * chunks
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([1])
    sdm = {f"t{i}": TensorStorageMetadata(props, size, shared) for i in range(tensors)}
    return Metadata(state_dict_metadata=sdm, storage_data={})  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_expanding_metadata_is_bounded_in_time_and_memory(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/bomb"
    dcp.save({"w": torch.ones(2)}, storage_writer=S3StorageWriter(uri))
    data = pickle.dumps(_shared_chunks_bomb(10_000, 10_000), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) < 512 * 1024
    write_metadata(uri, data)
    with PeakRss().watch() as rss:
        with pytest.raises(CheckpointFormatError, match="expands far beyond its size"):
            inspect_checkpoint(uri)
        with pytest.raises(CheckpointFormatError, match="expands far beyond its size"):
            S3StorageReader(uri).read_metadata()
        assert any("expands far beyond" in p.message for p in verify_checkpoint(uri).problems)
    assert rss.growth < 256 * MiB, rss.growth


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bomb", ["hash", "copy", "cycle"])
def test_metadata_pickle_bombs_fail_fast(bomb: str) -> None:
    if bomb == "hash":  # a DAG of nested tuples as a dict key: 2^100 steps to hash
        ops = (
            pickle.EMPTY_DICT
            + pickle.EMPTY_TUPLE
            + b"".join(put_op(i) + pickle.POP + get_op(i) + get_op(i) + pickle.TUPLE2 for i in range(100))
            + pickle.NONE
            + pickle.SETITEM
        )
        match = "used as a dict key"
    elif bomb == "copy":  # list(<memo'd 100,000-element list>) 40,000 times: 4 * 10^9 element copies
        big = pickle.EMPTY_LIST + pickle.MARK + int_op(1) * 100_000 + pickle.APPENDS + put_op(0)
        call = (
            global_op("builtins", "list") + put_op(1) + pickle.POP + get_op(0) + pickle.TUPLE1 + put_op(2) + pickle.POP
        )
        ops = big + call + pickle.MARK + (get_op(1) + get_op(2) + pickle.REDUCE) * 40_000 + pickle.LIST
        match = "expands far beyond its size"
    else:  # planner data that contains itself
        md = Metadata(state_dict_metadata={}, storage_data={})
        loop: list[Any] = []
        loop.append(loop)
        md.planner_data = loop
        data = pickle.dumps(md, protocol=2)
        ops, match = data[2:-1], "expands far beyond its size"
    with PeakRss().watch() as rss, pytest.raises(CheckpointFormatError, match=match):
        load_metadata(pickle_ops(ops), "crafted")
    assert rss.growth < 256 * MiB, rss.growth


def test_colliding_metadata_keys_are_refused() -> None:
    """Offsets chosen so that every MetadataIndex key has one hash: building the dict would scan
    all earlier keys at each insertion (quadratic)."""
    md = genuine()
    for i, (a, b) in enumerate(colliding_offsets(200)):
        md.storage_data[MetadataIndex("w", torch.Size([a, b]))] = ItemLocation("__0_0.distcp", i, 1)
    with pytest.raises(CheckpointFormatError, match="keys of w share one hash"):
        load_metadata(pickle.dumps(md), "crafted")


@pytest.mark.timeout(120)
def test_byte_item_bombs_are_refused_before_torch_load(bucket: str, s3_env: LocalS3Server) -> None:
    """Bombs weights-only rules allow: bytearray(<int>), and one memo'd list copied by set() 20,000
    times (4 * 10^8 elements). Refused before the default planner's torch.load would build them."""
    shared = (list(range(20_000)),)  # one args tuple: pickled once, then referenced from the memo
    copies = [CallWith(set, shared) for _ in range(20_000)]
    for i, (payload, match) in enumerate(((Call(bytearray, 2**31 - 1), "bytearray"), (copies, "expands far beyond"))):
        uri = f"s3://{bucket}/ck{i}"
        dcp.save(state(), storage_writer=S3StorageWriter(uri))
        replace_byte_items(uri, torch_saved(payload))
        with PeakRss().watch() as rss, pytest.raises(CheckpointFormatError, match=match):
            load_direct(uri, blank())
        assert rss.growth < 256 * MiB, rss.growth


# -- malformed field values in .metadata: CheckpointFormatError naming the field, or a verify problem -----
def _frames(**fields: Any) -> FrameIndex:
    values = (
        dict(
            codec=CODEC_NAME,
            version=CODEC_VERSION,
            element_size=4,
            grouping=GROUP_FLOAT,
            raw_length=64,
            frame_size=4 * MiB,
            ends=(40,),
            raw_frames=0,
        )
        | fields
    )
    index = object.__new__(FrameIndex)  # bypasses validation, as a crafted pickle would
    for name, value in values.items():
        object.__setattr__(index, name, value)
    return index


def genuine() -> Metadata:
    """Well-formed metadata: a 2-chunk tensor (one plain, one compressed) and a byte item."""
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 8])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 8])),
    ]
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 8]), chunks),
            "step": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("w", torch.Size([0, 0]), 0): ItemLocation(
                "__0_0.distcp", 0, 600, None, payload_offset=500, crc32c=1
            ),
            MetadataIndex("w", torch.Size([2, 0]), 1): ItemLocation(
                "p-1/__1_0.distcp", 0, 40, [CODEC_DESCRIPTOR], frames=_frames(), frame_crc32c=(7,)
            ),
            MetadataIndex("step"): ItemLocation("__0_0.distcp", 600, 300, None, crc32c=5),
        },
        planner_data={"w": ("w",), "step": ("step",)},
        storage_meta=StorageMeta(checkpoint_id="s3://b/k", save_id="x", modules=["dcp_s3/1"]),
    )


def _entry(md: Metadata, fqn: str, n: int = 0) -> Any:
    return [info for index, info in md.storage_data.items() if index.fqn == fqn][n]


def _set(info: Any, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(info, name, value)


def _rekey(md: Metadata, old_fqn: str, new: MetadataIndex) -> None:
    (index,) = [i for i in md.storage_data if i.fqn == old_fqn][:1]
    md.storage_data[new] = md.storage_data.pop(index)


_MALFORMED: list[tuple[str, Any, str]] = [
    ("negative-offset", lambda md: setattr(_entry(md, "step"), "offset", -1), r"storage entry step: offset is -1"),
    ("bool-length", lambda md: setattr(_entry(md, "step"), "length", True), r"storage entry step: length is True"),
    ("str-length", lambda md: setattr(_entry(md, "step"), "length", "10"), r"length is '10'"),
    ("float-offset", lambda md: setattr(_entry(md, "step"), "offset", 1.5), r"offset is 1.5"),
    ("int-path", lambda md: setattr(_entry(md, "step"), "relative_path", 5), r"invalid object path 5"),
    (
        "escaping-path",
        lambda md: setattr(_entry(md, "step"), "relative_path", "../x/__0_0.distcp"),
        "invalid object path",
    ),
    ("missing-field", lambda md: delattr(_entry(md, "step"), "length"), r"step: field length is missing"),
    (
        "payload-past-end",
        lambda md: setattr(_entry(md, "w"), "payload_offset", 601),
        r"w\[0, 0\]: payload_offset is 601",
    ),
    ("crc-range", lambda md: setattr(_entry(md, "step"), "crc32c", 2**40), r"step: crc32c is 1099511627776"),
    (
        "short-item",
        lambda md: setattr(_entry(md, "w"), "length", 520),
        r"w\[0, 0\]: holds 20 bytes, too few for its chunk's 64",
    ),
    (
        "transforms-str",
        lambda md: setattr(_entry(md, "w", 1), "transform_descriptors", "zstd"),
        r"transform_descriptors is 'zstd'",
    ),
    (
        "frame-crcs",
        lambda md: setattr(_entry(md, "w", 1), "frame_crc32c", (1, 2)),
        r"w\[2, 0\]: frame_crc32c is a tuple, expected 1",
    ),
    ("block-size-zero", lambda md: setattr(_entry(md, "w"), "block_size", 0), r"w\[0, 0\]: block_size is 0"),
    (
        "block-crcs-count",
        lambda md: _set(_entry(md, "w"), block_size=16, block_crc32c=(1, 2)),
        r"w\[0, 0\]: block_crc32c is a tuple, expected 4",
    ),
    (
        "block-crcs-missing",
        lambda md: _set(_entry(md, "w"), block_size=16),
        r"block_crc32c missing for a payload of 4 blocks",
    ),
    (
        "block-crc-range",
        lambda md: _set(_entry(md, "w"), block_size=16, block_crc32c=(1, 2, 3, 2**40)),
        r"block_crc32c is 1099511627776",
    ),
    (
        "block-crcs-without-size",
        lambda md: setattr(_entry(md, "w"), "block_crc32c", (1, 2)),
        r"block_crc32c without block_size",
    ),
    (
        "blocks-on-frames",
        lambda md: setattr(_entry(md, "w", 1), "block_size", 16),
        r"block_size on an item that is not a checksummed raw tensor payload",
    ),
    ("bytes-with-blocks", lambda md: setattr(_entry(md, "step"), "block_size", 16), r"step: a byte item with"),
    ("frames-bool", lambda md: setattr(_entry(md, "w", 1), "frames", _frames(element_size=True)), "wrong type"),
    (
        "frames-decrease",
        lambda md: setattr(_entry(md, "w", 1), "frames", _frames(frame_size=32, ends=(30, 20))),
        "decrease",
    ),
    ("frames-huge", lambda md: setattr(_entry(md, "w", 1), "frames", _frames(frame_size=1 << 30)), "at most"),
    (
        "frames-past-item",
        lambda md: setattr(_entry(md, "w", 1), "frames", _frames(ends=(50,))),
        r"frames end at byte 50 of a 40-byte",
    ),
    (
        "frames-vs-chunk",
        lambda md: setattr(_entry(md, "w", 1), "frames", _frames(raw_length=4 * MiB)),
        r"decodes to 4194304 bytes, its chunk holds 64",
    ),
    ("bytes-with-frames", lambda md: setattr(_entry(md, "step"), "frames", _frames()), r"step: a byte item with"),
    (
        "chunk-ndim",
        lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", torch.Size([2])),
        r"tensor w: chunk 0 sizes is a Size",
    ),
    (
        "chunk-outside",
        lambda md: setattr(md.state_dict_metadata["w"].chunks[1], "offsets", torch.Size([3, 0])),
        r"chunk 1 .* lies outside",
    ),
    (
        "negative-size",
        lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([-1, 8])),
        r"tensor w: size is -1",
    ),
    (
        "chunks-tuple",
        lambda md: setattr(md.state_dict_metadata["w"], "chunks", tuple(md.state_dict_metadata["w"].chunks)),
        "chunks is a tuple",
    ),
    (
        "dtype-str",
        lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"),
        r"tensor w: dtype is 'float32'",
    ),
    (
        "requires-grad-int",
        lambda md: setattr(md.state_dict_metadata["w"].properties, "requires_grad", 1),
        "requires_grad is 1",
    ),
    ("properties-none", lambda md: setattr(md.state_dict_metadata["w"], "properties", None), "properties is None"),
    ("entry-int", lambda md: md.state_dict_metadata.__setitem__("step", 5), r"step: entry is 5"),
    ("unknown-fqn", lambda md: _rekey(md, "step", MetadataIndex("ghost")), r"ghost: not described"),
    (
        "no-such-chunk",
        lambda md: _rekey(md, "w", MetadataIndex("w", torch.Size([1, 0]))),
        "no chunk of the tensor at offset",
    ),
    ("fqn-int", lambda md: _rekey(md, "step", MetadataIndex(5)), r"MetadataIndex used as a key has fqn 5"),
    ("index-str", lambda md: _rekey(md, "step", MetadataIndex("step", None, "x")), r"step: index is 'x'"),
    ("str-key", lambda md: setattr(md, "storage_data", {"w": _entry(md, "w")}), r"storage data maps 'w' to"),
    ("version-int", lambda md: setattr(md, "version", 2), "version is 2"),
    ("storage-meta-dict", lambda md: setattr(md, "storage_meta", {"a": 1}), "storage_meta is a dict"),
]


def test_genuine_metadata_passes_validation() -> None:
    md = load_metadata(pickle.dumps(genuine()), "s3://b/k/.metadata")
    assert md.storage_data == genuine().storage_data


@pytest.mark.parametrize(("mutate", "match"), [c[1:] for c in _MALFORMED], ids=[c[0] for c in _MALFORMED])
def test_malformed_metadata_fields_are_format_errors_naming_them(mutate: Any, match: str) -> None:
    md = genuine()
    mutate(md)
    with pytest.raises(CheckpointFormatError, match=match) as info:
        load_metadata(pickle.dumps(md), "s3://b/k/.metadata")
    assert str(info.value).startswith("s3://b/k/.metadata: ")


def test_malformed_metadata_on_every_read_path(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/ck"
    dcp.save(state(), storage_writer=S3StorageWriter(uri))
    md = read_metadata(uri)
    _entry(md, "w").length = -5
    write_metadata(uri, md)
    match = r"storage entry w\[0, 0\]: length is -5"
    with pytest.raises(CheckpointFormatError, match=match):
        inspect_checkpoint(uri)
    (problem,) = verify_checkpoint(uri).problems
    assert "length is -5" in problem.message
    with pytest.raises(CheckpointFormatError, match=match):
        S3StorageReader(uri).read_metadata()
    with pytest.raises(BaseException, match="length is -5"):  # DCP re-raises it as an AssertionError
        dcp.load(blank(), storage_reader=S3StorageReader(uri))


def test_a_plan_beyond_the_stored_chunk_is_refused(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/ck"
    dcp.save({"w": torch.ones(3, 4)}, storage_writer=S3StorageWriter(uri))

    class Greedy(DefaultLoadPlanner):  # asks for 5 rows of a 3-row chunk
        def create_local_plan(self) -> LoadPlan:
            plan = super().create_local_plan()
            (item,) = plan.items
            return LoadPlan([dataclasses.replace(item, lengths=torch.Size([5, 4]))])

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            return torch.zeros(5, 4)

    with pytest.raises(
        CheckpointFormatError, match=r"the plan reads \[5, 4\] at \[0, 0\] of a stored chunk of \[3, 4\]"
    ):
        load_direct(uri, {"w": torch.zeros(3, 4)}, planner=Greedy())


def test_cli_convert_refuses_payloads_unless_told(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    from dcp_s3._cli import main

    marker = tmp_path / "pwned"
    uri = f"s3://{bucket}/ck"
    poisoned(uri, touch(marker))
    assert main(["convert", uri, str(tmp_path / "out.pt")]) == 1
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    assert main(["convert", str(tmp_path), str(tmp_path / "x.pt"), "--allow-unsafe-byte-items"]) == 1
    assert main(["convert", uri, str(tmp_path / "out.pt"), "--allow-unsafe-byte-items"]) == 0
    assert marker.exists()  # the flag reaches the reader (and the payload runs, as documented)


def test_metadata_pickle_with_a_key_and_no_value_is_refused() -> None:
    """SETITEMS over an odd number of items (a key without its value) is malformed: CPython's unpickler fails on
    it, and so does the metadata unpickler, instead of dropping the key."""
    md = Metadata(state_dict_metadata={}, storage_data={})
    md.planner_data = {"a": 1, "b": 2}
    data = pickle.dumps(md, protocol=2)
    cut = data.replace(pickle.BININT1 + b"\x02" + pickle.SETITEMS, pickle.SETITEMS, 1)  # b's value
    assert len(cut) == len(data) - 2
    assert load_metadata(data, "crafted").planner_data == {"a": 1, "b": 2}
    with pytest.raises(CheckpointFormatError, match="crafted"):
        load_metadata(cut, "crafted")
