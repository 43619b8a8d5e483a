"""Deletion by ownership, never by inference: every deleting surface of dcp_s3 leaves alone what it does not own.

For each integration and the Checkpointer and its local tier, the test plants what a rotation, purge or
retention must not delete — a checkpoint under another root, a name learnt from crafted stored state,
a directory without ``.metadata``, a checkpoint whose local directory is missing — runs the real
framework code against SeaweedFS (ranks as real processes), and asserts it survives, next to the
deletions the surface does own (so a test that deletes nothing at all fails too). The rule is
:mod:`dcp_s3._checkpointer.ownership`'s.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch import nn

from dcp_s3 import StorageOptions
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.ownership import CHECKPOINTER_STEPS, Ownership
from dcp_s3._dcp import open_store
from dcp_s3._layout import METADATA_KEY


def _plain(name: str) -> str:
    """``<step>.m_model.<16 hex>/...`` -> ``<step>.m_model/...``: a Checkpointer part's generation directory (every
    save writes one, :mod:`dcp_s3._checkpointer.generations`) as a test can predict it."""
    return re.sub(r"\.[0-9a-f]{16}(?=/|$)", "", name)


def _names(location: str) -> set[str]:
    """The objects under ``location``, relative to it (generation directories as ``_plain`` names them)."""
    return {_plain(e.name) for e in StorageOptions().store(location).list_objects()}


def _tops(location: str) -> set[str]:
    return {n.split("/")[0] for n in _names(location)}


def _plant(location: str, value: float = 1.0) -> set[str]:
    """A committed one-tensor DCP checkpoint at ``location`` (another job's, as far as the test's job knows);
    its objects."""
    dcp.save({"w": torch.full((4,), value)}, storage_writer=StorageOptions().writer(location), no_dist=True)
    return _names(location)


# -- the rule itself ---------------------------------------------------------------------------------------
def test_a_name_is_owned_only_under_the_configured_root_and_by_the_scheme() -> None:
    owner = Ownership("test", "s3://b/run", re.compile(r"step-\d+"))
    assert owner.name_of("s3://b/run/step-2") == "step-2"
    assert owner.name_of("s3://b/run/step-2/") == "step-2"
    for foreign in (
        "s3://b/pretrain/step-2",
        "s3://b/run-2/step-2",
        "s3://b/run",
        "s3://b/run/x/../step-2",
        "s3://b/run/best",
        "s3://b/run//step-2",
        "s3://other/run/step-2",
        "step-2",
    ):
        assert owner.name_of(foreign) is None, foreign
    assert Ownership("t", "", CHECKPOINTER_STEPS).owned(["0000010", "best", "10", "0000010.x", "../0000010"]) == [
        "0000010"
    ]


# -- the Checkpointer and its local tier -------------------------------------------------------------------
def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


def test_checkpointer_keep_last_deletes_only_its_own_committed_steps(bucket: str) -> None:
    root, other = f"s3://{bucket}/run", f"s3://{bucket}/run-other"
    Checkpointer(root).save({"m": _model(1)}, path=f"{root}/best")  # a step named by the user, not the scheme
    Checkpointer(other).save({"m": _model(2)}, iteration=1)  # another root (a prefix sibling)
    store = open_store(root)
    store.write("0000005.m_model/__0_0.distcp", b"a crashed save: no .metadata, no marker")
    # Steps not all named by a number are ordered by marker time, which SeaweedFS keeps to the second:
    # so that "best" is the oldest step (the first a count over every name would delete), not a tie.
    time.sleep(1.5)
    ckpt = Checkpointer(root, keep_last=1)
    for iteration in (10, 20, 30):
        ckpt.save({"m": _model(iteration)}, iteration=iteration)
    names = _names(root)
    assert {"best.pth", f"best.m_model/{METADATA_KEY}"} <= names, names  # old code: deleted as the oldest step
    assert "0000005.m_model/__0_0.distcp" in names
    assert _tops(other) == {"0000001.pth", "0000001.m_model"}
    assert {n.split(".")[0] for n in names if CHECKPOINTER_STEPS.match(n)} == {"0000005", "0000030"}


def test_local_tier_keep_last_local_deletes_only_its_own_committed_steps(bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    ckpt = Checkpointer(f"s3://{bucket}/tiered", local_root=local, keep_last_local=1)
    ckpt.save({"m": _model(10)}, iteration=10, tier="local")
    rank_dir = local / "rank00000"
    # a complete local step under a name the tier never makes (copied with its old times: the oldest)
    shutil.copy2(rank_dir / "0000010.pth", rank_dir / "best.pth")
    (part,) = rank_dir.glob("0000010.m_model.*")  # the marker names its generation relative to the step
    shutil.copytree(part, rank_dir / part.name.replace("0000010", "best"))
    (rank_dir / "0000015.m_model").mkdir()
    (rank_dir / "0000015.m_model" / "__0_0.distcp").write_bytes(b"a crashed local save")
    for iteration in (20, 30):
        ckpt.save({"m": _model(iteration)}, iteration=iteration, tier="local")
    kept = sorted(_plain(p.name) for p in rank_dir.iterdir())
    assert {"best.pth", "best.m_model", "0000015.m_model"} <= set(kept), kept
    assert "0000010.pth" not in kept and "0000020.pth" not in kept and "0000030.pth" in kept, kept
    assert (rank_dir / part.name.replace("0000010", "best") / METADATA_KEY).is_file()


# -- Lightning: S3ModelCheckpoint's rotation through S3TrainerStrategy --------------------------------------
def lightning_job(rank: int, world_size: int, workdir: str, root: str) -> bytes:
    import warnings

    from test_lightning import _as_torchrun, _loader, _Module, _trainer

    from dcp_s3.integrations.lightning import S3ModelCheckpoint

    class Crafting(_Module):
        """Writes a crafted ``best_model_path`` (another run's checkpoint) into the callback state it saves."""

        craft: str | None = None

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            super().on_save_checkpoint(checkpoint)
            for key, state in checkpoint["callbacks"].items():
                if self.craft and "ModelCheckpoint" in key:
                    state["best_model_path"] = self.craft

    _as_torchrun(rank, world_size, workdir)
    refused: list[str] = []

    def fit(dirpath: str, max_steps: int, ckpt_path: str | None = None, craft: str | None = None) -> Any:
        # monitor=None, save_top_k=1: each save replaces best_model_path, the previous one is deleted
        rotation = S3ModelCheckpoint(dirpath, filename="{step}", every_n_train_steps=2, save_top_k=1)
        module = Crafting()
        module.craft = craft
        trainer = _trainer(world_size, os.path.join(workdir, "root"), max_steps, [rotation])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, _loader(), ckpt_path=ckpt_path)
        refused.extend(str(w.message) for w in caught if "does not delete" in str(w.message))
        return trainer

    fit(f"{root}/pretrain", 2)  # pretrain/step=2.ckpt
    # a fine-tune in another dirpath from the pretrain checkpoint: Lightning restores its best_model_path
    fit(f"{root}/finetune", 4, ckpt_path=f"{root}/pretrain/step=2.ckpt", craft=f"{root}/other/step=2.ckpt")
    # resumed from a checkpoint whose stored best_model_path was crafted to name another run's checkpoint;
    # saves step 6 (the crafted path is not deleted) and step 8 (its own step 6 is)
    trainer = fit(f"{root}/finetune", 8, ckpt_path=f"{root}/finetune/step=4.ckpt")
    with warnings.catch_warnings(record=True) as caught:  # the strategy itself, asked directly
        warnings.simplefilter("always")
        trainer.strategy.remove_checkpoint(f"{root}/other/step=2.ckpt")  # no callback of its trainer owns it
        trainer.strategy.remove_checkpoint(f"{root}/finetune/step=99.ckpt")  # owned, but never committed
    refused.extend(str(w.message) for w in caught if "does not delete" in str(w.message))
    buf = io.BytesIO()
    torch.save(refused, buf)
    return buf.getvalue()


