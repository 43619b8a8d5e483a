"""dcp_s3.integrations.nemo_automodel: NeMo AutoModel 0.7.0's own Checkpointer and CheckpointLifecycle, through dcp_s3.

Real parts: NeMo's ``Checkpointer`` (its ``ModelState``/``OptimizerState``, planners, loads), its ``StatefulRNG``,
torchdata's ``StatefulDataLoader``, an FSDP2 model on two gloo ranks, SeaweedFS. Each phase runs in fresh processes
called as NeMo's recipes call the checkpointer (``BaseRecipe.save_checkpoint``/``load_checkpoint``); what the bucket
holds is listed, and no checkpoint file may appear on local disk.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import full, run_ranks
from objects import object_keys
from torch import nn

from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, ConfigError

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

RUN = "run"


@pytest.fixture(autouse=True)
def _nemo_installed() -> None:
    """No silent skip: the full suite's setup (.ci/run) installs nemo-automodel without its dependencies."""
    try:
        import nemo_automodel  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "these tests need nemo-automodel 0.7.0, installed without its dependencies: "
            "pip install --no-deps nemo-automodel==0.7.0, then pip install -e '.[test]' for the few it needs"
        ) from exc


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


class _Counter:
    """Recipe state saved as ``<key>.pt`` (NeMo's recipes ``torch.save`` e.g. their step scheduler so)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class _Ema:
    """Sharded auxiliary state (NeMo saves such objects with ``save_distributed_state``: DCP on every rank)."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(0.5).add_(v.detach(), alpha=0.5)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)


