"""dcp_s3.integrations.nemo_recipe: a NeMo AutoModel recipe saving to and resuming from S3 with one YAML key.

Real parts: NeMo AutoModel 0.7.0's command (``torchrun --nproc-per-node 2 -m nemo_automodel.cli.app config.yaml``:
its YAML loader, recipe resolution and launcher), its ``BaseRecipe.save_checkpoint``/``load_checkpoint``, its
``RecipeConfig``, ``StatefulRNG``, ``StepScheduler``; a small recipe of a user's own (``nemo_recipe_child.py``: NeMo's
own LLM recipes need torchao, datasets and a Hugging Face model, not installable here without another torch);
two gloo ranks with an FSDP2 model; SeaweedFS. No checkpoint file may appear on local disk.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from objects import object_keys
from test_nemo_automodel import _diff

from dcp_s3.errors import ConfigError

ROOT = str(Path(__file__).resolve().parents[2])
RECIPE = "tests.integrations.nemo_recipe_child.S3TinyRecipe"

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]


def run(tmp: Path, name: str, checkpoint: dict[str, Any], max_steps: int, cwd: Path) -> list[dict[str, Any]]:
    """NeMo's command on 2 CPU ranks, as its docs launch it under torchrun, with the YAML ``<name>.yaml``
    (a save every 2 steps); what each rank's loop saw."""
    config = tmp / f"{name}.yaml"
    train = {"max_steps": max_steps, "ckpt_every_steps": 2}
    config.write_text(
        yaml.safe_dump({"recipe": RECIPE, "checkpoint": checkpoint, "train": train, "out": str(tmp / name)})
    )
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("AWS_ENDPOINT_URL", None)  # the YAML's endpoint_url is the only way to the server
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "nemo_automodel.cli.app", str(config)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [torch.load(tmp / f"{name}.{rank}", weights_only=False) for rank in range(2)]


@pytest.mark.multiproc
def test_a_recipe_saves_and_resumes_through_s3_with_one_yaml_key(seaweed: Any, bucket: str, tmp_path: Path) -> None:
    """``recipe: <S3 recipe>`` and ``checkpoint_dir: s3://...``: NeMo's command trains 7 steps on 2 ranks, saving at
    2, 4, 6 (retention keeps 2); a new run with ``restore_from: LATEST`` resumes step 6 bit-exact (model, optimizer,
    data loader, RNG, step scheduler), takes the same next step, and saves step 8 beside it."""
    work = tmp_path / "work"
    work.mkdir()
    checkpoint = {
        "checkpoint_dir": f"s3://{bucket}/run",
        "max_recent_checkpoints": 2,
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region},
    }
    first = run(tmp_path, "first", checkpoint, max_steps=7, cwd=work)
    keys = object_keys(seaweed.client(), bucket)
    commits = sorted(k for k in keys if k.endswith("/dcp_s3_commit.json"))
    assert commits == ["run/epoch_0_step_4/dcp_s3_commit.json", "run/epoch_0_step_6/dcp_s3_commit.json"]
    assert not [k for k in keys if k.startswith("run/epoch_0_step_2/")]
    commit = json.loads(seaweed.client().get_object(Bucket=bucket, Key=commits[-1])["Body"].read())
    assert sorted(commit["parts"]) == ["model", "optim"]
    assert sorted(commit["files"]) == [
        "config.yaml",
        "dataloader/dataloader_dp_rank_0.pt",
        "dataloader/dataloader_dp_rank_1.pt",
        "losses.json",
        "rng/rng_global_rank_0.pt",
        "rng/rng_global_rank_1.pt",
        "step_scheduler.pt",  # NeMo's recipe torch.saves it itself; here it is an object of the save
    ]
    for out in first:
        assert out["latest"] == f"s3://{bucket}/run/epoch_0_step_6"

    checkpoint["restore_from"] = "LATEST"
    second = run(tmp_path, "second", checkpoint, max_steps=8, cwd=work)
    for rank in range(2):
        assert second[rank]["start"] == 6
        assert _diff(first[rank]["saves"][6], second[rank]["resumed"]) == [], rank
        assert second[rank]["losses"][0] == first[rank]["losses"][6]  # the same 7th step
        assert second[rank]["latest"] == f"s3://{bucket}/run/epoch_0_step_8"
    commits = sorted(k for k in object_keys(seaweed.client(), bucket) if k.endswith("/dcp_s3_commit.json"))
    assert commits == ["run/epoch_0_step_6/dcp_s3_commit.json", "run/epoch_0_step_8/dcp_s3_commit.json"]
    assert [p for p in work.rglob("*")] == []  # nothing of an s3:// checkpoint on local disk


