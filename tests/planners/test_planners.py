"""Tests of dcp_s3._planners: trainable-only save/load and meta-rank loads."""

from __future__ import annotations

import contextlib
import logging
import pickle
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_s3._planners import (
    MetaRankLoadPlanner,
    TrainableOnlyLoadPlanner,
    TrainableOnlySavePlanner,
    frozen_parameter_fqns,
)
from dcp_s3.errors import CheckpointFormatError
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

DIM, LORA_RANK, LAYERS = 256, 4, 2


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.lora_a = nn.Linear(DIM, LORA_RANK, bias=False)
        self.lora_b = nn.Linear(LORA_RANK, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRAModel(nn.Module):
    """Frozen base layers, small trainable adapters, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear() for _ in range(LAYERS))
        self.register_buffer("scale", torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * self.scale
        return x


def build(seed: int, fsdp: bool = False) -> LoRAModel:
    torch.manual_seed(seed)
    model = LoRAModel()
    for name, param in model.named_parameters():
        param.requires_grad_("lora" in name)
    if fsdp:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


FROZEN = {f"layers.{i}.base.{p}" for i in range(LAYERS) for p in ("weight", "bias")}
TRAINABLE = {f"layers.{i}.lora_{ab}.weight" for i in range(LAYERS) for ab in "ab"}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of the model's state dict (collective under FSDP)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def packed(obj: Any) -> bytes:
    """Pickle tensors by value: torch's queue would pass them as shared memory, gone when the rank exits."""
    return pickle.dumps(obj)


def stored_keys(path: Path) -> set[str]:
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


def assert_loaded(after: dict, saved: dict, fresh: dict, frozen: set[str]) -> None:
    """Non-frozen entries equal the saved ones; frozen ones keep the fresh model's values."""
    for key, value in after.items():
        expected = fresh[key] if key in frozen else saved[key]
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=key)
        assert not torch.equal(fresh[key], saved[key]), f"{key}: seeds give equal values, test is vacuous"


# ---------------------------------------------------------------- single process


def test_frozen_fqns_clean_wrapper_segments(tmp_path: Path) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build(0)
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    compiled = torch.compile(model)
    assert frozen_parameter_fqns(compiled) == FROZEN
    assert frozen_parameter_fqns({"model": compiled, "ema": build(1)}) == {
        f"{prefix}.{k}" for prefix in ("model", "ema") for k in FROZEN
    }
    # Parameter names carry both wrapper segments, state_dict() keys only _orig_mod,
    # get_model_state_dict's neither: all must match.
    assert "_orig_mod.layers.0._checkpoint_wrapped_module.base.weight" in dict(compiled.named_parameters())
    raw = compiled.state_dict()
    assert "_orig_mod.layers.0.base.weight" in raw
    for i, sd in enumerate([raw, get_model_state_dict(compiled)]):
        dcp.save(
            sd,
            storage_writer=FileSystemWriter(tmp_path / str(i)),
            planner=TrainableOnlySavePlanner(compiled),
            no_dist=True,
        )
        keys = stored_keys(tmp_path / str(i))
        assert len(keys) == len(TRAINABLE) + 1
        unwrapped = {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "") for k in keys}
        assert unwrapped == TRAINABLE | {"scale"}


def test_single_process_roundtrip(tmp_path: Path) -> None:
    model = build(0)
    saved = full_state(model)
    dcp.save(
        model.state_dict(),
        storage_writer=FileSystemWriter(tmp_path / "t"),
        planner=TrainableOnlySavePlanner(model),
        no_dist=True,
    )
    assert stored_keys(tmp_path / "t") == TRAINABLE | {"scale"}

    fresh = build(1)
    fresh_values = full_state(fresh)
    sd = fresh.state_dict()
    dcp.load(sd, storage_reader=FileSystemReader(tmp_path / "t"), planner=TrainableOnlyLoadPlanner(fresh), no_dist=True)
    fresh.load_state_dict(sd)
    assert_loaded(full_state(fresh), saved, fresh_values, FROZEN)


