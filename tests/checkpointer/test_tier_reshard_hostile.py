"""A resharded load from the local tier reads stored bytes of every rank directory under the local root: each
rank's marker and its parts' ``.metadata``. Hostile ones (a pickle that runs code, an item naming ``../``, a
size the object does not hold, a marker naming no rank) make the step unusable from the local tier, with the
reason, before any data is read and without running anything."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
from hostile import read_metadata, touch, write_metadata
from test_checkpointer import build

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.tier_reshard import check_shared, shared_copies
from dcp_s3._checkpointer.tiers import LOCAL_ENTRY
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEP = "0000010"


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, Any, Any, str]:
    """(local root, model, optimizer, the model part's directory) of one local-only step of one rank."""
    local = str(tmp_path / "local")
    model, optim, _ = build(seed=0, shard=False)
    ckpt = Checkpointer(str(tmp_path / "s3-stand-in"), local_root=local)
    ckpt.save({"m": model}, {"m": optim}, iteration=10, tier="local")
    ckpt.close()
    shared, why = shared_copies(local)
    assert STEP in shared and not why, why
    assert check_shared(local, shared[STEP], {"m": model}, {"m": optim})[1] is None  # usable as saved
    return local, model, optim, f"{local}/rank00000/{shared[STEP].copies[0].dirs['m_model']}"


def problem(local: str, model: Any, optim: Any) -> str | None:
    shared, why = shared_copies(local)
    if STEP not in shared:
        return why[STEP]
    return check_shared(local, shared[STEP], {"m": model}, {"m": optim})[1]


def retarget(part: str, change: Any) -> None:
    md = read_metadata(part)
    md.storage_data = {k: change(v) for k, v in md.storage_data.items()}
    write_metadata(part, md)


def test_metadata_that_would_run_code_is_refused(saved: tuple, tmp_path: Path) -> None:
    local, model, optim, part = saved
    ran = tmp_path / "ran"
    write_metadata(part, pickle.dumps(touch(ran)))
    why = problem(local, model, optim)
    assert why is not None and "CheckpointFormatError" in why and ".metadata" in why, why
    assert not ran.exists()


@pytest.mark.parametrize("name", ["../../rank00001/x.distcp", "/etc/passwd", "..", ""])
def test_an_item_naming_another_path_is_refused(saved: tuple, name: str) -> None:
    local, model, optim, part = saved
    retarget(part, lambda info: dataclasses.replace(info, relative_path=name))
    why = problem(local, model, optim)
    assert why is not None and f"invalid object path {name!r}" in why, why


def test_an_item_past_the_end_of_its_object_is_refused(saved: tuple) -> None:
    local, model, optim, part = saved
    retarget(part, lambda info: dataclasses.replace(info, length=info.length + (1 << 40)))
    why = problem(local, model, optim)
    assert why is not None and "its items need" in why and "bytes" in why, why


@pytest.mark.parametrize(
    "entry", [{"rank": "0", "world_size": 1}, {"rank": 3, "world_size": 2}, {"rank": -1, "world_size": 1}, ["rank", 0]]
)
def test_a_marker_naming_no_rank_is_refused(saved: tuple, entry: Any) -> None:
    local, model, optim, _ = saved
    marker_path = Path(local) / "rank00000" / f"{STEP}.pth"
    marker = torch_load(marker_path.read_bytes(), str(marker_path))
    marker[LOCAL_ENTRY] = entry
    marker_path.write_bytes(torch_save_bytes(marker))
    why = problem(local, model, optim)
    assert why is not None and LOCAL_ENTRY in why and "names no rank" in why, why