def _parts(rank: int, world: int, config_kwargs: dict[str, Any], sharded: bool = True) -> dict[str, Any]:
    from nemo_automodel.components.training.rng import StatefulRNG
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dcp_s3.integrations.nemo_automodel import S3Checkpointer, S3CheckpointingConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if sharded:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    sampler = torch.utils.data.DistributedSampler(_Numbers(), num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = StatefulDataLoader(_Numbers(), batch_size=4, sampler=sampler)
    checkpointer = S3CheckpointingConfig(**config_kwargs).build(dp_rank=rank, tp_rank=0, pp_rank=0)
    assert type(checkpointer) is S3Checkpointer  # chosen by the config alone
    return {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "loader": loader,
        "batches": iter(loader),
        "rng": StatefulRNG(seed=7, ranked=True),
        "counter": _Counter(),
        "ema": _Ema(model),
        "ckpt": checkpointer,
    }


def _train(t: dict[str, Any]) -> float:
    x, y = next(t["batches"])
    t["optim"].zero_grad()
    loss = nn.functional.mse_loss(t["model"](x), y)
    loss.backward()
    t["optim"].step()
    t["sched"].step()
    t["counter"].step += 1
    t["ema"].update(t["model"])
    return float(loss.item())


def _save(t: dict[str, Any], root: str, step: int) -> str:
    """What ``BaseRecipe.save_checkpoint`` does, in its order, with the S3 checkpointer's methods for its own writes."""
    ckpt = t["ckpt"]
    path = os.path.join(root, f"epoch_0_step_{step}")
    ckpt.lifecycle.reserve(path)
    ckpt.save_losses({"train_loss": 1.0 / step}, path)  # rank 0 only in NeMo's recipe; a no-op elsewhere here
    ckpt.save_on_global_ranks(t["rng"], "rng", path)
    ckpt.save_on_dp_ranks(t["loader"], "dataloader", path)
    ckpt.save_state(t["counter"], "step_scheduler", path)
    ckpt.save_distributed_state(t["ema"], "ema", path)
    ckpt.save_model(t["model"], path)
    ckpt.save_optimizer(t["optim"], t["model"], path, t["sched"])
    ckpt.save_config({"step": step, "model": {"layers": 2}}, path)
    ckpt.lifecycle.publish(path, best_val_metric=None, metric_key=None)
    return path


def _load(t: dict[str, Any], path: str) -> None:
    """What ``BaseRecipe.load_checkpoint`` does after finding ``path``."""
    ckpt = t["ckpt"]
    ckpt.lifecycle.validate_checkpoint_dir_exists(path, path)
    ckpt.load_on_global_ranks(t["rng"], "rng", path)
    t["rng_state"] = torch.get_rng_state()  # as restored (iter() below draws from it)
    ckpt.load_on_dp_ranks(t["loader"], "dataloader", path)
    ckpt.load_state(t["counter"], "step_scheduler", path)
    ckpt.load_distributed_state(t["ema"], "ema", path)
    ckpt.load_model(t["model"], os.path.join(path, "model"))
    ckpt.load_optimizer(t["optim"], t["model"], path, t["sched"])
    t["batches"] = iter(t["loader"])


def _snapshot(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": full(t["model"].state_dict()),
        "optim": full(t["optim"].state_dict()),
        "sched": t["sched"].state_dict(),
        "loader": t["loader"].state_dict(),
        "step": t["counter"].step,
        "ema": full(t["ema"].state_dict()),
        "torch_rng": t["rng_state"],
    }


def _packed(out: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _unpacked(results: list[bytes]) -> list[Any]:
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def _first_run(rank: int, world: int, config_kwargs: dict[str, Any], tmp: str) -> bytes:
    os.environ.pop("AWS_ENDPOINT_URL", None)  # the config's endpoint_url is the only way to the server
    os.environ["TMPDIR"] = tmp
    from nemo_automodel.components.checkpoint import checkpointing

    t = _parts(rank, world, config_kwargs)
    root = config_kwargs["checkpoint_dir"]
    out: dict[str, Any] = {"fresh": t["ckpt"].latest_checkpoint()}
    for step in (1, 2, 3):
        _train(t)
        _train(t)
        t["rng_state"] = torch.get_rng_state()  # what the save stores
        _save(t, root, step)
    out["at_3"] = _snapshot(t)
    out["loss_next"] = _train(t)
    out["patch_gone"] = not checkpointing.is_cloud_path(root)  # NeMo's function is back once each call returns
    try:
        t["ckpt"].lifecycle.reserve(f"{root}/epoch_0_step_3")  # a published checkpoint is never replaced
    except CheckpointExistsError as exc:
        out["exists"] = str(exc)
    t["ckpt"].close()
    return _packed(out)


def _resume(rank: int, world: int, config_kwargs: dict[str, Any], tmp: str) -> bytes:
    os.environ.pop("AWS_ENDPOINT_URL", None)
    os.environ["TMPDIR"] = tmp
    t = _parts(rank, world, config_kwargs)
    torch.manual_seed(1234 + rank)  # a different RNG state: the load must restore the stored one
    latest = t["ckpt"].latest_checkpoint()
    _load(t, latest)
    out = {
        "latest": latest,
        "at_3": _snapshot(t),
        "loss_next": _train(t),
        "losses": t["ckpt"].load_losses(latest),
        "config": t["ckpt"].load_config(latest),
    }
    t["ckpt"].close()
    return _packed(out)


def _retained(client: Any, bucket: str) -> set[str]:
    """The bucket's keys, after checking retention kept steps 2 and 3 committed, pruned every object of step 1, and
    left the uncommitted save of step 0 and the foreign ``notes/`` name alone."""
    keys = object_keys(client, bucket)
    commits = sorted(k for k in keys if k.endswith("/dcp_s3_commit.json"))
    assert commits == [f"{RUN}/epoch_0_step_2/dcp_s3_commit.json", f"{RUN}/epoch_0_step_3/dcp_s3_commit.json"]
    assert not [k for k in keys if k.startswith(f"{RUN}/epoch_0_step_1/")]  # pruned, every object of it
    assert f"{RUN}/epoch_0_step_0/save.0123456789abcdef/model/__0_0.distcp" in keys
    assert f"{RUN}/notes/epoch_0_step_9/readme.txt" in keys
    return set(keys)


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


@pytest.mark.multiproc
def test_save_and_resume_bit_exact_through_s3(
    seaweed: Any, bucket: str, tmp_path: Path, rank_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two FSDP2 ranks save three checkpoints with NeMo's Checkpointer (model, optimizer and scheduler, RNG, data
    loader, recipe state, losses, config) and keep the last two; fresh processes resume the newest bit-exact."""
    from dcp_s3._dcp import open_store

    work, tmp = tmp_path / "work", rank_tmp
    work.mkdir()
    monkeypatch.chdir(work)  # the ranks' working directory: nothing may land there
    root = f"s3://{bucket}/{RUN}"
    store = open_store(root)
    # what retention must leave alone: an uncommitted save (a crash), a name NeMo's scheme does not make
    store.write("epoch_0_step_0/save.0123456789abcdef/model/__0_0.distcp", b"partial")
    store.write("notes/epoch_0_step_9/readme.txt", b"mine")
    config = {
        "checkpoint_dir": root,
        "max_recent_checkpoints": 2,
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region},
    }
    first = _unpacked(run_ranks(_first_run, 2, config, str(tmp), timeout=240))
    for out in first:
        assert out["fresh"] is None and out["patch_gone"] and "already holds a published checkpoint" in out["exists"]
        assert f"delete {config['checkpoint_dir']}/epoch_0_step_3/dcp_s3_commit.json first" in out["exists"]

    keys = _retained(seaweed.client(), bucket)
    commit = json.loads(store.read("epoch_0_step_3/dcp_s3_commit.json"))
    save = f"{RUN}/epoch_0_step_3/save.{commit['save']}"
    assert sorted(commit["parts"]) == ["ema", "model", "optim"]
    assert sorted(commit["files"]) == [
        "config.yaml",
        "dataloader/dataloader_dp_rank_0.pt",
        "dataloader/dataloader_dp_rank_1.pt",
        "losses.json",
        "rng/rng_global_rank_0.pt",
        "rng/rng_global_rank_1.pt",
        "step_scheduler.pt",
    ]
    assert {f"{save}/model/.metadata", f"{save}/optim/.metadata", f"{save}/rng/rng_global_rank_1.pt"} <= set(keys)
    for part in ("model", "optim", "ema"):  # the data of each part inside this save (NeMo caches its save plans)
        assert {k.split("/")[-1][:4] for k in keys if k.startswith(f"{save}/{part}/__")} == {"__0_", "__1_"}, part
    assert not [
        k
        for k in keys
        if k.startswith(f"{RUN}/epoch_0_step_3/") and not k.startswith(save) and not k.endswith("dcp_s3_commit.json")
    ]

    resumed = _unpacked(run_ranks(_resume, 2, config, str(tmp), timeout=240))
    for rank in range(2):
        assert resumed[rank]["latest"] == f"{root}/epoch_0_step_3"
        assert _diff(first[rank]["at_3"], resumed[rank]["at_3"]) == [], rank
        assert resumed[rank]["loss_next"] == first[rank]["loss_next"]
        assert resumed[rank]["losses"] == {"train_loss": 1.0 / 3}
        assert resumed[rank]["config"] == {"step": 3, "model": {"layers": 2}}
    assert [p for p in work.rglob("*")] == []  # no local directory for an s3:// path (NeMo's makedirs)
    assert not [p for p in tmp.rglob("*") if p.is_file() and p.stat().st_size > 0]


def _single(bucket: str, seaweed: Any, **kwargs: Any) -> dict[str, Any]:
    config = {
        "checkpoint_dir": f"s3://{bucket}/{RUN}",
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region},
        **kwargs,
    }
    return _parts(0, 1, config, sharded=False)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > pwned.txt",))


def _rewrite_commit(store: Any, name: str, change: Any) -> dict[str, Any]:
    doc = json.loads(store.read(f"{name}/dcp_s3_commit.json"))
    change(doc)
    store.write(f"{name}/dcp_s3_commit.json", json.dumps(doc).encode())
    return doc


def test_hostile_stored_files_are_refused(
    seaweed: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored ``.pt`` that would run code, a file of another size than its commit says, a commit naming a path
    outside its save, or one that is no commit: each refused with the object named, before anything runs."""
    from dcp_s3._dcp import open_store

    monkeypatch.chdir(tmp_path)
    t = _single(bucket, seaweed)
    _train(t)
    path = _save(t, f"s3://{bucket}/{RUN}", 1)
    t["ckpt"].close()
    store = open_store(f"s3://{bucket}/{RUN}")
    token = json.loads(store.read("epoch_0_step_1/dcp_s3_commit.json"))["save"]
    rng = f"epoch_0_step_1/save.{token}/rng/rng_global_rank_0.pt"

    buf = io.BytesIO()
    torch.save({"torch_rng_state": _Evil()}, buf)  # a real torch.save archive whose unpickling runs a command
    evil = buf.getvalue()
    store.write(rng, evil)
    _rewrite_commit(store, "epoch_0_step_1", lambda d: d["files"].__setitem__("rng/rng_global_rank_0.pt", len(evil)))
    t = _single(bucket, seaweed)
    with pytest.raises(CheckpointFormatError, match="rng_global_rank_0.pt"):
        t["ckpt"].load_on_global_ranks(t["rng"], "rng", path)
    assert not (tmp_path / "pwned.txt").exists()

    _rewrite_commit(store, "epoch_0_step_1", lambda d: d["files"].__setitem__("rng/rng_global_rank_0.pt", 5))
    t = _single(bucket, seaweed)
    with pytest.raises(CheckpointFormatError, match="its commit says 5"):
        t["ckpt"].load_on_global_ranks(t["rng"], "rng", path)

    _rewrite_commit(store, "epoch_0_step_1", lambda d: d["files"].__setitem__("../../other/x.pt", 5))
    t = _single(bucket, seaweed)
    with pytest.raises(CheckpointFormatError, match="clean relative names"):
        t["ckpt"].load_model(t["model"], f"{path}/model")

    _rewrite_commit(store, "epoch_0_step_1", lambda d: d.__setitem__("save", "../x"))
    t = _single(bucket, seaweed)
    with pytest.raises(CheckpointFormatError, match="save token"):
        t["ckpt"].load_optimizer(t["optim"], t["model"], path, t["sched"])

    for junk in (b"\x80\x04 not json", b"[" * 200_000):  # not JSON; JSON nested past the parser's depth
        store.write("epoch_0_step_1/dcp_s3_commit.json", junk)
        t = _single(bucket, seaweed)
        with pytest.raises(CheckpointFormatError, match="not a JSON document"):
            t["ckpt"].load_losses(path)
    # retention never follows a refused commit
    assert store.size(f"epoch_0_step_1/save.{token}/model/.metadata") is not None


def test_retention_deletes_only_committed_owned_checkpoints(
    seaweed: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_recent_checkpoints=1``: each publish leaves the newest committed checkpoint; an uncommitted
    ``epoch_*_step_*`` (older or newer, even with a DCP part committed), one whose commit does not read or names
    parts that are not there (newer ones: never counted as the one to keep), other names and another root whose
    name starts like this one (``run2``) stay."""
    from dcp_s3._dcp import open_store

    monkeypatch.chdir(tmp_path)
    root = f"s3://{bucket}/{RUN}"
    store = open_store(root)
    store.write("epoch_0_step_0/save.00000000000000aa/model/.metadata", b"x")  # parts but no commit: older
    store.write("epoch_0_step_50/save.00000000000000bb/model/.metadata", b"x")  # and newer than every save
    store.write("epoch_0_step_99x/dcp_s3_commit.json", b"{}")  # not NeMo's scheme
    store.write("epoch_0_step_7/dcp_s3_commit.json", b"garbage")  # newer, with a commit that does not read
    fake = {"format": "dcp_s3.nemo_automodel/1", "save": "00000000000000cc", "parts": ["model"], "files": {}}
    store.write("epoch_0_step_8/dcp_s3_commit.json", json.dumps(fake).encode())  # its part is not there
    sibling = open_store(f"s3://{bucket}/{RUN}2")  # another root that starts like this one
    sibling.write("epoch_0_step_1/dcp_s3_commit.json", json.dumps(fake).encode())
    sibling.write("epoch_0_step_1/save.00000000000000cc/model/.metadata", b"x")
    t = _single(bucket, seaweed, max_recent_checkpoints=1)
    for step in (1, 2, 3):
        _train(t)
        _save(t, root, step)
    assert t["ckpt"].latest_checkpoint() == f"{root}/epoch_0_step_3"  # neither 7 nor 8 is a checkpoint
    t["ckpt"].close()
    names = sorted({k.split("/")[1] for k in object_keys(seaweed.client(), bucket) if k.startswith(f"{RUN}/")})
    assert sibling.size("epoch_0_step_1/dcp_s3_commit.json") is not None
    assert names == [
        "epoch_0_step_0",
        "epoch_0_step_3",
        "epoch_0_step_50",
        "epoch_0_step_7",
        "epoch_0_step_8",
        "epoch_0_step_99x",
    ]


def test_config_refuses_what_s3_cannot_hold() -> None:
    """Formats NeMo writes through its own file-system code, PEFT, a bad storage option or upload deadline: a
    ConfigError naming them (async saves are accepted: test_nemo_async.py)."""
    from dcp_s3.integrations.nemo_automodel import S3CheckpointingConfig

    for kwargs, name in (
        ({"model_save_format": "safetensors"}, "model_save_format"),
        ({"save_consolidated": "final"}, "save_consolidated"),
        ({"async_upload_timeout_s": 0}, "async_upload_timeout_s"),
        ({"storage_options": {"part_sise": 1}}, "part_sise"),
    ):
        with pytest.raises(ConfigError, match=name):
            S3CheckpointingConfig(checkpoint_dir="s3://bucket/run", **kwargs)
    assert S3CheckpointingConfig(checkpoint_dir="s3://bucket/run", is_async=True).is_async
    local = S3CheckpointingConfig(checkpoint_dir="/tmp/run", model_save_format="safetensors")  # NeMo's own rules
    assert local.checkpoint_dir == "/tmp/run"


def test_an_interrupted_save_is_replaced_never_mixed_in(
    seaweed: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save killed before its commit leaves a checkpoint that is not there (not the latest, not loadable); the
    rerun of that step writes a save of its own beside it, and a load reads only the committed one's parts."""
    from dcp_s3._dcp import open_store

    monkeypatch.chdir(tmp_path)
    root = f"s3://{bucket}/{RUN}"
    path = f"{root}/epoch_0_step_1"
    t = _single(bucket, seaweed)
    _train(t)
    t["ckpt"].lifecycle.reserve(path)
    t["ckpt"].save_model(t["model"], path)  # killed here: no optimizer, no commit
    t["ckpt"].close()
    assert _single(bucket, seaweed)["ckpt"].latest_checkpoint() is None

    t = _single(bucket, seaweed)
    for _ in range(3):
        _train(t)
    t["rng_state"] = torch.get_rng_state()
    _save(t, root, 1)
    saved = _snapshot(t)
    t["ckpt"].close()
    names = {k.split("/")[2] for k in object_keys(seaweed.client(), bucket) if k.startswith(f"{RUN}/epoch_0_step_1/")}
    token = json.loads(open_store(root).read("epoch_0_step_1/dcp_s3_commit.json"))["save"]
    assert len(names) == 3 and {"dcp_s3_commit.json", f"save.{token}"} < names  # the killed save's directory stays

    t = _single(bucket, seaweed)
    assert t["ckpt"].latest_checkpoint() == path
    _load(t, path)
    assert _diff(saved, _snapshot(t)) == []


def test_a_local_checkpoint_dir_keeps_nemos_behaviour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same calls on a local ``checkpoint_dir``: NeMo's own directories, markers and LATEST pointer."""
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path / "ckpts")
    t = _parts(0, 1, {"checkpoint_dir": root}, sharded=False)
    _train(t)
    t["rng_state"] = torch.get_rng_state()
    path = _save(t, root, 1)
    saved = _snapshot(t)
    t["ckpt"].close()
    for rel in ("model/.metadata", "optim/.metadata", "rng/rng_global_rank_0.pt", "losses.json", "config.yaml"):
        assert (Path(path) / rel).is_file(), rel
    assert os.path.lexists(Path(root) / "LATEST") or (Path(root) / "LATEST.txt").is_file()

    t = _parts(0, 1, {"checkpoint_dir": root}, sharded=False)
    assert t["ckpt"].latest_checkpoint() == path
    _load(t, path)
    assert _diff(saved, _snapshot(t)) == []
    assert t["ckpt"].load_losses(path) == {"train_loss": 1.0}