def test_single_process_full_checkpoint_leaves_frozen_untouched(tmp_path: Path) -> None:
    model = build(0)
    saved = full_state(model)
    dcp.save({"model": model}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)  # stock planner: all
    assert {"model." + k for k in FROZEN} <= stored_keys(tmp_path)

    fresh = build(1)
    fresh_values = full_state(fresh)
    dcp.load(
        {"model": fresh},
        storage_reader=FileSystemReader(tmp_path),
        planner=TrainableOnlyLoadPlanner({"model": fresh}),
        no_dist=True,
    )
    assert_loaded(full_state(fresh), saved, fresh_values, FROZEN)


def test_single_process_meta_rank_stays_meta(tmp_path: Path) -> None:
    model = build(0)
    dcp.save(model.state_dict(), storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    with torch.device("meta"):
        meta_model = LoRAModel()
    planner = MetaRankLoadPlanner()
    sd = meta_model.state_dict()
    dcp.load(sd, storage_reader=FileSystemReader(tmp_path), planner=planner, no_dist=True)
    assert planner.is_meta_rank
    assert all(v.is_meta for v in sd.values())


def test_planners_pickle_without_modules() -> None:
    model = build(0)
    for planner in (
        TrainableOnlySavePlanner(model, dedup_save_to_lowest_rank=True),
        TrainableOnlyLoadPlanner({"model": model}, allow_partial_load=True),
    ):
        data = pickle.dumps(planner)
        assert b"LoRAModel" not in data and b"LoRALinear" not in data
        clone = pickle.loads(data)
        assert clone.frozen_fqns == planner.frozen_fqns and clone.frozen_fqns
    assert pickle.loads(pickle.dumps(MetaRankLoadPlanner())).is_meta_rank is False


def test_warns_when_no_frozen_key_matches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = build(0)
    with caplog.at_level(logging.WARNING, logger="dcp_s3"):
        dcp.save(
            {"model": model.state_dict()},
            storage_writer=FileSystemWriter(tmp_path),
            planner=TrainableOnlySavePlanner(model),
            no_dist=True,
        )
    assert "pass {key: model}" in caplog.text
    assert {"model." + k for k in FROZEN} <= stored_keys(tmp_path)  # nothing was left out


# ---------------------------------------------------------------- FSDP2, 2 ranks


def _fsdp_lora(rank: int, world_size: int, root: Path) -> bytes:
    out: dict[str, Any] = {}
    model = build(0, fsdp=True)
    out["saved"] = full_state(model)
    dcp.save(
        model.state_dict(), storage_writer=FileSystemWriter(root / "trainable"), planner=TrainableOnlySavePlanner(model)
    )
    dcp.save(model.state_dict(), storage_writer=FileSystemWriter(root / "full"))

    fresh = build(1, fsdp=True)
    out["fresh"] = full_state(fresh)
    sd = fresh.state_dict()
    dcp.load(sd, storage_reader=FileSystemReader(root / "trainable"), planner=TrainableOnlyLoadPlanner(fresh))
    fresh.load_state_dict(sd)
    out["after"] = full_state(fresh)

    # Nested form with optimizer state: {"model": model_sd, "optim": optim_sd}.
    full_opts = StateDictOptions(full_state_dict=True)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(8, DIM)).square().mean().backward()
    optim.step()
    out["saved2"] = full_state(model)
    out["optim_saved"] = get_optimizer_state_dict(model, optim, options=full_opts)["state"]
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(
        state, storage_writer=FileSystemWriter(root / "nested"), planner=TrainableOnlySavePlanner({"model": model})
    )

    fresh2 = build(2, fsdp=True)
    optim2 = torch.optim.AdamW([p for p in fresh2.parameters() if p.requires_grad], lr=0.1)
    out["fresh2"] = full_state(fresh2)
    state = {"model": get_model_state_dict(fresh2), "optim": get_optimizer_state_dict(fresh2, optim2)}
    dcp.load(
        state, storage_reader=FileSystemReader(root / "nested"), planner=TrainableOnlyLoadPlanner({"model": fresh2})
    )
    set_model_state_dict(fresh2, state["model"])
    set_optimizer_state_dict(fresh2, optim2, state["optim"])
    out["after2"] = full_state(fresh2)
    out["optim_after"] = get_optimizer_state_dict(fresh2, optim2, options=full_opts)["state"]
    return packed(out)


