"""Lightning 2.6.6 Fabric and Trainer (ModelParallelStrategy, FSDP2 on gloo ranks) saving to and resuming from SeaweedFS.

Each scenario trains in real rank processes, saves through Lightning's own checkpoint code with
dcp_s3's strategies, then resumes in fresh processes (and, for Fabric, on another rank count):
model, optimizer, scheduler and loop state bit-exact, the next step's loss equal. What counts is
what is in the bucket (a ``storage_writer`` with a local path would pass too: NOTES.md); the
tmp dirs the ranks ran in must hold no checkpoint file.
"""

from __future__ import annotations

import copy
import io
import os
import uuid
from pathlib import Path
from typing import Any

try:
    import lightning  # noqa: F401
    from lightning.fabric import Fabric
    from lightning.pytorch import LightningModule, Trainer
except ImportError as exc:  # a missing framework fails the run, never skips it
    raise ImportError(
        "tests/integrations/test_lightning.py needs lightning==2.6.6: pip install -e '.[test]' "
        "(or pip install lightning==2.6.6)"
    ) from exc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import full, run_ranks
from hostile import PeakRss, memory_cap, root_causes
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from dcp_s3 import StorageOptions
from dcp_s3._layout import METADATA_KEY
from dcp_s3.integrations.lightning import S3FabricStrategy, S3ModelCheckpoint, S3TrainerStrategy
from dcp_s3.integrations.lightning_io import META_KEY

pytestmark = pytest.mark.multiproc

_CHECKPOINT_NAMES = (".distcp", METADATA_KEY, "meta.pt", ".ckpt")


def _pack(result: Any) -> bytes:
    """A rank's result as bytes: tensors sent through the queue would need the (exited) rank alive."""
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _ranks(fn: Any, world_size: int, *args: Any) -> list[Any]:
    return [torch.load(io.BytesIO(r), weights_only=False) for r in run_ranks(fn, world_size, *args)]


def _as_torchrun(rank: int, world_size: int, workdir: str) -> None:
    """The environment torchrun gives a rank (Lightning reads it: TorchElasticEnvironment); cwd in ``workdir``."""
    os.environ.update(
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", TORCHELASTIC_RUN_ID="dcp-s3-test"
    )
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)


def _parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same on every rank: a 1-rank run computes the same
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


# -- Fabric -----------------------------------------------------------------------------------------
def _fabric(world_size: int) -> Fabric:
    strategy = S3FabricStrategy(_parallelize, data_parallel_size=world_size, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return fabric


def _fabric_objects(fabric: Fabric, seed: int) -> tuple[Any, Any, Any]:
    model = fabric.setup_module(_net(seed))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _fabric_step(fabric: Fabric, model: Any, optimizer: Any, scheduler: Any, step: int) -> float:
    x, y = _batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return loss.item()


def _fabric_state(model: Any, optimizer: Any) -> dict[str, Any]:
    module = model.module
    return {"model": full(get_model_state_dict(module)), "optim": full(get_optimizer_state_dict(module, optimizer))}


def fabric_train(rank: int, world_size: int, location: str) -> dict[str, Any]:
    fabric = _fabric(world_size)
    model, optimizer, scheduler = _fabric_objects(fabric, seed=0)
    for step in range(3):
        _fabric_step(fabric, model, optimizer, scheduler, step)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 3, "hparams": {"lr": 0.05}}
    fabric.save(Path(location) if rank == 1 else location, state)  # rank 1's Path("s3://..."): rank 0's path wins
    saved, scheduler_state = _fabric_state(model, optimizer), copy.deepcopy(scheduler.state_dict())
    next_loss = _fabric_step(fabric, model, optimizer, scheduler, 3)
    return {"saved": saved, "scheduler": scheduler_state, "next_loss": next_loss}


