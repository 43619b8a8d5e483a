"""Accelerate 1.15's FSDP checkpoint utilities, routed by ``route_fsdp_checkpoints``, on gloo ranks against SeaweedFS.

Accelerate turns FSDP on only on accelerators, so the ranks call its utilities — by the names
``accelerate.utils`` and ``Accelerator.save_state`` use — with a real ``Accelerator`` (CPU, gloo)
and FSDP2 ``fully_shard`` models, as its ``save_state``/``load_state`` and the transformers
``Trainer`` would.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

try:
    import accelerate
    import accelerate.accelerator
    import accelerate.utils
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
except ImportError as exc:  # a missing framework fails the run, never skips it
    raise ImportError(
        "tests/integrations/test_accelerate.py needs accelerate==1.15.0: pip install -e '.[test]' "
        "(or pip install accelerate==1.15.0)"
    ) from exc

import pytest
import torch
from dist_utils import full, run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_s3 import ConfigError, StorageOptions
from dcp_s3._layout import METADATA_KEY
from dcp_s3.integrations.accelerate import route_fsdp_checkpoints

pytestmark = pytest.mark.multiproc


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _train(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        loss = nn.functional.mse_loss(model(torch.randn(8, 8, generator=g)), torch.randn(8, 4, generator=g))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": full(get_model_state_dict(model)), "optim": full(get_optimizer_state_dict(model, optimizer))}


def accelerate_job(rank: int, world_size: int, workdir: str, location: str) -> bytes:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)  # a local write of the s3:// path (os.makedirs("s3://...")) would land here
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    originals = [getattr(accelerate.utils, n) for n in ("save_fsdp_model", "load_fsdp_model")]
    model = _model(seed=0)
    optimizer = _train(model)
    saved = _state(model, optimizer)
    with route_fsdp_checkpoints():
        # the names Accelerator.save_state and transformers' Trainer call
        accelerate.accelerator.save_fsdp_model(plugin, accelerator, model, location)
        accelerate.utils.save_fsdp_optimizer(plugin, accelerator, optimizer, model, location)
        fresh = _model(seed=1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        accelerate.accelerator.load_fsdp_model(plugin, accelerator, fresh, location)
        accelerate.accelerator.load_fsdp_optimizer(plugin, accelerator, fresh_optimizer, fresh, location)
        loaded = _state(fresh, fresh_optimizer)
        full_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
        try:
            accelerate.utils.save_fsdp_model(full_plugin, accelerator, model, location)
            refused = ""
        except ConfigError as exc:
            refused = str(exc)
    restored = [getattr(accelerate.utils, n) for n in ("save_fsdp_model", "load_fsdp_model")] == originals
    buf = io.BytesIO()
    torch.save({"saved": saved, "loaded": loaded, "refused": refused, "restored": restored}, buf)
    return buf.getvalue()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_fsdp_utilities_save_and_load_through_s3(bucket: str, tmp_path: Path) -> None:
    location = f"s3://{bucket}/accelerate/checkpoint-2"
    results = [
        torch.load(io.BytesIO(r), weights_only=False)
        for r in run_ranks(accelerate_job, 2, str(tmp_path / "work"), location)
    ]
    # first what is where: Accelerate's own code would save to ./s3:/... and load it back bit-exact
    names = sorted(e.name for e in StorageOptions().store(location).list_objects())
    assert f"pytorch_model_fsdp_0/{METADATA_KEY}" in names and f"optimizer_0/{METADATA_KEY}" in names
    assert {n.split("/")[0] for n in names} == {"pytorch_model_fsdp_0", "optimizer_0"}
    local = [os.path.join(d, n) for d, dirs, files in os.walk(tmp_path) for n in dirs + files]
    assert local == [str(tmp_path / "work")], f"files on local disk: {local}"
    for rank, got in enumerate(results):
        assert _equal(got["saved"], got["loaded"]), f"rank {rank}: loaded state differs from the saved one"
        assert got["saved"]["optim"]["state"], "the optimizer had state to save"
        assert "FULL_STATE_DICT" in got["refused"] and location in got["refused"]
        assert got["restored"], "route_fsdp_checkpoints left Accelerate's functions replaced"


def test_route_binds_every_caller_and_restores_them() -> None:
    import dcp_s3.integrations.accelerate as routing

    names = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
    holders = (accelerate.utils, accelerate.accelerator, accelerate.utils.fsdp_utils)
    before = {(m.__name__, n): getattr(m, n) for m in holders for n in names}
    with route_fsdp_checkpoints({"max_concurrency": 4}) as options:
        assert options == StorageOptions(max_concurrency=4)
        for module in holders:
            for name in names:
                routed = getattr(module, name)
                assert routed is not before[(module.__name__, name)] and routed.__wrapped__ is routing._ORIGINAL[name]
    assert {(m.__name__, n): getattr(m, n) for m in holders for n in names} == before
