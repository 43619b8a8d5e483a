"""``S3StorageWriter(key_prefixes=N)``: data objects spread over ``p-<hex>/`` directories of a checkpoint.

The multi-rank tests share one 3-rank job (module fixture ``spread``) that saves a plain DCP
checkpoint with ``key_prefixes=2`` and two Checkpointer steps with ``key_prefixes=16``; the tests
then load, copy, verify, corrupt and delete (copies of) what it wrote.
"""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_multirank import full
from test_storage import assert_same
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3 import _cli as cli
from dcp_s3._checkpointer import Checkpointer, latest_checkpoint
from dcp_s3._checkpointer.steps import scan
from dcp_s3._dcp import Entry
from dcp_s3._layout import is_key_prefix_dir, rank_prefix
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.base import relative_name_problem
from dcp_s3._untrusted.metadata_check import check_object_name
from dcp_s3.errors import CheckpointFormatError, ConfigError
from tests.objects import data_key, object_keys, untokened

PLAIN = "plain/ckpt"  # dcp.save with key_prefixes=2 on 3 ranks
RUN = "run"  # Checkpointer(key_prefixes=16), steps 1 and 2, keep_last=1
PLAIN_DATA = {"p-0/__0_0.distcp", "p-1/__1_0.distcp", "p-0/__2_0.distcp"}
STEP_DATA = {"p-0/__0_0.distcp", "p-1/__1_0.distcp", "p-2/__2_0.distcp"}


# -- names ------------------------------------------------------------------------------------------
def test_rank_prefix_names() -> None:
    assert [rank_prefix(r, 1) for r in (0, 1, 17)] == ["__0_", "__1_", "__17_"]
    assert rank_prefix(5) == "__5_"
    assert [rank_prefix(r, 16) for r in (0, 1, 15, 16, 33)] == [
        "p-0/__0_",
        "p-1/__1_",
        "p-f/__15_",
        "p-0/__16_",
        "p-1/__33_",
    ]
    # Two digits, reversed: slot 0x01 -> "10", 0x10 -> "01", 0xab -> "ba".
    assert [rank_prefix(r, 256) for r in (0, 1, 16, 171, 255, 256)] == [
        "p-00/__0_",
        "p-10/__1_",
        "p-01/__16_",
        "p-ba/__171_",
        "p-ff/__255_",
        "p-00/__256_",
    ]
    assert [rank_prefix(r, 17) for r in (0, 1, 16, 17)] == ["p-00/__0_", "p-10/__1_", "p-01/__16_", "p-00/__17_"]
    assert [rank_prefix(r, 2) for r in range(3)] == ["p-0/__0_", "p-1/__1_", "p-0/__2_"]
    assert rank_prefix(4097, 4096) == "p-100/__4097_"


@pytest.mark.parametrize("n", [2, 3, 16, 17, 100, 256, 4096])
def test_consecutive_ranks_differ_right_after_p(n: int) -> None:
    first = [rank_prefix(r, n)[2] for r in range(n)]
    assert all(a != b for a, b in itertools.pairwise(first)), first
    dirs = {rank_prefix(r, n).split("/")[0] for r in range(2 * n)}
    assert len(dirs) == n and all(is_key_prefix_dir(d) for d in dirs)
    assert all(check_object_name(rank_prefix(r, n) + "0.distcp") for r in range(n))


@pytest.mark.parametrize("bad", ["", "/x", "a//b", "a/", "./a", "a/../b", "s3://b/k", "a\\b", "a\0b", 5, None])
def test_metadata_object_names_follow_the_shared_rules_and_more(bad: Any) -> None:
    """check_object_name: the rules of every relative name (objstore.base), plus a str and no backslash."""
    with pytest.raises(CheckpointFormatError, match="metadata names an invalid object path"):
        check_object_name(bad)
    if isinstance(bad, str) and "\\" not in bad:  # the shared rules alone refuse it too
        assert relative_name_problem(bad) is not None
    with pytest.raises(CheckpointFormatError) as info:
        check_object_name("x" * 100_000 + "/..")
    assert len(str(info.value)) < 1000  # bounded: the name is untrusted input


