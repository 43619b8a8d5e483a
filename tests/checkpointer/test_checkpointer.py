"""The checkpoint manager: FSDP2 on 2 real ranks (S3 and local dir), single-process contracts."""

from __future__ import annotations

import io
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import full, run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_s3 import CheckpointFormatError, CheckpointNotFoundError, ConfigError
from dcp_s3._checkpointer import AsyncSave, Checkpointer, latest_checkpoint, load_object, save_object
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(12, 16)  # frozen: never saved, keeps its values on load
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)
        self.emb.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(self.emb(x))))


class Counter:
    """A callback with state."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def build(seed: int, shard: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    if shard:
        for layer in (model.inp, model.out):
            fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def train(model: nn.Module, optim: torch.optim.Optimizer, sched: Any, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(8, 12)).square().mean().backward()
    optim.step()
    sched.step()
    optim.zero_grad()


def snapshot(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    out = {"model": full(get_model_state_dict(model))}
    if optim is not None:
        out["optim"] = full(get_optimizer_state_dict(model, optim)["state"])
    return out


def same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, (path, a, b)


def trainable(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sd.items() if not k.startswith("emb.")}


_stores: dict[str, Any] = {}


def names(root: str) -> set[str]:
    if root not in _stores:
        _stores[root] = open_store(root)
    return {e.name for e in _stores[root].list_objects()}


def step40_model_committed(names: set[str]) -> bool:
    """Whether the (never committed) step 40's model part is still there, its ``.metadata`` written."""
    return any(re.fullmatch(r"0000040\.m_model\.[0-9a-f]{16}/\.metadata", n) for n in names)


def manager_job(rank: int, world: int, env: dict[str, str], roots: list[str]) -> None:
    os.environ.update(env)
    for root in roots:
        _scenarios(rank, root)