@pytest.mark.multiproc
def test_lightning_rotation_deletes_only_under_its_dirpath(bucket: str, tmp_path: Path) -> None:
    root = f"s3://{bucket}"
    other = _plant(f"{root}/other/step=2.ckpt")
    open_store(f"{root}/finetune").write("step=99.ckpt/__0_0.distcp", b"a save killed before its .metadata")
    refused = [torch.load(io.BytesIO(r)) for r in run_ranks(lightning_job, 2, str(tmp_path / "work"), root)]
    assert _tops(f"{root}/pretrain") == {"step=2.ckpt"}  # old code: deleted after the fine-tune's first save
    assert f"step=2.ckpt/{METADATA_KEY}" in _names(f"{root}/pretrain")
    assert _names(f"{root}/other/step=2.ckpt") == other and METADATA_KEY in other  # old code: deleted
    assert _tops(f"{root}/finetune") == {"step=4.ckpt", "step=8.ckpt", "step=99.ckpt"}  # its step 6 was rotated out
    assert "step=99.ckpt/__0_0.distcp" in _names(f"{root}/finetune")
    for rank, messages in enumerate(refused):
        assert any(f"{root}/pretrain/step=2.ckpt" in m for m in messages), messages
        assert sum(f"{root}/other/step=2.ckpt" in m for m in messages) == 1 + (rank == 0), messages