@pytest.mark.parametrize("bad", [0, -3, 2.0, "16", True, None])
def test_bad_key_prefixes_are_config_errors(bad: Any) -> None:
    with pytest.raises(ConfigError, match=f"key_prefixes={bad!r}"):
        rank_prefix(0, bad)
    if bad is None:  # a storage option given as None means its default (dcp_s3._dcp.options)
        assert S3StorageWriter("s3://bucket/ckpt", key_prefixes=bad).key_prefixes == 1
        return
    with pytest.raises(ConfigError, match=f"key_prefixes={bad!r}"):
        S3StorageWriter("s3://bucket/ckpt", key_prefixes=bad)


def test_key_prefix_dir_names() -> None:
    assert is_key_prefix_dir("p-0") and is_key_prefix_dir("p-ba") and is_key_prefix_dir("p-100")
    assert not any(map(is_key_prefix_dir, ["p-", "p-G", "p-AB", "q-0", "p-0/x", "0000100.m_model", ""]))


# -- grouping a listing ---------------------------------------------------------------------------------
def _entries(*names: str) -> list[Entry]:
    return [Entry(n, 10, 1.0) for n in names]


def test_scan_puts_key_prefix_objects_in_their_checkpoint() -> None:
    steps = scan(
        _entries(
            "0000100.pth",
            "0000100.m_model/.metadata",
            "0000100.m_model/p-0/__0_0.distcp",
            "0000100.m_model/p-1/__1_0.distcp",
            "0000100.m_optim/p-0/__0_0.distcp",  # optimizer part uncommitted
            "plain/.metadata",
            "plain/p-00/__0_0.distcp",
            "plain/p-10/__1_0.distcp",
            "crashed/p-0/__0_0.distcp",
            "crashed/p-1/__1_0.distcp",  # nothing but data: an incomplete checkpoint
            "p-1/.metadata",
            "p-1/__0_0.distcp",  # a checkpoint that happens to be named p-1
            "p-1/p-0/__0_0.distcp",
        )
    )
    by_name = {s.name: s for s in steps}
    assert sorted(by_name) == ["0000100", "crashed", "p-1", "plain"]
    step = by_name["0000100"]
    assert step.kind == "step" and not step.complete and len(step.objects) == 5
    assert step.parts["m_model"].committed and not step.parts["m_optim"].committed
    assert {o.name for o in step.parts["m_model"].objects} == {
        "0000100.m_model/.metadata",
        "0000100.m_model/p-0/__0_0.distcp",
        "0000100.m_model/p-1/__1_0.distcp",
    }
    assert by_name["plain"].kind == "dcp" and by_name["plain"].complete and len(by_name["plain"].objects) == 3
    assert by_name["crashed"].kind == "dcp" and not by_name["crashed"].complete
    assert len(by_name["crashed"].objects) == 2
    assert by_name["p-1"].complete and len(by_name["p-1"].objects) == 3


def test_scan_of_a_checkpoint_itself() -> None:
    (step,) = scan(_entries(".metadata", "p-0/__0_0.distcp", "p-1/__1_0.distcp"))
    assert step.name == "" and step.kind == "dcp" and step.complete and len(step.objects) == 3
    (step,) = scan(_entries("p-0/__0_0.distcp"))
    assert step.name == "" and not step.complete


# -- one process --------------------------------------------------------------------------------------
def keys(server: LocalS3Server, bucket: str, prefix: str = "") -> dict[str, int]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    # Data object names carry a per-save token; these tests compare the names without it.
    return {untokened(o["Key"][len(prefix) :]): o["Size"] for page in pages for o in page.get("Contents", [])}


def test_single_process_round_trip(bucket: str, s3_env: LocalS3Server) -> None:
    sd = {f"w{i}": torch.randn(100 + i) for i in range(4)} | {"step": 3}
    uri = f"s3://{bucket}/one"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, key_prefixes=256, files_per_rank=2), no_dist=True)
    assert set(keys(s3_env, bucket, "one/")) == {".metadata", "p-00/__0_0.distcp", "p-00/__0_1.distcp"}
    out = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)} | {"step": 0}
    dcp.load(out, storage_reader=S3StorageReader(uri), no_dist=True)
    assert out["step"] == 3 and all(torch.equal(out[k], sd[k]) for k in out if k != "step")


# -- three ranks ----------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 30)
        self.out = nn.Linear(30, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.inp, model.out):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 12)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def blank_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank_like(v) for v in value]
    return value