def test_fsdp2_trainable_only_roundtrip(tmp_path: Path) -> None:
    results = [pickle.loads(r) for r in run_ranks(_fsdp_lora, 2, tmp_path)]
    assert stored_keys(tmp_path / "trainable") == TRAINABLE | {"scale"}
    nested = stored_keys(tmp_path / "nested")
    assert {k for k in nested if k.startswith("model.")} == {f"model.{k}" for k in TRAINABLE | {"scale"}}
    assert {f"optim.state.{k}.exp_avg" for k in TRAINABLE} <= nested

    saved = results[0]["saved"]
    frozen_bytes = sum(saved[k].nbytes for k in FROZEN)
    kept_bytes = sum(saved[k].nbytes for k in TRAINABLE | {"scale"})
    trainable_disk, full_disk = stored_bytes(tmp_path / "trainable"), stored_bytes(tmp_path / "full")
    assert kept_bytes <= trainable_disk < kept_bytes + 16 * 1024  # small per-item framing overhead
    assert full_disk - trainable_disk >= frozen_bytes

    for rank_out in results:
        assert_loaded(rank_out["after"], saved, rank_out["fresh"], FROZEN)
        assert_loaded(rank_out["after2"], rank_out["saved2"], rank_out["fresh2"], FROZEN)
        assert set(rank_out["optim_after"]) == TRAINABLE
        for fqn, param_state in rank_out["optim_saved"].items():
            for name, value in param_state.items():
                torch.testing.assert_close(rank_out["optim_after"][fqn][name], value, rtol=0, atol=0)


# ---------------------------------------------------------------- meta ranks


BIG_LAYERS, BIG_DIM = 12, 2048  # 12 x 16 MiB fp32 = 192 MiB