# -- Accelerate / the transformers Trainer: route_fsdp_checkpoints(local_dirs=...) ---------------------------
def trainer_dirs_job(rank: int, world_size: int, workdir: str, run_dir: str, s3_root: str) -> list[str]:
    import transformers.trainer
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from test_accelerate import _model, _train

    from dcp_s3.integrations.accelerate import route_fsdp_checkpoints

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    trainer = transformers.trainer  # the names Trainer._save_checkpoint, its resume and its rotation call
    model = _model(seed=0)
    optimizer = _train(model)

    def save(directory: str) -> None:
        trainer.save_fsdp_model(plugin, accelerator, model, directory)
        trainer.save_fsdp_optimizer(plugin, accelerator, optimizer, model, directory)
        accelerator.wait_for_everyone()

    with route_fsdp_checkpoints():  # another job's checkpoint-5, straight to S3: nothing of it is local
        save(f"{s3_root}/checkpoint-5")
    with route_fsdp_checkpoints(local_dirs={run_dir: s3_root}):  # a job that only loads checkpoint-5
        fresh = _model(seed=1)
        trainer.load_fsdp_model(plugin, accelerator, fresh, os.path.join(run_dir, "checkpoint-5"))
        trainer.load_fsdp_optimizer(
            plugin, accelerator, torch.optim.AdamW(fresh.parameters()), fresh, os.path.join(run_dir, "checkpoint-5")
        )
    accelerator.wait_for_everyone()
    try:  # a job that saves checkpoint-6, loses its node-local output_dir, and fails
        with route_fsdp_checkpoints(local_dirs={run_dir: s3_root}):
            save(os.path.join(run_dir, "checkpoint-6"))
            if rank == 0:
                shutil.rmtree(run_dir)
            accelerator.wait_for_everyone()
            raise RuntimeError("the job failed")
    except RuntimeError:
        pass
    # a job whose output_dir holds checkpoint-5 and -6 from before; it saves 7, 8, 9 with save_total_limit=2
    for step in (5, 6):
        os.makedirs(os.path.join(run_dir, f"checkpoint-{step}"), exist_ok=True)
    accelerator.wait_for_everyone()
    in_bucket = []
    with route_fsdp_checkpoints(local_dirs={run_dir: s3_root}):
        for step in (7, 8, 9):
            save(os.path.join(run_dir, f"checkpoint-{step}"))
            if rank == 0:
                trainer.rotate_checkpoints(output_dir=run_dir, save_total_limit=2)
                in_bucket.append(",".join(sorted(_tops(s3_root))))
            accelerator.wait_for_everyone()
    return in_bucket


