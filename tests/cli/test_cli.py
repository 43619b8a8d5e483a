"""The ``dcp-s3`` command line, in process, on real checkpoints (S3 server and local disk)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_s3 import S3StorageReader
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._cli import commands as cli
from dcp_s3._cli.text import human_size, parse_duration
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server
from tests.objects import data_key


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def save_job(rank: int, world: int, env: dict[str, str], root: str, ref_path: str) -> None:
    os.environ.update(env)
    torch.manual_seed(0)
    model = Net()
    for layer in (model.inp, model.out):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    Checkpointer(root).save({"model": model}, {"model": optim}, iteration=100)
    ref = full(get_model_state_dict(model))
    if rank == 0:
        torch.save(ref, ref_path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-s3: error:") and needle in lines[0], err
    assert "Traceback" not in err


@pytest.mark.multiproc
def test_commands_on_a_sharded_checkpoint(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"s3://{bucket}/run"
    step = f"{root}/0000100"
    ref_path = str(tmp_path / "ref.pt")
    run_ranks(save_job, 2, s3_env.env(), root, ref_path)
    ref = torch.load(ref_path, weights_only=True)

    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("0000100"))
    assert "complete" in row and "KiB" in row and "x" in row  # sizes and ratio
    header = next(line for line in out.splitlines() if line.startswith("STEP"))
    assert header.split() == ["STEP", "STATUS", "STORED", "TENSORS", "COMPRESSION", "OBJECTS", "TIME"]
    assert "COMPRESSION: TENSORS / their items' stored bytes" in out  # what the columns compare, said
    assert "1 checkpoint (1 complete, 0 incomplete)" in out

    code, out, _ = run(capsys, "inspect", step, "--json")
    assert code == 0
    entries = {(e["part"], e["fqn"]): e for e in json.loads(out)}
    weight = entries[("model_model", "inp.weight")]
    assert weight["shape"] == [32, 16] and weight["dtype"] == "float32" and len(weight["chunks"]) == 2
    assert {tuple(c["offsets"]) for c in weight["chunks"]} == {(0, 0), (16, 0)}
    assert ("model_optim", "state.inp.weight.exp_avg") in entries
    code, out, _ = run(capsys, "inspect", f"{step}.model_model")
    assert code == 0 and "inp.weight" in out and "32x16" in out

    code, out, _ = run(capsys, "verify", step)
    assert code == 0 and out.startswith("OK: 1 checkpoint, 5 objects"), out

    # S3 -> disk -> S3; each copy verifies and loads.
    local = tmp_path / "copy"
    code, out, _ = run(capsys, "cp", step, str(local / "0000100"))
    assert code == 0 and "copied 7 objects" in out and "sizes verified" in out
    code, _, err = run(capsys, "cp", step, str(local / "0000100"))
    assert_one_line_error(code, err, "--overwrite")
    code, out, _ = run(capsys, "verify", str(local))
    assert code == 0, out
    plain = Net()
    assert Checkpointer(local).load({"model": plain}) == 100
    for k, v in plain.state_dict().items():
        assert torch.equal(v, ref[k]), k
    code, out, _ = run(capsys, "cp", str(local), f"s3://{bucket}/back")
    assert code == 0
    code, out, _ = run(capsys, "verify", f"s3://{bucket}/back/0000100")
    assert code == 0, out

    # Convert: full tensors in one torch.save file; a plain DCP copy of the optimizer.
    code, out, _ = run(capsys, "convert", step, str(tmp_path / "model.pt"))
    assert code == 0 and "4 tensors" in out
    converted = torch.load(tmp_path / "model.pt", weights_only=True)
    assert converted.keys() == ref.keys() and all(torch.equal(converted[k], ref[k]) for k in ref)
    code, out, _ = run(capsys, "convert", f"{step}.model_optim", f"s3://{bucket}/plain/optim", "--format", "dcp")
    assert code == 0
    code, out, _ = run(capsys, "verify", f"s3://{bucket}/plain/optim")
    assert code == 0, out
    code, out, _ = run(capsys, "convert", step, str(tmp_path / "m.safetensors"))
    assert code == 0, out
    from safetensors.torch import load_file

    flat = load_file(str(tmp_path / "m.safetensors"))
    assert flat.keys() == ref.keys() and all(torch.equal(flat[k], ref[k]) for k in ref)

    # Corruption: one flipped byte inside a tensor's bytes (only the checksum can tell) ...
    client = s3_env.client()
    # Every save writes its parts to directories named with its save token; the marker names them.
    dirs = find_complete(open_store(root))[0].parts
    model_dir, optim_dir = dirs["model_model"].name, dirs["model_optim"].name
    key2 = data_key(s3_env.client(), bucket, f"run/{model_dir}", 1, 0)
    body2 = bytearray(client.get_object(Bucket=bucket, Key=key2)["Body"].read())
    md = S3StorageReader(f"{root}/{model_dir}").read_metadata()
    info = next(i for i in md.storage_data.values() if i.relative_path == key2.rpartition("/")[2] and i.payload_offset)
    body2[info.offset + info.payload_offset + 1] ^= 0x01
    client.put_object(Bucket=bucket, Key=key2, Body=bytes(body2))
    code, out, _ = run(capsys, "verify", f"{step}.model_model")
    assert code == 1 and "checksum mismatch" in out and key2 in out, out
    # ... garbage of the right length in one data object, another one cut short.
    key0 = data_key(s3_env.client(), bucket, f"run/{model_dir}")
    size0 = client.head_object(Bucket=bucket, Key=key0)["ContentLength"]
    client.put_object(Bucket=bucket, Key=key0, Body=os.urandom(size0))
    key1 = data_key(s3_env.client(), bucket, f"run/{optim_dir}", 1, 0)
    body1 = client.get_object(Bucket=bucket, Key=key1)["Body"].read()
    client.put_object(Bucket=bucket, Key=key1, Body=body1[: len(body1) // 2])
    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert any(key0 in line and "inp.weight" in line for line in fails), out
    assert any(key1 in line and "truncated" in line for line in fails), out
    assert "problems" in out.splitlines()[-1]


def test_gc_rm_and_errors(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    client = s3_env.client()
    for root in (f"s3://{bucket}/run", str(tmp_path / "run")):
        ckpt = Checkpointer(root)
        for it in (1, 2, 3):
            ckpt.save({"model": model}, {"model": optim}, iteration=it)
        # Step 3 crashed before its marker; an upload under the prefix was never finished.
        if root.startswith("s3://"):
            client.delete_object(Bucket=bucket, Key="run/0000003.pth")
            client.create_multipart_upload(Bucket=bucket, Key="run/0000004.model_model/__0_0.distcp")
        else:
            (tmp_path / "run" / "0000003.pth").unlink()

        code, out, _ = run(capsys, "gc", root)  # default --older-than 1h: everything is fresh
        assert code == 0 and "nothing to remove" in out
        code, out, _ = run(capsys, "gc", root, "--older-than", "0")
        assert code == 0 and "would remove incomplete step" in out and "0000003" in out and "dry run" in out
        if root.startswith("s3://"):
            assert "unfinished upload" in out and "0000004.model_model/__0_0.distcp" in out
        code, out, _ = run(capsys, "gc", root, "--older-than", "0s", "--yes")
        assert code == 0 and "removed" in out
        code, out, _ = run(capsys, "ls", root)
        assert "0000003" not in out and "2 checkpoints (2 complete, 0 incomplete)" in out
        if root.startswith("s3://"):
            assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

        code, _, err = run(capsys, "rm", root)
        assert_one_line_error(code, err, "--recursive")
        code, out, _ = run(capsys, "rm", f"{root}/0000001", "--dry-run")
        assert code == 0 and "would remove" in out
        code, out, _ = run(capsys, "rm", f"{root}/0000001")
        assert code == 0 and out.startswith("removed")
        code, out, _ = run(capsys, "ls", root)
        assert "0000001" not in out and "0000002" in out
        code, out, _ = run(capsys, "rm", root, "-r")
        assert code == 0
        code, _, err = run(capsys, "ls", root)
        assert_one_line_error(code, err, "no checkpoint found")

    code, _, err = run(capsys, "ls", "s3://no-such-bucket-dcp-s3/x")
    assert_one_line_error(code, err, "no-such-bucket-dcp-s3")
    code, _, err = run(capsys, "ls", "gs://bucket/x")
    assert_one_line_error(code, err, "unsupported scheme")
    code, _, err = run(capsys, "inspect", str(tmp_path / "nothing"))
    assert_one_line_error(code, err, "no checkpoint found")


def test_help_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("ls", "inspect", "verify", "gc", "cp", "rm", "convert", "demo", "server"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        # demo and server start their own store: the S3 options would be ignored, so they are not offered
        assert ("--endpoint-url" in out) == (command not in ("demo", "server"))
        if command != "demo":
            assert "examples:" in out and f"dcp-s3 {command}" in out
    with pytest.raises(SystemExit):
        cli.main(["gc", "s3://b/x", "--older-than", "soon"])
    assert "invalid duration" in capsys.readouterr().err


def test_formatting_helpers() -> None:
    assert human_size(0) == "0 B" and human_size(1536) == "1.5 KiB" and human_size(3 << 30) == "3.0 GiB"
    assert parse_duration("90") == 90 and parse_duration("30m") == 1800 and parse_duration("2d") == 172800


def test_module_entry_point_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_s3", "verify", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"dcp-s3: error: no checkpoint found at {tmp_path / 'missing'}"]


def test_verify_decodes_transformed_items_through_the_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.zeros(1000, 100), "b": torch.arange(50), "step": 3}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "z", _extensions=[ZStandard()]), no_dist=True)
    code, out, _ = run(capsys, "verify", str(tmp_path / "z"))
    assert code == 0, out
    code, out, _ = run(capsys, "ls", str(tmp_path / "z"))
    ratio = float(re.search(r"(\d+\.\d+)x", out)[1])  # type: ignore[index]
    assert ratio > 50  # zeros compress
    data = tmp_path / "z" / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))
    code, out, _ = run(capsys, "verify", str(tmp_path / "z"))
    assert code == 1 and "does not decode" in out and "[w[0, 0]]" in out, out
