"""A local-tier marker is stored bytes: its fields are checked by type and size before a tiered load uses them.

``world_size=10**12`` (a marker naming rank 0 of a trillion) once made every load build ``set(range(world))``:
gigabytes in seconds. ``"iteration": [1]`` made the load raise a raw ``TypeError`` after loading the tensors.
Each is written by the test into a genuine local copy; the load goes on with the older step, and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hostile import PeakRss, memory_cap
from test_checkpointer import build, same, snapshot, train, trainable

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.tiers import LOCAL_ENTRY
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes
from dcp_s3.errors import CheckpointFormatError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

GiB = 1 << 30


def rewrite(marker: Path, change: Callable[[dict[str, Any]], None]) -> None:
    content = torch_load(marker.read_bytes(), str(marker))
    change(content)
    marker.write_bytes(torch_save_bytes(content))


def two_steps(tmp_path: Path) -> tuple[str, str, dict[str, Any]]:
    """(the Checkpointer's root, its local root, the state saved at step 10) with local-only steps 10 and 20."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    model, optim, sched = build(seed=0, shard=False)
    with Checkpointer(root, local_root=local) as ckpt:
        ckpt.save({"m": model}, {"m": optim}, iteration=10, tier="local")
        ten = snapshot(model, optim)
        train(model, optim, sched, seed=1)
        ckpt.save({"m": model}, {"m": optim}, iteration=20, tier="local")
    return root, local, ten


def load(root: str, local: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    model, optim, _ = build(seed=7, shard=False)
    ckpt = Checkpointer(root, local_root=local)
    it = ckpt.load({"m": model}, {"m": optim})
    ckpt.close()
    return it, snapshot(model, optim), ckpt.last_load


@pytest.mark.timeout(120)
def test_a_world_size_of_a_trillion_costs_nothing(tmp_path: Path) -> None:
    root, local, ten = two_steps(tmp_path)
    rewrite(Path(local, "rank00000", "0000020.pth"), lambda m: m[LOCAL_ENTRY].update(world_size=10**12))
    t0 = time.monotonic()
    with memory_cap(2 * GiB), PeakRss().watch() as rss:
        it, got, last = load(root, local)
    assert time.monotonic() - t0 < 60  # a hang guard: the bug was gigabytes in seconds
    assert rss.growth < 512 << 20, rss.growth
    assert it == 10, last
    same(trainable(ten["model"]), trainable(got["model"]))


def test_an_iteration_that_is_not_a_number_makes_its_step_unusable(tmp_path: Path) -> None:
    root, local, ten = two_steps(tmp_path)
    rewrite(Path(local, "rank00000", "0000020.pth"), lambda m: m.update(iteration=[1]))
    it, got, last = load(root, local)
    assert it == 10, last
    same(trainable(ten["model"]), trainable(got["model"]))
    why = last["unusable_local"]["0000020"]
    assert "CheckpointFormatError" in why and "'iteration' = [1] is not a whole number" in why, why
    assert "0000020.pth" in why, why


def test_the_plain_load_checks_the_same_fields(tmp_path: Path) -> None:
    """Without a local tier the same check runs on the step's marker: a clear error naming the field and the
    marker, not a ``TypeError`` after the tensors were loaded."""
    root = str(tmp_path / "root")
    model, optim, _ = build(seed=0, shard=False)
    with Checkpointer(root) as ckpt:
        ckpt.save({"m": model}, {"m": optim}, iteration=10)
    rewrite(Path(root, "0000010.pth"), lambda m: m.update(iteration=[1]))
    with pytest.raises(CheckpointFormatError, match=r"0000010\.pth: 'iteration' = \[1\] is not a whole number"):
        Checkpointer(root).load({"m": model}, {"m": optim})
