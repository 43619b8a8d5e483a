"""NeMo AutoModel 0.7.0's ``is_async`` on a GPU, and its sync path with CUDA tensors, through
:mod:`dcp_s3.integrations.nemo_automodel` (a part of :mod:`benchmarks.gpu_frameworks`).

What ``is_async`` does in NeMo (``Checkpointer.__init__`` / ``_do_save``): a ``DefaultStager()`` per DCP part (pinned,
shared memory, staging on a side stream: it asserts on a CPU-only host), a gloo group with the checkpoint group's
ranks, ``dcp.async_save(..., async_checkpointer_type=PROCESS)``; the recipe then calls
``lifecycle.defer_publication`` and, before the next save, ``async_wait()`` and ``lifecycle.complete_pending()``.
The integration accepts ``is_async`` on ``s3://`` and takes that route itself (``S3Checkpointer._do_save``), its
commit waiting for every rank's upload; on a CUDA FSDP2 model and AdamW this records, against moto's server:

1. ``S3CheckpointingConfig(is_async=True)`` on ``s3://`` accepted when the config is made;
2. a sync save and resume through ``S3Checkpointer`` (CUDA DTensors: the pinned staging path of the writer), bit-exact;
3. NeMo's async save exactly as ``Checkpointer._do_save`` makes it, driven by hand, with the DCP writer
   ``S3Checkpointer`` passes (``_s3.part_writer``) and the commit ``S3CheckpointLifecycle.publish`` writes, after
   the upload completed; the weights change once staging completed; the resume must return the values of the
   save, bit-exact;
4. the supported path: ``is_async=True`` through ``S3Checkpointer`` as NeMo's recipes call it (``defer_publication``,
   ``maybe_wait_for_staging`` before the optimizer step, ``async_wait`` and ``complete_pending``), with NeMo's own
   ``DefaultStager()`` defaults on CUDA (pinned, shared memory, a side stream); no commit before
   ``complete_pending``, one after it, and the resume returns the values of the save, bit-exact.

``--cpu-smoke``: all four, 3 with ``StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)`` (the
defaults assert without an accelerator), 4 with the stagers the integration builds there (the same options).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import nemo_automodel
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from nemo_automodel.components.checkpoint.checkpointing import _ModelSavePlanner, _OptimizerSavePlanner
from nemo_automodel.components.checkpoint.stateful_wrappers import ModelState, OptimizerState
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from benchmarks.gpu_fw_common import Record, Target, init_group, s3_target, same_state
from dcp_s3._dcp import open_store
from dcp_s3.errors import ConfigError
from dcp_s3.integrations.nemo_automodel import COMMIT, S3Checkpointer, S3CheckpointingConfig

WAIT_S = 120  # the deadline of each wait on an async save's futures
SYNC = "sync save + resume through S3Checkpointer, bit-exact"
ROUTE = "is_async as NeMo's _do_save makes it (DefaultStager, PROCESS) with S3Checkpointer's writer, bit-exact"
SUPPORTED = "is_async=True through S3Checkpointer as NeMo's recipes call it, committed after the upload, bit-exact"


def _parts(device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model on a 1-rank mesh of ``device`` and AdamW, after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    mesh = init_device_mesh(device.type, (1,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, device)
    return model, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    x = torch.randn(16, 64, device=device)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_full(v) for v in value]
    return value


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": _full(model.state_dict()), "optim": _full(optimizer.state_dict())}


def _checkpointer(target: Target, **config: Any) -> S3Checkpointer:
    made = S3CheckpointingConfig(checkpoint_dir=f"{target.root}/run", storage_options=target.options, **config)
    return made.build(dp_rank=0, tp_rank=0, pp_rank=0)


def _resumed(target: Target, path: str, device: torch.device) -> tuple[dict[str, Any], str]:
    """A fresh model and optimizer (other weights) loaded from ``path`` as NeMo's recipe loads; (snapshot, device)."""
    model, optimizer = _parts(device, seed=999)
    ckpt = _checkpointer(target)
    try:
        ckpt.load_model(model, os.path.join(path, "model"))
        ckpt.load_optimizer(optimizer, model, path)
    finally:
        ckpt.close()
    return _snapshot(model, optimizer), str(next(model.parameters()).device)


def _accepted(rec: Record) -> None:
    with rec.check("is_async on s3://: accepted when the config is made") as out:
        try:
            S3CheckpointingConfig(checkpoint_dir="s3://bucket/run", is_async=True)
        except ConfigError as exc:
            out["ok"], out["note"] = False, f"refused: {exc}"
            return
        out["note"] = "S3CheckpointingConfig(checkpoint_dir='s3://bucket/run', is_async=True)"


def _sync(rec: Record, target: Target, device: torch.device) -> None:
    with rec.check(SYNC) as out:
        model, optimizer = _parts(device, seed=1)
        ckpt = _checkpointer(target)
        path = f"{target.root}/run/epoch_0_step_1"
        t0 = time.perf_counter()
        try:
            ckpt.lifecycle.reserve(path)
            ckpt.save_model(model, path)
            ckpt.save_optimizer(optimizer, model, path)
            ckpt.lifecycle.publish(path, best_val_metric=None, metric_key=None)
        finally:
            ckpt.close()
        saved_s = time.perf_counter() - t0
        got, where = _resumed(target, path, device)
        out["ok"] = same_state(got, _snapshot(model, optimizer))
        out["note"] = f"save {saved_s:.2f} s; resumed onto {where}"