def save_job(rank: int, world: int, env: dict[str, str], bucket: str, ref_path: str) -> None:
    os.environ.update(env)
    model, optim = build(seed=1)
    train(model, optim, seed=10 + rank)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=S3StorageWriter(f"s3://{bucket}/{PLAIN}", key_prefixes=2))
    ref = {"plain": full({"model": msd, "optim": osd})}

    root = f"s3://{bucket}/{RUN}"
    ckpt = Checkpointer(root, keep_last=1, key_prefixes=16)
    ckpt.save({"model": model}, {"model": optim}, iteration=1)
    train(model, optim, seed=20 + rank)
    ckpt.save({"model": model}, {"model": optim}, iteration=2)  # retention deletes step 1
    ref["step"] = full(get_model_state_dict(model))

    fresh, fresh_optim = build(seed=2)
    assert Checkpointer(root, key_prefixes=16).load({"model": fresh}, {"model": fresh_optim}) == 2
    assert_same(ref["step"], full(get_model_state_dict(fresh)), "resumed")
    if rank == 0:
        torch.save(ref, ref_path)


def load_job(rank: int, world: int, env: dict[str, str], uri: str, ref_path: str) -> None:
    os.environ.update(env)
    model, optim = build(seed=3)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=S3StorageReader(uri))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, optim)
    assert_same(torch.load(ref_path, weights_only=True)["plain"], full({"model": msd, "optim": osd}))