@pytest.mark.multiproc
def test_trainer_local_dirs_delete_only_rotated_checkpoints_saved_in_the_block(bucket: str, tmp_path: Path) -> None:
    run_dir, s3_root = str(tmp_path / "output"), f"s3://{bucket}/trainer-run"
    in_bucket = run_ranks(trainer_dirs_job, 2, str(tmp_path / "work"), run_dir, s3_root)[0]
    # the rotation removed checkpoint-5 and -6 locally (saved by other jobs: they stay in S3) and then
    # checkpoint-7 (saved in the block: deleted in S3 too)
    assert sorted(os.listdir(run_dir)) == ["checkpoint-8", "checkpoint-9"]
    assert in_bucket == [
        "checkpoint-5,checkpoint-6,checkpoint-7",
        "checkpoint-5,checkpoint-6,checkpoint-7,checkpoint-8",
        "checkpoint-5,checkpoint-6,checkpoint-8,checkpoint-9",
    ], in_bucket
    names = _names(s3_root)
    for step in (5, 6, 8, 9):  # old code: 5 deleted by the load-only block, 6 by the failed one
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert f"checkpoint-{step}/{part}/{METADATA_KEY}" in names, (step, part)


# -- torchtitan: S3CheckpointManager's keep_latest_k purge ----------------------------------------------------
def titan_job(rank: int, world: int, run: dict[str, Any], dump: str, tmp: str, steps: list[int]) -> bytes:
    from test_torchtitan import _child_env, _packed, _snapshot, _step, _trainer

    _child_env(tmp)
    t = _trainer(rank, world, run, dump)
    manager = t["manager"]
    out: dict[str, Any] = {"loaded": manager.load()}
    for step in steps:
        _step(t)
        manager.save(step)
    out["state"] = _snapshot(t)
    manager.close()
    return _packed(out)


@pytest.mark.multiproc
def test_torchtitan_purge_counts_and_deletes_only_committed_steps(seaweed: Any, bucket: str, tmp_path: Path) -> None:
    from test_torchtitan import _diff, _unpacked

    dump, tmp = tmp_path / "dump", tmp_path / "tmp"
    dump.mkdir()
    tmp.mkdir()
    folder = f"s3://{bucket}/run"
    run = {
        "folder": folder,
        "interval": 2,
        "keep_latest_k": 2,
        "async_mode": "disabled",
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region},
    }
    run_ranks(titan_job, 2, run, str(dump), str(tmp), [1, 2, 3, 4], timeout=180)  # steps 2 and 4, committed
    store = open_store(folder)
    for step in (8, 10):  # later saves killed mid-upload, as a crash leaves them: data, no .metadata
        store.write(f"step-{step}/__0_0.distcp", b"a save killed mid-upload")
    sibling = _plant(f"s3://{bucket}/run-old/step-1")
    trained = _unpacked(run_ranks(titan_job, 2, run, str(dump), str(tmp), [5, 6], timeout=180))
    assert all(r["loaded"] for r in trained)  # from step-4, the newest committed step
    # keep_latest_k=2 over the committed steps {2, 4, 6}: step-2 goes; step-8 and step-10 neither count nor
    # are deleted (old code counted them the newest two and purged 2, 4 and the new 6: nothing to resume from)
    assert _tops(folder) == {"step-4", "step-6", "step-8", "step-10"}
    names = _names(folder)
    assert {f"step-4/{METADATA_KEY}", f"step-6/{METADATA_KEY}", "step-8/__0_0.distcp", "step-10/__0_0.distcp"} <= names
    assert _names(f"s3://{bucket}/run-old/step-1") == sibling
    resumed = _unpacked(run_ranks(titan_job, 2, run, str(dump), str(tmp), [], timeout=180))
    for before, after in zip(trained, resumed, strict=True):
        assert after["loaded"] is True
        assert (
            _diff(
                {k: v for k, v in before["state"].items() if k != "data"},
                {k: v for k, v in after["state"].items() if k != "data"},
            )
            == []
        )
