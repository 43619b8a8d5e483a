"""NeMo AutoModel 0.7.0's ``is_async`` on a GPU, and its sync path with CUDA tensors, through
:mod:`dcp_s3.integrations.nemo_automodel` (a part of :mod:`benchmarks.gpu_frameworks`).

What ``is_async`` does in NeMo (``Checkpointer.__init__`` / ``_do_save``): a ``DefaultStager()`` per DCP part (pinned,
shared memory, staging on a side stream: it asserts on a CPU-only host), a gloo group with the checkpoint group's
ranks, ``dcp.async_save(..., async_checkpointer_type=PROCESS)``; the recipe then calls
``lifecycle.defer_publication`` and, before the next save, ``async_wait()`` and ``lifecycle.complete_pending()``.
The integration refuses ``is_async`` on ``s3://`` (``S3CheckpointingConfig.__post_init__``, a ``ConfigError``), and
this check does not change that; on a CUDA FSDP2 model and AdamW it records, against moto's server:

1. the refusal, as a user meets it;
2. a sync save and resume through ``S3Checkpointer`` (CUDA DTensors: the pinned staging path of the writer), bit-exact;
3. NeMo's async save exactly as ``Checkpointer._do_save`` makes it, with the DCP writer ``S3Checkpointer`` would pass
   (``_s3.part_writer``) and the commit ``S3CheckpointLifecycle.publish`` writes, after the upload completed; the
   weights change once staging completed; the resume must return the values of the save, bit-exact — the route
   the integration would take if it accepted ``is_async``;
4. what the released integration does if the refusal is bypassed (``config.is_async = True`` after the config is
   made): NeMo builds its stagers and groups, ``S3Checkpointer._do_save`` saves synchronously (no future), and the
   recipe's ``complete_pending`` runs NeMo's file-system publication on the ``s3://`` path, not the S3 commit.

``--cpu-smoke``: 1 and 2 as on a GPU, 3 with ``StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)``
(the defaults assert without an accelerator), 4 skipped (NeMo's own ``DefaultStager()`` asserts).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
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
from dcp_s3.errors import ConfigError
from dcp_s3.integrations.nemo_automodel import COMMIT, S3Checkpointer, S3CheckpointingConfig
from dcp_s3.store import open_store

WAIT_S = 120  # the deadline of each wait on an async save's futures
SYNC = "sync save + resume through S3Checkpointer, bit-exact"
ROUTE = "is_async as NeMo's _do_save makes it (DefaultStager, PROCESS) with S3Checkpointer's writer, bit-exact"
BYPASSED = "the released integration if the refusal is bypassed (config.is_async=True afterwards)"


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


@contextlib.contextmanager
def _cwd(path: str) -> Iterator[None]:
    """In ``path`` while the block runs (NeMo's file-system publication writes relative to the working directory)."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _refused(rec: Record) -> None:
    with rec.check("is_async on s3:// today: refused when the config is made") as out:
        try:
            S3CheckpointingConfig(checkpoint_dir="s3://bucket/run", is_async=True)
        except ConfigError as exc:
            out["note"] = f"ConfigError from S3CheckpointingConfig.__post_init__ (nemo_automodel.py): {exc}"
            return
        out["ok"], out["note"] = False, "no ConfigError: the integration now accepts is_async"


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
        ckpt = _checkpointer(target)  # is_async=False: the refusal stands; this drives what NeMo would do
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


def _bypassed(rec: Record, target: Target, device: torch.device) -> None:
    with rec.check(BYPASSED) as out:
        model, optimizer = _parts(device, seed=3)
        config = S3CheckpointingConfig(checkpoint_dir=f"{target.root}/run", storage_options=target.options)
        config.is_async = True
        path = f"{target.root}/run/epoch_0_step_3"
        cwd = tempfile.mkdtemp()
        seen: list[str] = []
        with _cwd(cwd):
            ckpt = config.build(dp_rank=0, tp_rank=0, pp_rank=0)
            try:
                seen.append(f"stagers built: {type(ckpt._model_ctx.stager).__name__}")
                ckpt.lifecycle.reserve(path)
                ckpt.save_model(model, path)
                ckpt.save_optimizer(optimizer, model, path)
                seen.append(f"save_model future: {ckpt._model_ctx.future!r} (synchronous)")
                ckpt.lifecycle.defer_publication(path, best_val_metric=None, metric_key=None)  # the recipe's async path
                ckpt.async_wait()
                try:
                    ckpt.lifecycle.complete_pending()
                    seen.append("complete_pending: returned")
                except Exception as exc:
                    cause = exc.__cause__ or exc.__context__
                    why = f" (cause: {type(cause).__name__}: {str(cause)[:200]})" if cause is not None else ""
                    seen.append(f"complete_pending: {type(exc).__name__}: {str(exc)[:200]}{why}")
            finally:
                ckpt.close()
            local = [str(p.relative_to(cwd)) for p in Path(cwd).rglob("*")]
        committed = open_store(path, **target.options).size(COMMIT) is not None
        seen += [f"S3 commit written: {committed}", f"local files made: {local[:5] or 'none'}"]
        out["note"] = "; ".join(seen)


def run(rec: Record, root: Path, cuda: bool, mib: float) -> None:
    del mib  # the model is small: the question is the route, not the rate
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rec.fact("nemo-automodel", getattr(nemo_automodel, "__version__", "?"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint process finds its store there
    _refused(rec)
    init_group(root, cuda, "cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        with s3_target() as target:
            if target is None:
                for check in (SYNC, ROUTE, BYPASSED):
                    rec.skip(
                        check, "no S3 server: moto neither travelled (benchmarks/gpu_wheels/moto) nor is importable"
                    )
                return
            rec.fact("target", "moto server (S3Checkpointer routes only s3:// through dcp_s3)")
            _sync(rec, target, device)
            _async_route(rec, target, device, cuda)
            if cuda:
                _bypassed(rec, target, device)
            else:
                rec.skip(
                    BYPASSED,
                    "needs CUDA: NeMo's Checkpointer builds DefaultStager() for is_async, which asserts on CPU-only hosts",
                )
    finally:
        dist.destroy_process_group()