def _scenarios(rank: int, root: str) -> None:
    model, optim, sched = build(seed=1)
    counter = Counter()
    ckpt = Checkpointer(root, keep_last=2)
    refs = {}
    for it in (10, 20, 30):
        train(model, optim, sched, seed=it)
        counter.calls = it
        where = ckpt.save({"m": model}, {"m": optim}, {"m": sched}, callbacks={"count": counter}, iteration=it)
        assert where == f"{root}/{it:07d}"
        refs[it] = snapshot(model, optim)
    # keep_last=2: step 10 was deleted once 30 completed.
    assert not any(n.startswith("0000010.") for n in names(root))

    # Crash: step 40's parts are written but the marker never is.
    train(model, optim, sched, seed=40)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=40)
    dist.barrier()
    if rank == 0:
        names(root)
        _stores[root].delete(["0000040.pth"])
    dist.barrier()
    assert latest_checkpoint(root) == f"{root}/0000030"

    # Resume: fresh weights, fresh optimizer (its state initialized by get_optimizer_state_dict).
    model2, optim2, sched2 = build(seed=2)
    frozen_before = full(model2.emb.state_dict())
    counter2 = Counter()
    it = ckpt.load({"m": model2}, {"m": optim2}, {"m": sched2}, callbacks={"count": counter2})
    assert it == 30 and counter2.calls == 30 and sched2.last_epoch == 3
    got = snapshot(model2, optim2)
    ref = refs[30]
    same(frozen_before, full(model2.emb.state_dict()))  # frozen: not saved, not loaded
    same(trainable(ref["model"]), trainable(got["model"]))
    same(ref["optim"], got["optim"])

    # Retention never touches the incomplete step 40; a new step 50 pushes out 20.
    train(model2, optim2, sched2, seed=50)
    ckpt.save({"m": model2}, {"m": optim2}, {"m": sched2}, iteration=50)
    steps = names(root)
    assert not any(n.startswith("0000020.") for n in steps)
    assert "0000030.pth" in steps and "0000050.pth" in steps and step40_model_committed(steps)
    ref50 = snapshot(model2, optim2)

    # Missing optimizer checkpoint: an error naming it, unless allowed.
    dist.barrier()
    if rank == 0:
        _stores[root].delete([n for n in names(root) if n.startswith("0000050.m_optim.")])
    dist.barrier()
    model3, optim3, sched3 = build(seed=3)
    with pytest.raises(CheckpointNotFoundError, match="0000050.m_optim"):
        ckpt.load({"m": model3}, {"m": optim3}, path=f"{root}/0000050")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.load({"m": model3}, {"m": optim3}, path=f"{root}/0000050.pth", allow_missing_optim=True) == 50
    assert any("0000050.m_optim" in str(w.message) for w in caught)
    same(trainable(ref50["model"]), trainable(snapshot(model3)["model"]))
    assert not optim3.state  # fresh state

    # An optimizer checkpoint that does not fit (SGD momentum vs Adam state): fresh state, a warning.
    model4, _, _ = build(seed=4)
    sgd = torch.optim.SGD([p for p in model4.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.load({"m": model4}, {"m": sgd}, path=f"{root}/0000030") == 30
    assert any("does not match" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(torch.count_nonzero(full(s["momentum_buffer"])) == 0 for s in sgd.state.values())
    ref30 = trainable(refs[30]["model"])
    same(ref30, trainable(snapshot(model4)["model"]))

    # Meta rank: rank 1 builds the (unsharded) model on the meta device and reads nothing.
    if rank == 0:
        plain = Net()
    else:
        with torch.device("meta"):
            plain = Net()
    assert ckpt.load({"m": plain}, path=f"{root}/0000030") == 30
    if rank == 0:
        same(ref30, trainable(plain.state_dict()))
    else:
        assert all(p.is_meta for p in plain.parameters())

    # A legacy single-file checkpoint of full tensors loads into the sharded model and optimizer.
    legacy = f"{root}_legacy/ckpt.pth"
    full_model = get_model_state_dict(model4, options=StateDictOptions(full_state_dict=True))
    model4_optim = torch.optim.Adam([p for p in model4.parameters() if p.requires_grad], lr=1e-2)
    assert ckpt.load({"m": model4}, {"m": model4_optim}, path=f"{root}/0000030") == 30
    full_optim = get_optimizer_state_dict(model4, model4_optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        save_object({"model": full_model, "optimizer": full_optim, "iteration": 33}, legacy)
    dist.barrier()
    model6, optim6, _ = build(seed=6)
    assert ckpt.load({"m": model6}, {"m": optim6}, path=legacy) == 33
    got6 = snapshot(model6, optim6)
    same(ref30, trainable(got6["model"]))
    same(refs[30]["optim"], got6["optim"])

    # Async: two saves never overlap; the marker appears once every part is written.
    async_ckpt = Checkpointer(root, keep_last=2, async_save=True)
    handles = []
    for it in (60, 70):
        train(model2, optim2, sched2, seed=it)
        h = async_ckpt.save({"m": model2}, {"m": optim2}, {"m": sched2}, iteration=it)
        assert isinstance(h, AsyncSave)
        handles.append(h)
    assert handles[0].done()  # the second save waited for the first
    ref70 = snapshot(model2, optim2)
    async_ckpt.close()
    assert handles[1].result() == f"{root}/0000070"
    dist.barrier()
    assert latest_checkpoint(root) == f"{root}/0000070"
    model5, optim5, sched5 = build(seed=5)
    assert ckpt.load({"m": model5}, {"m": optim5}, {"m": sched5}) == 70
    got70 = snapshot(model5, optim5)
    same(trainable(ref70["model"]), trainable(got70["model"]))
    same(ref70["optim"], got70["optim"])
    steps = names(root)
    # keep_last=2 kept 60 and 70 and deleted 30; the incomplete 40, and 50 (its marker names an optimizer
    # part whose objects were deleted above: incomplete too), are never touched.
    markers = {n.split(".")[0] for n in steps if n.endswith(".pth")}
    assert markers == {"0000050", "0000060", "0000070"}, markers
    assert step40_model_committed(steps)


@pytest.mark.multiproc
def test_manager_on_2_fsdp2_ranks_s3_and_local(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    run_ranks(manager_job, 2, s3_env.env(), [f"s3://{bucket}/run", str(tmp_path / "run")])


# -- single process ---------------------------------------------------------------------------
def test_no_checkpoint_loads_nothing_and_returns_0(bucket: str, tmp_path: Path) -> None:
    for root in (f"s3://{bucket}/empty", str(tmp_path)):
        model, optim, _ = build(seed=0, shard=False)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert Checkpointer(root).load({"m": model}, {"m": optim}) == 0
        same(before, model.state_dict())
        assert latest_checkpoint(root) is None


def test_incomplete_steps_and_partial_uploads_are_never_latest(bucket: str, s3_env: LocalS3Server) -> None:
    root = f"s3://{bucket}/run"
    model, optim, sched = build(seed=0, shard=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ckpt = Checkpointer(root)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, grad_scaler=scaler, iteration=5)
    client = s3_env.client()
    # A newer step with everything but the marker, and an unfinished multipart upload of another.
    client.put_object(Bucket=bucket, Key="run/0000009.m_model/.metadata", Body=b"x")
    client.create_multipart_upload(Bucket=bucket, Key="run/0000011.m_model/__0_0.distcp")
    assert latest_checkpoint(root) == f"{root}/0000005"
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    assert Checkpointer(root).load({"m": build(1, False)[0]}, grad_scaler=scaler2) == 5
    assert scaler2.get_scale() == 256.0
    # Saving over a leftover step replaces it.
    ckpt.save({"m": model}, iteration=9)
    assert latest_checkpoint(root) == f"{root}/0000009"


def test_legacy_single_file_checkpoint(bucket: str, tmp_path: Path) -> None:
    model, optim, _ = build(seed=0, shard=False)
    train(model, optim, torch.optim.lr_scheduler.StepLR(optim, 1), seed=1)
    sd = dict(model.state_dict(), extra_key=torch.ones(1))  # non-strict: unexpected keys are ignored
    for uri in (f"s3://{bucket}/old/ckpt.pth", str(tmp_path / "ckpt.pth"), str(tmp_path / "other" / "model.pt")):
        save_object({"model": sd, "optimizer": optim.state_dict(), "iteration": 7}, uri)
        model2, optim2, _ = build(seed=1, shard=False)
        assert Checkpointer(os.path.dirname(uri)).load({"m": model2}, {"m": optim2}, path=uri) == 7
        same({k: v for k, v in sd.items() if k != "extra_key"}, model2.state_dict())
        same(optim.state_dict()["state"], optim2.state_dict()["state"])
    # Found as the newest step of its directory too.
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt")


def test_missing_optimizer_allowed_by_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optim, _ = build(seed=0, shard=False)
    Checkpointer(tmp_path).save({"m": model}, iteration=3)  # no optimizer saved
    with pytest.raises(CheckpointNotFoundError, match="0000003.m_optim"):
        Checkpointer(tmp_path).load({"m": model}, {"m": optim})
    monkeypatch.setenv("DCP_S3_ALLOW_MISSING_OPTIM", "1")
    with pytest.warns(RuntimeWarning, match="0000003.m_optim"):
        assert Checkpointer(tmp_path).load({"m": model}, {"m": optim}) == 3


def test_objects_and_option_checks(bucket: str, tmp_path: Path) -> None:
    save_object({"a": torch.arange(3), "n": 1}, f"s3://{bucket}/x/obj.pt")
    got = load_object(f"s3://{bucket}/x/obj.pt")
    assert torch.equal(got["a"], torch.arange(3)) and got["n"] == 1
    save_object(Counter(), tmp_path / "c.pt")
    with pytest.raises(CheckpointFormatError, match="add_safe_globals"):
        load_object(tmp_path / "c.pt")
    assert load_object(tmp_path / "c.pt", weights_only=False).calls == 0
    with pytest.raises(ConfigError, match="s3:// locations only"):
        Checkpointer(tmp_path, part_size=8 << 20)
    with pytest.raises(ConfigError, match="unknown storage option"):
        Checkpointer(f"s3://{bucket}/r", bogus=1)
    with pytest.raises(ConfigError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(CheckpointNotFoundError, match="did not complete"):
        ckpt = Checkpointer(tmp_path)
        (tmp_path / "0000003.m_model").mkdir()
        (tmp_path / "0000003.m_model" / ".metadata").write_bytes(b"")
        ckpt.load({"m": Net()}, path=tmp_path / "0000003")
    with pytest.raises(ValueError, match="without '.'"):
        Checkpointer(tmp_path).save({"a.b": Net()})
    buf = io.BytesIO()
    torch.save([1, 2], buf)
    (tmp_path / "0000004.pth").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        Checkpointer(tmp_path).load({"m": Net()}, path=tmp_path / "0000004")


def test_retention_deletes_only_checkpoint_objects(tmp_path: Path) -> None:
    """keep_last removes an old step's checkpoint objects, not a user's file in its directory."""
    model = nn.Linear(4, 4)
    ckpt = Checkpointer(tmp_path / "run", keep_last=1)
    ckpt.save({"m": model}, iteration=1)
    (part,) = (tmp_path / "run").glob("0000001.m_model.*")  # the first save's generation directory
    notes = part / "notes.md"
    notes.write_text("mine")
    ckpt.save({"m": model}, iteration=2)
    assert latest_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "0000002")
    assert notes.read_text() == "mine"
    assert not list(part.glob("*.distcp"))
    assert not (tmp_path / "run" / "0000001.pth").exists()