def build_big() -> nn.Module:
    return nn.Sequential(*(nn.Linear(BIG_DIM, BIG_DIM, bias=False) for _ in range(BIG_LAYERS)))


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _growth(fn: Any) -> tuple[int, int]:
    """Run fn; return its (RSS growth, peak-RSS growth) in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS; the spawned rank inherited the parent's
    rss = psutil.Process().memory_info().rss
    fn()
    return psutil.Process().memory_info().rss - rss, _peak_rss() - rss


def _meta_big() -> nn.Module:
    with torch.device("meta"):
        return build_big()


def _load_with_meta_rank(rank: int, world_size: int, root: Path) -> bytes:
    out: dict[str, Any] = {}
    reader = FileSystemReader(root / "big")
    sd = (_meta_big().to_empty(device="cpu") if rank == 0 else _meta_big()).state_dict()
    out["growth"] = _growth(lambda: dcp.load(sd, storage_reader=reader, planner=MetaRankLoadPlanner()))
    out["all_meta"] = all(v.is_meta for v in sd.values())
    if rank == 0:
        out["sums"] = {k: v.double().sum().item() for k, v in sd.items()}

    # Control: the stock planner materializes rank 1's meta tensors (rank 0 now is the meta rank).
    del sd
    sd = _meta_big().state_dict()
    planner = DefaultLoadPlanner() if rank == 1 else MetaRankLoadPlanner()
    out["stock_growth"] = _growth(lambda: dcp.load(sd, storage_reader=reader, planner=planner))
    del sd

    # TrainableOnlyLoadPlanner does the same: all of rank 1's tensors stay meta.
    with torch.device("meta") if rank == 1 else contextlib.nullcontext():
        small = build(1)
    sd = small.state_dict()
    dcp.load(sd, storage_reader=FileSystemReader(root / "small"), planner=TrainableOnlyLoadPlanner(small))
    out["small"] = dict(sd) if rank == 0 else all(v.is_meta for v in sd.values())
    return packed(out)


def test_meta_rank_loads_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    big = build_big()
    dcp.save(big.state_dict(), storage_writer=FileSystemWriter(tmp_path / "big"), no_dist=True)
    sums = {k: v.double().sum().item() for k, v in big.state_dict().items()}
    ckpt_bytes = stored_bytes(tmp_path / "big")
    del big
    small = build(0)
    dcp.save(
        small.state_dict(),
        storage_writer=FileSystemWriter(tmp_path / "small"),
        planner=TrainableOnlySavePlanner(small),
        no_dist=True,
    )

    real, meta = (pickle.loads(r) for r in run_ranks(_load_with_meta_rank, 2, tmp_path))
    assert ckpt_bytes > 190 * 2**20
    assert real["sums"] == pytest.approx(sums, rel=1e-12) and not real["all_meta"]
    assert meta["all_meta"] and meta["small"] is True
    assert max(meta["growth"]) < 16 * 2**20, meta["growth"]
    assert min(meta["stock_growth"]) > ckpt_bytes * 0.9, meta["stock_growth"]  # the measurement sees a load
    assert_loaded(real["small"], full_state(small), full_state(build(1)), FROZEN)


# ---------------------------------------------------------------- errors, 2 ranks


def _error(fn: Any) -> str:
    try:
        fn()
    except BaseException as exc:  # DCP raises CheckpointException (a BaseException) on every rank
        return str(exc)
    return "no error"


def _error_cases(rank: int, world_size: int, root: Path) -> dict[str, str]:
    model = build(0)
    dcp.save(model.state_dict(), storage_writer=FileSystemWriter(root / "ok"), planner=TrainableOnlySavePlanner(model))
    reader = FileSystemReader(root / "ok")
    out = {}

    if rank == 1:
        model.layers[1].lora_a.weight.requires_grad_(False)
    out["mismatch"] = _error(
        lambda: dcp.save(
            model.state_dict(),
            storage_writer=FileSystemWriter(root / "mismatch"),
            planner=TrainableOnlySavePlanner(model),
        )
    )

    fresh = build(1)
    sd = fresh.state_dict()
    if rank == 1:
        sd["layers.1.lora_b.weight"] = sd["layers.1.lora_b.weight"].to("meta")
    out["partial_meta"] = _error(lambda: dcp.load(sd, storage_reader=reader, planner=TrainableOnlyLoadPlanner(fresh)))

    unfrozen = build(1)
    unfrozen.layers[0].base.weight.requires_grad_(True)  # unfrozen since the checkpoint was saved
    out["missing"] = _error(
        lambda: dcp.load(unfrozen.state_dict(), storage_reader=reader, planner=TrainableOnlyLoadPlanner(unfrozen))
    )
    out["partial_ok"] = _error(
        lambda: dcp.load(
            unfrozen.state_dict(),
            storage_reader=reader,
            planner=TrainableOnlyLoadPlanner(unfrozen, allow_partial_load=True),
        )
    )
    return out


@pytest.fixture(scope="module")
def error_messages(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_error_cases, 2, tmp_path_factory.mktemp("errors"))


def test_ranks_disagreeing_on_frozen_set_fail_naming_the_key(error_messages: list[dict[str, str]]) -> None:
    for messages in error_messages:  # every rank gets the coordinator's error, none hangs
        assert "ranks disagree on frozen parameters" in messages["mismatch"]
        assert (
            "'layers.1.lora_a.weight' is frozen (requires_grad=False) on ranks [1] but saved on ranks [0]"
            in (messages["mismatch"])
        )


def test_partly_meta_rank_fails_naming_a_meta_key(error_messages: list[dict[str, str]]) -> None:
    for messages in error_messages:
        assert "'layers.1.lora_b.weight' is meta" in messages["partial_meta"]
        assert "RANK 1" in messages["partial_meta"] and "RANK 0" not in messages["partial_meta"]


def test_missing_trainable_key_fails_naming_it(error_messages: list[dict[str, str]]) -> None:
    for messages in error_messages:
        assert CheckpointFormatError.__name__ in messages["missing"]
        assert "trainable entry 'layers.0.base.weight' is not in the checkpoint" in messages["missing"]
        assert messages["partial_ok"] == "no error"
