"""The transformers Trainer's FSDP checkpoints through ``route_fsdp_checkpoints(local_dirs=...)``, on gloo ranks.

Accelerate turns FSDP on only on accelerators, so no ``Trainer`` trains FSDP here; the ranks make
the calls ``Trainer._save_checkpoint`` and its resume make, through the names the
``transformers.trainer`` module holds (``save_fsdp_model``, ``save_fsdp_optimizer``,
``rotate_checkpoints`` on the saving process, ``get_last_checkpoint``, ``load_fsdp_model``,
``load_fsdp_optimizer``), with transformers' own functions, a real CPU ``Accelerator`` and FSDP2
models, against SeaweedFS.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

try:
    import transformers.trainer
    import transformers.trainer_utils
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
except ImportError as exc:  # a missing framework fails the run, never skips it
    raise ImportError(
        "tests/integrations/test_transformers_trainer.py needs transformers and accelerate==1.15.0: "
        "pip install -e '.[test]'"
    ) from exc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_accelerate import _equal, _model, _state, _train
from torch import nn

from dcp_s3 import ConfigError, StorageOptions
from dcp_s3._layout import METADATA_KEY
from dcp_s3.integrations.accelerate import route_fsdp_checkpoints
from dcp_s3.integrations.trainer_dirs import LocalDirs

pytestmark = pytest.mark.multiproc


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    nn.functional.mse_loss(model(torch.randn(8, 8, generator=g)), torch.randn(8, 4, generator=g)).backward()
    optimizer.step()
    optimizer.zero_grad()


def trainer_job(rank: int, world_size: int, workdir: str, run_dir: str, s3_root: str) -> bytes:
    """Three Trainer checkpoints with save_total_limit=2, then a resume in the same processes."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    trainer = transformers.trainer  # the module whose names Trainer._save_checkpoint and the resume call
    model = _model(seed=0)
    optimizer = _train(model)
    saved, in_bucket = {}, {}
    with route_fsdp_checkpoints(local_dirs={run_dir: s3_root}):
        for step in (1, 2, 3):
            _step(model, optimizer, seed=10 + step)
            output_dir = os.path.join(run_dir, f"checkpoint-{step}")
            trainer.save_fsdp_model(plugin, accelerator, model, output_dir)
            trainer.save_fsdp_optimizer(plugin, accelerator, optimizer, model, output_dir)
            saved[step] = _state(model, optimizer)
            if rank == 0:  # Trainer: `if self.args.should_save:` state json, then the rotation
                with open(os.path.join(output_dir, "trainer_state.json"), "w") as f:
                    f.write(f'{{"global_step": {step}}}')
                trainer.rotate_checkpoints(output_dir=run_dir, save_total_limit=2, use_mtime=True)
                store = StorageOptions().store(s3_root)
                in_bucket[step] = sorted({e.name.split("/")[0] for e in store.list_objects()})
            accelerator.wait_for_everyone()
        resume = trainer.get_last_checkpoint(run_dir)
        fresh = _model(seed=1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        trainer.load_fsdp_model(plugin, accelerator, fresh, resume)
        trainer.load_fsdp_optimizer(plugin, accelerator, fresh_optimizer, fresh, resume)
        loaded = _state(fresh, fresh_optimizer)
    restored = trainer.rotate_checkpoints is transformers.trainer_utils.rotate_checkpoints
    buf = io.BytesIO()
    torch.save(
        {"saved": saved[3], "loaded": loaded, "resume": resume, "restored": restored, "in_bucket": in_bucket}, buf
    )
    return buf.getvalue()


def test_trainer_checkpoints_rotation_and_resume_through_s3(bucket: str, tmp_path: Path) -> None:
    run_dir, s3_root = str(tmp_path / "output"), f"s3://{bucket}/trainer-run"
    results = [
        torch.load(io.BytesIO(r), weights_only=False)
        for r in run_ranks(trainer_job, 2, str(tmp_path / "work"), run_dir, s3_root)
    ]
    # the bucket holds exactly the two checkpoints the rotation kept, each the model and the optimizer
    names = sorted(e.name for e in StorageOptions().store(s3_root).list_objects())
    assert {n.split("/")[0] for n in names} == {"checkpoint-2", "checkpoint-3"}, names
    for step in (2, 3):
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert f"checkpoint-{step}/{part}/{METADATA_KEY}" in names
    # locally: the Trainer's own file and empty shard directories, no data, no metadata
    files = sorted(os.path.relpath(os.path.join(d, n), run_dir) for d, _, fs in os.walk(run_dir) for n in fs)
    assert files == ["checkpoint-2/trainer_state.json", "checkpoint-3/trainer_state.json"], files
    assert sorted(os.listdir(run_dir)) == ["checkpoint-2", "checkpoint-3"]
    assert os.path.isdir(os.path.join(run_dir, "checkpoint-3", "pytorch_model_fsdp_0"))  # what the resume looks for
    assert results[0]["in_bucket"] == {  # right after each rotation, not later
        1: ["checkpoint-1"],
        2: ["checkpoint-1", "checkpoint-2"],
        3: ["checkpoint-2", "checkpoint-3"],
    }
    for rank, got in enumerate(results):
        assert got["resume"] == os.path.join(run_dir, "checkpoint-3")
        assert _equal(got["saved"], got["loaded"]), f"rank {rank}: resumed state differs from the last saved one"
        assert got["restored"], "route_fsdp_checkpoints left transformers' rotate_checkpoints replaced"


def test_a_local_directory_gone_outside_the_rotation_is_not_mirrored(bucket: str, tmp_path: Path) -> None:
    """The Trainer's end of training (save_total_limit=1 with a best checkpoint) deletes without rotating:
    an absent local directory alone deletes nothing in S3 (tests/integrations/test_deletion_ownership.py)."""
    run_dir, s3_root = tmp_path / "output", f"s3://{bucket}/trainer-end"
    options = StorageOptions()
    for step in (4, 8):
        dcp.save(
            {"w": torch.arange(6, dtype=torch.float32) + step},
            storage_writer=options.writer(f"{s3_root}/checkpoint-{step}/pytorch_model_fsdp_0"),
            no_dist=True,
        )
        (run_dir / f"checkpoint-{step}").mkdir(parents=True)
    with route_fsdp_checkpoints(local_dirs={run_dir: s3_root}):
        transformers.trainer.rotate_checkpoints(output_dir=str(run_dir), save_total_limit=2)  # deletes nothing
        (run_dir / "checkpoint-4").rmdir()  # as Trainer.train's final shutil.rmtree
    names = {e.name.split("/")[0] for e in options.store(s3_root).list_objects()}
    assert names == {"checkpoint-4", "checkpoint-8"}


def test_local_dirs_map_only_what_is_under_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "link").symlink_to(out, target_is_directory=True)
    dirs = LocalDirs({out: "s3://bkt/run", out / "nested": "s3://other-bkt/x"}, StorageOptions())
    assert dirs.locate(out / "checkpoint-5") == "s3://bkt/run/checkpoint-5"
    assert dirs.locate(tmp_path / "link" / "checkpoint-5" / "optimizer_0") == "s3://bkt/run/checkpoint-5/optimizer_0"
    assert dirs.locate(out / "nested" / "checkpoint-1") == "s3://other-bkt/x/checkpoint-1"  # the longest root wins
    assert dirs.locate(out) == "s3://bkt/run"
    assert dirs.locate(out / ".." / "outside") is None
    assert dirs.locate(str(out) + "-sibling") is None
    assert dirs.locate("s3://bkt/run/checkpoint-5") is None  # an S3 location is not a local directory
    assert dirs.saved == {}  # locating records nothing: only a save does
    dirs.record_save(out / "checkpoint-5" / "optimizer_0")
    dirs.record_save(out / "nested" / "checkpoint-1" / "pytorch_model_fsdp_0")
    dirs.record_save(out / "checkpoint-5")  # not a part of a checkpoint: nothing
    dirs.record_save(out / "notes" / "optimizer_0")  # not a checkpoint-<N> directory: nothing
    assert dirs.saved == {
        os.path.realpath(out / "checkpoint-5"): ("s3://bkt/run", "checkpoint-5", {"optimizer_0"}),
        os.path.realpath(out / "nested" / "checkpoint-1"): (
            "s3://other-bkt/x",
            "checkpoint-1",
            {"pytorch_model_fsdp_0"},
        ),
    }
    for bad in ("/local/path", "s3://", "s3:///x", "s3://Not_A_Bucket/x", "gs://b/x", ""):
        with pytest.raises(ConfigError, match="local_dirs"):
            LocalDirs({out: bad}, StorageOptions())
    with pytest.raises(ConfigError, match="local_dirs"):
        LocalDirs({3: "s3://bkt/x"}, StorageOptions())  # type: ignore[dict-item]
