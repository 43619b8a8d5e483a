"""A NeMo AutoModel recipe's save to S3 with a writer rank SIGKILLed at each phase (two gloo ranks, real processes).

Each rank of ``nemo_recipe_child.py`` (a recipe run through NeMo's launcher, its ``BaseRecipe.save_checkpoint``)
is a process of its own: the run commits step 2, then one rank is held at a phase of the save of step 4 and
SIGKILLed there. The other rank must end on its own (an error from its next collective) within
:data:`SURVIVOR_DEADLINE`; then, in a fresh group, step 2 is the latest checkpoint (the killed step is not) and
resumes bit-exact; training on to step 4 re-saves that step beside what the crash left (nothing of it deleted),
and that re-save loads bit-exact in this process (a group of one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dist_utils import free_port, full
from objects import object_keys
from test_nemo_automodel import _diff
from torch import nn

ROOT = str(Path(__file__).resolve().parents[2])
CHILD = str(Path(__file__).with_name("nemo_recipe_child.py"))
RECIPE = "tests.integrations.nemo_recipe_child.S3TinyRecipe"
#: How long the surviving rank may take to end once its peer is killed. Its gloo peer connection closes with the
#: killed process, so its next collective fails at once (measured: a few seconds on a busy 2-core machine); the
#: process group's own timeout (NeMo's ``dist_env.timeout_minutes``, 1 minute here) bounds any wait gloo misses.
SURVIVOR_DEADLINE = 90.0

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.multiproc,
]


class Ranks:
    """Two ranks of the child, one process each; ``victim`` held at ``phase`` of the save of step 4."""

    def __init__(self, tmp: Path, config: Path, phase: str = "none", victim: int = -1) -> None:
        n = time.monotonic_ns()
        self.held, release = tmp / f"held-{n}", tmp / f"go-{n}"
        port = str(free_port())
        self.procs = [
            subprocess.Popen(
                [sys.executable, CHILD, str(self.held), str(release), phase, str(victim), str(config)],
                env=dict(
                    os.environ,
                    PYTHONPATH=ROOT,
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    OMP_NUM_THREADS="1",
                    PYTHONWARNINGS="ignore",
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]

    def wait_held(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.held.exists():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"a rank exited ({proc.returncode}) before the phase:\n{self.output(proc)}")
            assert time.monotonic() < deadline, "the victim never reached its phase"
            time.sleep(0.05)

    def output(self, proc: subprocess.Popen[str]) -> str:
        return (proc.communicate(timeout=60)[0] or "")[-6000:]

    def finish(self, timeout: float = 300) -> None:
        for proc in self.procs:
            proc.wait(timeout=timeout)
        for proc in self.procs:
            assert proc.returncode == 0, self.output(proc)


def build_unsharded() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's model and optimizer, unsharded, to load into."""
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def config(tmp: Path, name: str, checkpoint: dict[str, Any], max_steps: int) -> Path:
    path = tmp / f"{name}.yaml"
    train = {"max_steps": max_steps, "ckpt_every_steps": 2}
    doc = {"recipe": RECIPE, "checkpoint": checkpoint, "train": train, "out": str(tmp / name)}
    path.write_text(yaml.safe_dump({**doc, "dist_env": {"timeout_minutes": 1}}))
    return path


def outputs(tmp: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(tmp / f"{name}.{rank}", weights_only=False) for rank in range(2)]


@pytest.mark.parametrize(
    ("phase", "victim"),
    [("reserved", 1), ("model-data", 1), ("before-config", 0), ("before-commit", 0)],
)
def test_a_rank_killed_in_a_save_leaves_the_last_commit_loadable(
    seaweed: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str, victim: int
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # the YAML's endpoint_url is the only way to the server
    root = f"s3://{bucket}/run"
    checkpoint = {"checkpoint_dir": root, "endpoint_url": seaweed.endpoint_url}
    checkpoint["storage_options"] = {"region": seaweed.region}
    crash = Ranks(tmp_path, config(tmp_path, "crash", checkpoint, 4), phase, victim)
    crash.wait_held()
    killed, survivor = crash.procs[victim], crash.procs[1 - victim]
    start = time.monotonic()
    os.kill(killed.pid, signal.SIGKILL)
    survivor.wait(timeout=SURVIVOR_DEADLINE + 60)
    ended = time.monotonic() - start
    killed.wait(timeout=60)
    print(f"phase {phase}, rank {victim} killed: the other rank ended {ended:.1f} s later ({survivor.returncode})")
    assert survivor.returncode != 0 and ended < SURVIVOR_DEADLINE, (ended, crash.output(survivor))
    before = outputs(tmp_path, "crash")  # each rank's state at each save, written before the save began
    left = {k for k in object_keys(seaweed.client(), bucket) if k.startswith("run/epoch_0_step_4/")}
    assert "run/epoch_0_step_4/dcp_s3_commit.json" not in left

    resume = Ranks(tmp_path, config(tmp_path, "resume", checkpoint, 4))
    resume.finish()
    after = outputs(tmp_path, "resume")
    for rank in range(2):
        assert after[rank]["start"] == 2, "the killed step was taken as the latest"
        assert _diff(before[rank]["saves"][2], after[rank]["resumed"]) == [], (rank, phase)
        assert after[rank]["losses"] == before[rank]["losses"][2:4]  # the same steps 3 and 4 again
        # step 4 as the killed save would have stored it; the torch RNG aside: a resumed loop's iter(loader) draws
        # its base seed from it, which the uninterrupted loop did at step 0
        assert _diff(before[rank]["saves"][4], after[rank]["saves"][4]) == [".torch_rng"], (rank, phase)
        assert after[rank]["latest"] == f"{root}/epoch_0_step_4"  # the re-save of the killed step committed
    keys = object_keys(seaweed.client(), bucket)
    assert left <= set(keys)  # what the crash left is never deleted by inference
    token = json.loads(
        seaweed.client().get_object(Bucket=bucket, Key="run/epoch_0_step_4/dcp_s3_commit.json")["Body"].read()
    )["save"]
    assert not [k for k in left if f"save.{token}/" in k]  # the commit names the re-save, not the killed one

    # the re-save, loaded in this process (a group of one: DCP reshards the 2-rank save), bit-exact
    model, optim = build_unsharded()
    from dcp_s3.integrations.nemo_automodel import S3CheckpointingConfig  # nemo-automodel: not in every venv

    ckpt = S3CheckpointingConfig(**checkpoint).build(dp_rank=0, tp_rank=0, pp_rank=0)
    latest = ckpt.latest_checkpoint()
    ckpt.load_model(model, f"{latest}/model")
    ckpt.load_optimizer(optim, model, latest)
    ckpt.close()
    saved = after[0]["saves"][4]
    assert _diff(saved["model"], full(model.state_dict())) == [], phase
    assert _diff(saved["optim"], full(optim.state_dict())) == [], phase
