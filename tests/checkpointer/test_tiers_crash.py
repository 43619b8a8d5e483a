"""Two tiers killed (SIGKILL) during a local save and at every phase of a promotion.

``tiers_child.py`` saves step 10 to both tiers, then step 20, held at a phase and killed there.
A kill during the local save leaves local step 10 the newest: the next load is exactly step 10's
state. A kill during the promotion leaves the local step 20 complete (the next load takes it, from
the local tier) and S3's last committed step 10 intact: with the local directory gone, S3 alone
loads step 10 bit-exact, and ``dcp-s3 gc`` removes the half-promoted step 20.
"""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from held_child import HeldChild
from test_checkpointer_atomic import same

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._dcp import open_store
from dcp_s3.admin._cleanup import collect_garbage, find_garbage
from tests.checkpointer.resave_child import build, first_state, snapshot, train_a_bit

CHILD = str(Path(__file__).with_name("tiers_child.py"))

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if same(a, b) else [f"{path}: {a!r} != {b!r}"[:300]]


def child(tmp: Path, phase: str, *args: str) -> HeldChild:
    return HeldChild(CHILD, tmp, phase, *args, env={"PYTHONWARNINGS": "ignore"})


def run(tmp: Path, *args: str) -> None:
    code, out = child(tmp, "none", *args).release()
    assert code == 0, out


def load(tmp: Path, root: str, local: str) -> tuple[dict[str, Any], str]:
    out = tmp / f"snap-{time.monotonic_ns()}.pt"
    run(tmp, "load", root, local, str(out))
    got = torch.load(out, weights_only=True)
    return got["state"], got["source"]


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Step 10's state as a load restores it, and the state the child saves at 20 (computed the same way)."""
    root = str(tmp_path_factory.mktemp("reference"))
    model, optim, sched = first_state()
    Checkpointer(root).save({"m": model}, {"m": optim}, {"m": sched}, iteration=10)
    model, optim, sched = build(5)
    assert Checkpointer(root).load({"m": model}, {"m": optim}, {"m": sched}) == 10
    old = copy.deepcopy(snapshot(model, optim, sched, 10))  # the optimizer state is live: training moves it
    train_a_bit(model, optim, sched, seed=2)
    return {"old": old, "new": snapshot(model, optim, sched, 20)}


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("local-model", "old"),
        ("local-marker", "old"),
        ("upload", "new"),
        ("report", "new"),
        ("part-commit", "new"),
        ("s3-marker", "new"),
    ],
)
def test_killed_save_or_promotion(
    bucket: str, tmp_path: Path, states: dict[str, Any], phase: str, expected: str
) -> None:
    root, local = f"s3://{bucket}/run", str(tmp_path / "local")
    run(tmp_path, "first", root, local)
    held = child(tmp_path, phase, "second", root, local)
    held.wait_held()
    held.kill()
    got, source = load(tmp_path, root, local)
    ref = states[expected]
    assert same(got, ref), (phase, expected, differences(got, ref))
    assert source == "local", source
    # S3's last committed step is intact and loads alone; a half-promoted step is gc's.
    s3 = open_store(root)
    assert [s.name for s in find_complete(s3, None)] == ["0000010"]
    shutil.rmtree(local)
    got, source = load(tmp_path, root, local)
    assert same(got, states["old"]) and source == "s3", (phase, source)
    collect_garbage(find_garbage(root, older_than=0))
    assert not [e.name for e in s3.list_objects() if e.name.startswith("0000020")], phase