def _async_route(rec: Record, target: Target, device: torch.device, cuda: bool) -> None:
    with rec.check(ROUTE) as out:
        model, optimizer = _parts(device, seed=2)
        want = _snapshot(model, optimizer)
        ckpt = _checkpointer(target)  # is_async=False: this drives NeMo's async route by hand
        path = f"{target.root}/run/epoch_0_step_2"
        group = dist.new_group(backend="gloo")  # NeMo's _new_gloo_process_group(None)
        options = StagingOptions() if cuda else StagingOptions(False, True, True, False)
        stagers: list[DefaultStager] = []
        try:
            ckpt.lifecycle.reserve(path)
            t0 = time.perf_counter()
            responses = []
            for part, state, planner in (
                ("model", ModelState(model).state_dict(), _ModelSavePlanner),
                ("optim", OptimizerState(model, optimizer).state_dict(), _OptimizerSavePlanner),
            ):
                stagers.append(DefaultStager(options))
                responses.append(
                    dcp.async_save(
                        state,
                        storage_writer=ckpt._s3.part_writer(path, part),  # what S3Checkpointer._do_save passes
                        planner=planner(ckpt._planner_cache_namespace),
                        process_group=group,
                        async_stager=stagers[-1],
                        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    )
                )
            returned_s = time.perf_counter() - t0
            for response in responses:  # NeMo's maybe_wait_for_staging
                response.staging_completion.result(WAIT_S)
            staged_s = time.perf_counter() - t0
            _step(model, optimizer, device)  # training goes on while the upload runs
            for response in responses:  # NeMo's async_wait
                response.upload_completion.result(WAIT_S)
            uploaded_s = time.perf_counter() - t0
            ckpt.lifecycle.publish(path, best_val_metric=None, metric_key=None)  # the S3 commit, after the upload
        finally:
            for stager in stagers:
                stager.close()
            ckpt.close()
            dist.destroy_process_group(group)
        got, where = _resumed(target, path, device)
        out["ok"] = same_state(got, want)
        out["note"] = (
            f"async_save returned after {returned_s:.2f} s, staged after {staged_s:.2f} s, uploaded after "
            f"{uploaded_s:.2f} s ({'default StagingOptions' if cuda else 'StagingOptions(False, True, True, False)'}); "
            f"resumed onto {where}"
        )


def _supported(rec: Record, target: Target, device: torch.device, cuda: bool) -> None:
    with rec.check(SUPPORTED) as out:
        model, optimizer = _parts(device, seed=3)
        ckpt = _checkpointer(target, is_async=True, async_upload_timeout_s=WAIT_S)
        path = f"{target.root}/run/epoch_0_step_3"
        store = open_store(path, **target.options)
        try:
            t0 = time.perf_counter()
            ckpt.async_wait()  # BaseRecipe.save_checkpoint's order
            ckpt.lifecycle.complete_pending()
            ckpt.lifecycle.reserve(path)
            ckpt.save_model(model, path)
            ckpt.save_optimizer(optimizer, model, path)
            ckpt.lifecycle.defer_publication(path, best_val_metric=None, metric_key=None)
            returned_s = time.perf_counter() - t0
            want = _snapshot(model, optimizer)
            early = store.size(COMMIT) is not None
            ckpt.maybe_wait_for_staging()  # train_ft, before optimizer.step()
            _step(model, optimizer, device)  # training goes on while the upload runs
            ckpt.async_wait()
            ckpt.lifecycle.complete_pending()  # the S3 commit, after every rank's upload
            done_s = time.perf_counter() - t0
        finally:
            ckpt.close()
        committed = store.size(COMMIT) is not None
        got, where = _resumed(target, path, device)
        out["ok"] = same_state(got, want) and committed and not early
        out["note"] = (
            f"saves returned after {returned_s:.2f} s, committed after {done_s:.2f} s "
            f"({'NeMo default StagingOptions' if cuda else 'StagingOptions(False, True, True, False)'}); commit before "
            f"complete_pending: {early}, after: {committed}; resumed onto {where}"
        )


def run(rec: Record, root: Path, cuda: bool, mib: float) -> None:
    del mib  # the model is small: the question is the route, not the rate
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rec.fact("nemo-automodel", getattr(nemo_automodel, "__version__", "?"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint process finds its store there
    _accepted(rec)
    init_group(root, cuda, "cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        with s3_target() as target:
            if target is None:
                for check in (SYNC, ROUTE, SUPPORTED):
                    rec.skip(
                        check, "no S3 server: moto neither travelled (benchmarks/gpu_wheels/moto) nor is importable"
                    )
                return
            rec.fact("target", "moto server (S3Checkpointer routes only s3:// through dcp_s3)")
            _sync(rec, target, device)
            _async_route(rec, target, device, cuda)
            _supported(rec, target, device, cuda)
    finally:
        dist.destroy_process_group()