@pytest.fixture(scope="module")
def spread(seaweed: LocalS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(bucket, reference file) of the shared 3-rank job."""
    home = tmp_path_factory.mktemp("aws-spread")
    env = seaweed.env() | {
        "AWS_CONFIG_FILE": str(home / "config"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
    }
    bucket = seaweed.create_bucket(f"t-{uuid.uuid4().hex[:16]}")
    ref_path = str(home / "ref.pt")
    run_ranks(save_job, 3, env, bucket, ref_path)
    yield bucket, ref_path


@pytest.mark.multiproc
def test_objects_land_in_key_prefix_directories(spread: tuple[str, str], s3_env: LocalS3Server) -> None:
    bucket, _ = spread
    assert set(keys(s3_env, bucket, f"{PLAIN}/")) == {".metadata"} | PLAIN_DATA
    md = S3StorageReader(f"s3://{bucket}/{PLAIN}").read_metadata()
    assert {untokened(info.relative_path) for info in md.storage_data.values()} == PLAIN_DATA

    # Retention removed step 1 entirely; step 2's parts hold one p-<h> directory per rank.
    # (Each part in the save's generation directory, <step>.<part>.<16 hex>.)
    got = {
        re.sub(r"^(0000002\.model_(?:model|optim))\.[0-9a-f]{16}/", r"\1/", k) for k in keys(s3_env, bucket, f"{RUN}/")
    }
    assert got == {"0000002.pth"} | {
        f"0000002.model_{kind}/{name}" for kind in ("model", "optim") for name in {".metadata"} | STEP_DATA
    }


@pytest.mark.multiproc
def test_load_on_two_ranks_is_bit_exact(spread: tuple[str, str], s3_env: LocalS3Server) -> None:
    bucket, ref_path = spread
    run_ranks(load_job, 2, s3_env.env(), f"s3://{bucket}/{PLAIN}", ref_path)


@pytest.mark.multiproc
def test_stock_filesystem_reader_loads_a_downloaded_copy(
    spread: tuple[str, str], s3_env: LocalS3Server, tmp_path: Path
) -> None:
    bucket, ref_path = spread
    client = s3_env.client()
    for key in object_keys(client, bucket, f"{PLAIN}/"):
        name = key[len(PLAIN) + 1 :]
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(tmp_path / name))
    ref = torch.load(ref_path, weights_only=True)["plain"]
    out = blank_like(ref)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert_same(ref, out)


@pytest.mark.multiproc
def test_checkpointer_resumes_the_latest_spread_step(spread: tuple[str, str], s3_env: LocalS3Server) -> None:
    bucket, ref_path = spread
    root = f"s3://{bucket}/{RUN}"
    assert latest_checkpoint(root) == f"{root}/0000002"
    model = Net()  # one process, unsharded: reshards the 3-rank step
    assert Checkpointer(root, key_prefixes=16).load({"model": model}) == 2
    assert_same(torch.load(ref_path, weights_only=True)["step"], full(model.state_dict()))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out, _ = capsys.readouterr()
    return code, out


@pytest.mark.multiproc
def test_commands_on_spread_checkpoints(
    spread: tuple[str, str], s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket, ref_path = spread
    ref = torch.load(ref_path, weights_only=True)
    top = f"cli-{uuid.uuid4().hex[:8]}"
    ckpt = f"s3://{bucket}/{top}/ckpt"

    code, out = run(capsys, "cp", f"s3://{bucket}/{PLAIN}", ckpt)
    assert code == 0 and "copied 4 objects" in out, out
    assert set(keys(s3_env, bucket, f"{top}/ckpt/")) == {".metadata"} | PLAIN_DATA
    code, out = run(capsys, "ls", f"s3://{bucket}/{top}")
    assert code == 0 and "1 checkpoint (1 complete, 0 incomplete)" in out and "p-" not in out, out
    code, out = run(capsys, "ls", f"s3://{bucket}/{RUN}")
    assert code == 0 and "1 checkpoint (1 complete, 0 incomplete)" in out and "p-" not in out, out
    row = next(line for line in out.splitlines() if line.startswith("0000002"))
    assert row.split()[-3] == "9", row  # marker + 2 x (.metadata + 3 data objects)
    code, out = run(capsys, "inspect", ckpt)
    assert code == 0 and "inp.weight" in out
    code, out = run(capsys, "verify", ckpt)
    assert code == 0 and out.startswith("OK: 1 checkpoint, 3 objects"), out
    code, out = run(capsys, "verify", f"s3://{bucket}/{RUN}")
    assert code == 0 and out.startswith("OK: 1 checkpoint, 7 objects"), out
    code, out = run(capsys, "convert", ckpt, str(tmp_path / "full.pt"))
    assert code == 0, out
    assert_same(ref["plain"]["model"], torch.load(tmp_path / "full.pt", weights_only=True)["model"])

    # cp to disk keeps the p-<h> directories.
    code, out = run(capsys, "cp", ckpt, str(tmp_path / "local"))
    local = {untokened(p.relative_to(tmp_path / "local").as_posix()) for p in (tmp_path / "local").rglob("*.distcp")}
    assert code == 0 and local == PLAIN_DATA, local
    code, out = run(capsys, "verify", str(tmp_path / "local"))
    assert code == 0, out

    # One flipped payload byte in an object of p-1 fails verify, naming that object.
    client = s3_env.client()
    key = data_key(client, bucket, f"{top}/ckpt", 1, 0)
    md = S3StorageReader(ckpt).read_metadata()
    info = next(i for i in md.storage_data.values() if key.endswith(i.relative_path) and i.payload_offset)
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[info.offset + info.payload_offset] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    code, out = run(capsys, "verify", ckpt)
    assert code == 1 and "checksum mismatch" in out and f"s3://{bucket}/{key}" in out, out

    # A save that never committed: data objects only. gc finds it as one checkpoint and removes it all.
    code, _ = run(capsys, "cp", f"s3://{bucket}/{PLAIN}", f"s3://{bucket}/{top}/crashed")
    client.delete_object(Bucket=bucket, Key=f"{top}/crashed/.metadata")
    code, out = run(capsys, "ls", f"s3://{bucket}/{top}")
    assert "2 checkpoints (1 complete, 1 incomplete)" in out and "p-" not in out, out
    code, out = run(capsys, "gc", f"s3://{bucket}/{top}", "--older-than", "0")
    assert code == 0 and f"would remove incomplete checkpoint s3://{bucket}/{top}/crashed (3 objects" in out, out
    code, out = run(capsys, "gc", f"s3://{bucket}/{top}", "--older-than", "0", "--yes")
    assert code == 0 and "removed 3 objects" in out, out
    assert keys(s3_env, bucket, f"{top}/crashed/") == {}

    # rm leaves nothing behind: a plain checkpoint, and a Checkpointer step (copied first).
    code, out = run(capsys, "rm", ckpt)
    assert code == 0 and keys(s3_env, bucket, f"{top}/ckpt/") == {}, out
    code, out = run(capsys, "cp", f"s3://{bucket}/{RUN}/0000002", f"s3://{bucket}/{top}/run/0000002")
    assert code == 0 and "copied 9 objects" in out, out
    code, out = run(capsys, "rm", f"s3://{bucket}/{top}/run/0000002")
    assert code == 0 and keys(s3_env, bucket, f"{top}/") == {}, out