def fabric_resume(rank: int, world_size: int, location: str) -> dict[str, Any]:
    fabric = _fabric(world_size)
    model, optimizer, scheduler = _fabric_objects(fabric, seed=123)  # other weights: the load must replace them
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "hparams": None}
    remainder = fabric.load(location, state)
    loaded = _fabric_state(model, optimizer)
    got = {
        "loaded": loaded,
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "step": state["step"],
        "hparams": state["hparams"],
    }
    return {**got, "remainder": remainder, "next_loss": _fabric_step(fabric, model, optimizer, scheduler, 3)}


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _bucket_names(location: str) -> list[str]:
    """The first name level of every object under ``location`` in the bucket (SeaweedFS lists
    directories left empty by deletes, so the objects are listed, not the directories)."""
    return sorted({e.name.split("/")[0] for e in StorageOptions().store(location).list_objects()})


def _stored_meta(location: str) -> dict[str, Any]:
    """Lightning's metadata as stored: read with a plain ``S3StorageReader`` and weights-only unpickling."""
    reader = StorageOptions().reader(location)
    size = reader.read_metadata().state_dict_metadata[META_KEY].size
    request = {META_KEY: torch.empty(size, dtype=torch.uint8)}
    dcp.load(request, storage_reader=StorageOptions().reader(location), no_dist=True)
    return torch.load(io.BytesIO(request[META_KEY].numpy().tobytes()), weights_only=True)


def _assert_no_local_checkpoint(*roots: Path) -> None:
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                assert not name.startswith("s3:"), f"{dirpath}/{name}: an s3:// path was used as a local one"
                assert not any(name.endswith(s) for s in _CHECKPOINT_NAMES), (
                    f"checkpoint file on local disk: {dirpath}/{name}"
                )


# -- Trainer ----------------------------------------------------------------------------------------
class _Module(LightningModule):
    def __init__(self, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _net(seed)
        self.losses: dict[int, float] = {}
        self.saved: dict[int, Any] = {}
        self.restored: Any = None

    def configure_model(self) -> None:
        _parallelize(self.net, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _state(self) -> dict[str, Any]:
        optimizer = self.trainer.strategy.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        return {
            "model": full(get_model_state_dict(self.trainer.strategy.model)),
            "optim": full(get_optimizer_state_dict(self.trainer.strategy.model, optimizer)),
            "scheduler": scheduler.state_dict(),
            "global_step": self.trainer.global_step,
            "epoch": self.trainer.current_epoch,
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.saved[self.trainer.global_step] = self._state()

    def on_train_start(self) -> None:
        self.restored = self._state()


def _loader() -> DataLoader:
    """Two batches per rank and epoch (Lightning's DistributedSampler shuffles them per epoch)."""
    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)), batch_size=8)


def _trainer(world_size: int, root: str, max_steps: int, callbacks: list[Any]) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        default_root_dir=root,
        logger=False,
        strategy=S3TrainerStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def trainer_fit(rank: int, world_size: int, workdir: str, dirpath: str) -> dict[str, Any]:
    # every 2 steps = at each epoch's end: a plain DataLoader has no position to resume mid-epoch from
    rotation = S3ModelCheckpoint(
        dirpath, filename="{step}", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max"
    )
    module = _Module()
    trainer = _trainer(world_size, os.path.join(workdir, "root"), 6, [rotation])
    trainer.fit(module, _loader())
    return {"losses": module.losses, "saved": module.saved, "best": sorted(rotation.best_k_models)}


def trainer_resume(rank: int, world_size: int, workdir: str, ckpt: str) -> dict[str, Any]:
    module = _Module(seed=99)
    trainer = _trainer(world_size, os.path.join(workdir, "root"), 5, [])
    trainer.fit(module, _loader(), ckpt_path=ckpt)
    return {"losses": module.losses, "restored": module.restored}


# -- the runs: three launches of fresh processes, shared by the tests below ------------------------------
def save_job(rank: int, world_size: int, workdir: str, root: str) -> bytes:
    _as_torchrun(rank, world_size, workdir)
    fabric = fabric_train(rank, world_size, f"{root}/fabric/step-3")
    return _pack({"fabric": fabric, "trainer": trainer_fit(rank, world_size, workdir, f"{root}/trainer")})


