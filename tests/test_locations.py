"""One location rule for every entry point: an S3 look-alike is refused (never saved on the node's local disk),
pathlib's fold of ``s3://`` is read as the S3 URI it was (issue 50, item 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import InvalidCheckpointIdError, S3StorageReader, S3StorageWriter
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.uri import s3_location
from dcp_s3.integrations import dcp_route
from dcp_s3.integrations._locations import s3_location as integration_location

LOOK_ALIKES = ["s3:/{b}/x", "s3//{b}/x", "S3://{b}/x", "s3:{b}/x", "S3:/{b}/x", "s3:///{b}/x"]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("s3://b1c/k", "s3://b1c/k"),
        ("s3://b1c/k/", "s3://b1c/k"),
        (Path("s3://b1c/run"), "s3://b1c/run"),  # pathlib's fold, s3:/b1c/run
        ("local/dir", None),
        ("/abs/dir", None),
        ("s3/dir", None),  # a local directory named s3
        (Path("s3"), None),
        ("gs://b/k", None),  # another scheme: the caller's to refuse
        (3, None),
    ],
)
def test_s3_location_reads(given: Any, expected: str | None) -> None:
    assert s3_location(given) == expected


@pytest.mark.parametrize("given", [t.format(b="bkt") for t in LOOK_ALIKES if t != "s3:///{b}/x"])
def test_s3_location_refuses_look_alikes_saying_what_was_meant(given: str) -> None:
    with pytest.raises(InvalidCheckpointIdError, match=r"did you mean 's3://bkt/x'") as info:
        s3_location(given)
    assert repr(given) in str(info.value)


def test_integrations_read_a_folded_string_as_s3() -> None:
    # Frameworks fold paths themselves (str(Path(...)), os.path.normpath): the integrations read it back.
    assert integration_location(os.path.normpath("s3://bkt/run/step-1")) == "s3://bkt/run/step-1"
    with pytest.raises(InvalidCheckpointIdError):
        integration_location("S3://bkt/run")


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(8, dtype=torch.float32)}


ENTRY_POINTS = {
    "S3StorageWriter": lambda loc: dcp.save(_state(), storage_writer=S3StorageWriter(loc)),
    "S3StorageReader": lambda loc: dcp.load(_state(), storage_reader=S3StorageReader(loc)),
    "Checkpointer.save": lambda loc: Checkpointer(loc).save({"model": torch.nn.Linear(2, 2)}, iteration=1),
    "open_store": lambda loc: open_store(loc).write("x", b"1"),
    "dcp_route": lambda loc: _routed_save(loc),
}


def _routed_save(loc: str) -> None:
    with dcp_route.s3_route({}):
        dcp.save(_state(), checkpoint_id=loc)


@pytest.mark.parametrize("template", LOOK_ALIKES)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_look_alike_and_writes_nothing_locally(
    entry: str, template: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidCheckpointIdError):
        ENTRY_POINTS[entry](template.format(b=bucket))
    assert list(tmp_path.iterdir()) == [], f"{entry} wrote on the local disk"


def test_a_pathlib_folded_location_saves_to_s3(
    s3_env: LocalS3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(Path(f"s3://{bucket}/run"))
    ckpt.save({"model": model}, iteration=7)
    dcp.save(_state(), storage_writer=S3StorageWriter(Path(f"s3://{bucket}/plain")))
    assert list(tmp_path.iterdir()) == []
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert "run/0000007.pth" in keys and "plain/.metadata" in keys
    fresh = torch.nn.Linear(3, 2)
    assert Checkpointer(Path(f"s3://{bucket}/run")).load({"model": fresh}) == 7
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_cli_refuses_a_look_alike(bucket: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "dcp_s3", "ls", f"s3:/{bucket}/run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode != 0
    assert f"did you mean 's3://{bucket}/run'" in run.stderr