def test_s3_recipes_by_name_and_the_config_they_build(tmp_path: Path) -> None:
    """``S3<Name>`` is NeMo's recipe ``<Name>`` with the mixin (resolved by NeMo's launcher, picklable by name); the
    ``checkpoint:`` block becomes an ``S3CheckpointingConfig`` (NeMo's model-derived fields too); PEFT is refused."""
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.components.launcher.interactive import resolve_recipe_cls
    from nemo_automodel.recipes.diffusion.train import TrainDiffusionRecipe

    from dcp_s3.integrations import nemo_recipe
    from dcp_s3.integrations.nemo_automodel import S3CheckpointingConfig

    cls = resolve_recipe_cls("dcp_s3.integrations.nemo_recipe.S3TrainDiffusionRecipe")
    assert cls is nemo_recipe.S3TrainDiffusionRecipe is nemo_recipe.s3_recipe(TrainDiffusionRecipe)
    assert issubclass(cls, TrainDiffusionRecipe) and issubclass(cls, nemo_recipe.S3Recipe)
    assert pickle.loads(pickle.dumps(cls)) is cls
    with pytest.raises(AttributeError, match="no recipe named 'NoSuchRecipe'"):
        nemo_recipe.S3NoSuchRecipe  # noqa: B018
    with pytest.raises(ConfigError, match="BaseRecipe subclass"):
        nemo_recipe.s3_recipe(dict)

    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"pretrained_model_name_or_path": "org/tiny", "cache_dir": "/cache"},
                "checkpoint": {
                    "checkpoint_dir": "s3://bucket/run",
                    "restore_from": "LATEST",
                    "endpoint_url": "http://h",
                },
            }
        )
    )
    config = nemo_recipe.S3RecipeConfig.of(load_yaml_config(str(path))).checkpoint
    assert type(config) is S3CheckpointingConfig
    assert (config.checkpoint_dir, config.endpoint_url, config.model_repo_id) == (
        "s3://bucket/run",
        "http://h",
        "org/tiny",
    )
    path.write_text(yaml.safe_dump({"peft": {"dim": 8}, "checkpoint": {"checkpoint_dir": "s3://bucket/run"}}))
    with pytest.raises(ConfigError, match="is_peft"):
        nemo_recipe.S3RecipeConfig.of(load_yaml_config(str(path))).checkpoint  # noqa: B018


def _checkpointer(seaweed: Any, bucket: str, job: str) -> Any:
    from dcp_s3.integrations.nemo_automodel import S3CheckpointingConfig

    return S3CheckpointingConfig(
        checkpoint_dir=f"s3://{bucket}/{job}",
        endpoint_url=seaweed.endpoint_url,
        storage_options={"region": seaweed.region},
    ).build(dp_rank=0, tp_rank=0, pp_rank=0)


def test_two_jobs_in_two_threads_each_route_through_their_own_checkpointer(
    seaweed: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job A's recipe save and job B's recipe load run at once in two threads (B's routing opened after A's, the
    order that captured A's calls on main): NeMo's own ``base_recipe`` functions, called as its recipes call them,
    answer A's save through A's checkpointer and B's load through B's; outside both, and after the last one closes
    (also through an exception), NeMo's functions are its own."""
    from nemo_automodel.recipes import base_recipe

    from dcp_s3.integrations.nemo_recipe import _routed

    monkeypatch.chdir(tmp_path)  # a call routed to NeMo's own function would write here
    nemo = {name: getattr(base_recipe, name) for name in ("save_config", "find_latest_checkpoint", "load_torch_ckpt")}
    a, b = _checkpointer(seaweed, bucket, "jobA"), _checkpointer(seaweed, bucket, "jobB")
    path_a, path_b = f"s3://{bucket}/jobA/epoch_0_step_1", f"s3://{bucket}/jobB/epoch_0_step_7"
    b.lifecycle.reserve(path_b)  # job B's checkpoint, to be loaded
    b.save_state(torch.nn.Linear(2, 2), "ema", path_b)
    b.save_distributed_state(torch.nn.Linear(2, 2), "extra", path_b)  # a DCP part: what makes it a checkpoint
    b.lifecycle.publish(path_b, best_val_metric=None, metric_key=None)

    a_open, b_open, a_saved, b_loaded = (threading.Event() for _ in range(4))
    got: dict[str, Any] = {}

    def job_a() -> None:
        a.lifecycle.reserve(path_a)
        with _routed(a):
            a_open.set()
            assert b_open.wait(60)
            base_recipe.save_config({"job": "A"}, path_a)  # as NeMo's save_checkpoint calls it
            a_saved.set()
            assert b_loaded.wait(60)
        a.lifecycle.publish(path_a, best_val_metric=None, metric_key=None)

    def job_b() -> None:
        assert a_open.wait(60)
        with _routed(b):
            b_open.set()
            assert a_saved.wait(60)
            latest = base_recipe.find_latest_checkpoint(f"s3://{bucket}/jobB")  # as NeMo's load_checkpoint
            got["latest"] = latest
            got["ema"] = base_recipe.load_torch_ckpt(f"{latest}/ema.pt")
            b_loaded.set()

    errors: list[BaseException] = []

    def run_job(fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # reported below, with its type
            errors.append(exc)
            for event in (a_open, b_open, a_saved, b_loaded):
                event.set()

    threads = [threading.Thread(target=run_job, args=(fn,)) for fn in (job_a, job_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert got["latest"] == path_b and set(got["ema"]) == {"weight", "bias"}
    assert a.load_config(path_a) == {"job": "A"} and b.load_config(path_b) is None
    assert {name: getattr(base_recipe, name) for name in nemo} == nemo
    with pytest.raises(KeyError), _routed(a):
        assert base_recipe.save_config is not nemo["save_config"]
        raise KeyError("a save that fails")
    assert {name: getattr(base_recipe, name) for name in nemo} == nemo
    assert list(tmp_path.iterdir()) == []
    a.close()
    b.close()