def resume_job(rank: int, world_size: int, workdir: str, root: str) -> bytes:
    _as_torchrun(rank, world_size, workdir)
    fabric = fabric_resume(rank, world_size, f"{root}/fabric/step-3")
    if world_size == 1:  # the resharded load: Fabric only
        return _pack({"fabric": fabric})
    return _pack(
        {"fabric": fabric, "trainer": trainer_resume(rank, world_size, workdir, f"{root}/trainer/step=4.ckpt")}
    )


@pytest.fixture(scope="module")
def runs(seaweed: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lightning")
    with pytest.MonkeyPatch.context() as mp:  # what the s3_env and _no_real_aws fixtures set, for the module
        for name, value in seaweed.env().items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_CONFIG_FILE", str(tmp / "aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp / "aws-credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        root = "s3://" + seaweed.create_bucket(f"t-{uuid.uuid4().hex[:16]}")
        return {
            "root": root,
            "tmp": tmp,
            "saved": _ranks(save_job, 2, str(tmp / "save"), root),
            "resumed": _ranks(resume_job, 2, str(tmp / "resume2"), root),
            "resharded": _ranks(resume_job, 1, str(tmp / "resume1"), root),
        }


def test_fabric_checkpoint_is_one_dcp_checkpoint_with_its_metadata(runs: dict[str, Any], s3_env: Any) -> None:
    location = f"{runs['root']}/fabric/step-3"
    assert _bucket_names(f"{runs['root']}/fabric") == ["step-3"]
    assert METADATA_KEY in _bucket_names(location) and "meta.pt" not in _bucket_names(location)
    assert _stored_meta(location) == {
        "scheduler": runs["saved"][0]["fabric"]["scheduler"],
        "step": 3,
        "hparams": {"lr": 0.05},
    }  # the non-tensor state, inside the one DCP checkpoint, loadable weights-only


@pytest.mark.parametrize("resume", ["resumed", "resharded"])
def test_fabric_resume_is_bit_exact(runs: dict[str, Any], resume: str) -> None:
    """Fresh processes on 2 ranks, and a resharded load on 1 rank."""
    trained = [r["fabric"] for r in runs["saved"]]
    for rank, got in enumerate(r["fabric"] for r in runs[resume]):
        _assert_equal(trained[0]["saved"], got["loaded"], f"{resume}, rank {rank}")
        assert got["scheduler"] == trained[0]["scheduler"] and got["scheduler"]["last_epoch"] == 3
        assert (got["step"], got["hparams"], got["remainder"]) == (3, {"lr": 0.05}, {})
        assert got["next_loss"] == trained[rank]["next_loss"], (resume, rank)


def test_trainer_rotation_deletes_from_the_bucket(runs: dict[str, Any], s3_env: Any) -> None:
    dirpath = f"{runs['root']}/trainer"
    # every_n_train_steps=2 saved steps 2, 4, 6; save_top_k=2 rotation deleted step 2 from the bucket
    assert _bucket_names(dirpath) == ["step=4.ckpt", "step=6.ckpt"]
    assert runs["saved"][0]["trainer"]["best"] == [f"{dirpath}/step=4.ckpt", f"{dirpath}/step=6.ckpt"]
    meta = _stored_meta(f"{dirpath}/step=4.ckpt")
    assert meta["global_step"] == 4 and meta["hyper_parameters"] == {"width": 32, "seed": 0}
    assert {"loops", "callbacks", "lr_schedulers"} <= meta.keys() and "state_dict" not in meta


def test_trainer_resume_is_bit_exact(runs: dict[str, Any]) -> None:
    for rank in range(2):
        trained, resumed = runs["saved"][rank]["trainer"], runs["resumed"][rank]["trainer"]
        saved, got = dict(trained["saved"][4]), dict(resumed["restored"])
        # saved during the last batch of epoch 1; restored, the loop starts epoch 2 (Lightning's rule)
        assert (saved.pop("epoch"), got.pop("epoch")) == (1, 2)
        _assert_equal(saved, got, f"rank {rank}")
        assert got["global_step"] == 4
        assert resumed["losses"] == {5: trained["losses"][5]}


def test_no_checkpoint_file_on_local_disk(runs: dict[str, Any]) -> None:
    _assert_no_local_checkpoint(runs["tmp"])


# -- in-process checks (no ranks) -------------------------------------------------------------------
class _Boom:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /dev/null",))


def test_s3_paths_are_taken_as_given_and_repaired() -> None:
    from dcp_s3.integrations._locations import s3_location

    assert s3_location("s3://b/run/step-1/") == "s3://b/run/step-1"
    assert s3_location(Path("s3://b/run/step-1")) == "s3://b/run/step-1"  # Path() made it s3:/b/...
    assert s3_location(os.path.normpath("s3://b/run")) == "s3://b/run"
    assert s3_location("/tmp/run") is None and s3_location(3) is None


def test_s3_model_checkpoint_refuses_local_dirs_and_links() -> None:
    from dcp_s3 import ConfigError

    with pytest.raises(ConfigError, match="s3:// location"):
        S3ModelCheckpoint("/tmp/checkpoints")
    with pytest.raises(ConfigError, match="save_last='link'"):
        S3ModelCheckpoint("s3://b/run", save_last="link")


def test_crafted_metadata_is_refused_not_run(tmp_path: Path) -> None:
    """The metadata bytes are unpickled weights-only after dcp_s3's check: a pickle that calls
    ``os.system`` is a CheckpointFormatError naming the checkpoint; plain metadata loads."""
    from dcp_s3 import CheckpointFormatError
    from dcp_s3.integrations.lightning_io import load_sharded, save_sharded

    options = StorageOptions()
    module = nn.Linear(4, 2)
    for name, meta in (("good", {"step": 7, "hparams": {"lr": 0.1}}), ("evil", {"step": _Boom()})):
        save_sharded({"model": get_model_state_dict(module)}, meta, str(tmp_path / name), options, rank=0)
    assert load_sharded(str(tmp_path / "good"), "model", module, {}, options) == {"step": 7, "hparams": {"lr": 0.1}}
    with pytest.raises(CheckpointFormatError, match="evil"):
        load_sharded(str(tmp_path / "evil"), "model", module, {}, options)


@pytest.mark.timeout(300)
def test_metadata_declaring_more_than_its_stored_bytes_allow_is_refused_before_allocation(tmp_path: Path) -> None:
    """A few stored kilobytes (zstd) declaring a 256 MiB ``lightning.meta.pt``: refused by the rule of byte items
    (at most 64 times its stored bytes, or 64 MiB) before its buffer is allocated or decoded, so memory stays
    flat; the reason names the item and both sizes. (Such a checkpoint once grew every rank by 2x its size.)"""
    from dcp_s3 import CheckpointFormatError
    from dcp_s3.integrations.lightning_io import load_sharded

    location, declared = str(tmp_path / "crafted"), 256 << 20
    module = nn.Linear(4, 2)
    state = {"model": get_model_state_dict(module), META_KEY: torch.zeros(declared, dtype=torch.uint8)}
    dcp.save(state, storage_writer=StorageOptions(compression="zstd").writer(location))
    del state
    assert sum(f.stat().st_size for f in Path(location).iterdir()) < 1 << 20  # what an attacker ships
    with (
        memory_cap(1 << 30),
        PeakRss().watch() as rss,
        pytest.raises((CheckpointFormatError, CheckpointException)) as caught,
    ):
        load_sharded(location, "model", module, {}, StorageOptions())
    assert rss.growth < 128 << 20, rss.growth
    why = [str(c) for c in root_causes(caught.value) if isinstance(c, CheckpointFormatError)]
    assert any(f"{META_KEY} declares {declared} bytes stored in" in w and "64 times" in w for w in why), why
