"""torch-checkpointing 0.1.1's resharding load on a GPU through dcp_s3's ``S3Storage`` (a part of
:mod:`benchmarks.gpu_frameworks`).

Its ``DefaultResharder`` (``ItemSpec(resharder=...)``, what a load on another number of ranks needs) gathers every
rank's metadata with tensors on ``device="cuda"`` (``metadata_manager._all_gather_pickled_data``), so it cannot run on
CPU. One GPU allows one NCCL rank; gloo ranks can hold CUDA tensors on it. Each check saves an FSDP2-sharded model
(seeded weights) through ``CheckpointManager`` with ``S3StorageConfig`` and loads it on another number of ranks into a
model of other weights; every rank compares its shards with the seeded model's, bit for bit:

- 2 gloo ranks (CUDA tensors), sync saver -> 1 NCCL rank, on the local directory, and on moto's server when it is here;
- 1 NCCL rank, the async saver with its default (pinned, non-blocking) staging and its writer process -> 2 gloo ranks.

``--cpu-smoke`` runs the same saves and loads on CPU without the resharder (loads on the ranks that saved: 2 -> 2,
1 -> 1) and records the resharding itself as skipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch_checkpointing.checkpoint_manager import CheckpointManager
from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.schema import ItemSpec
from torch_checkpointing.staging import CheckpointStagerConfig

from benchmarks.gpu_fw_common import GROUP_TIMEOUT, Record, init_group, s3_target, same_bytes
from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

WAIT_S = 60  # the deadline of an async save's future, and of torch_checkpointing's write barrier
#: The deadline of one phase's spawned ranks: on a GPU within the part's own; a shared CPU machine starts them slowly.
PHASE_S = {True: WAIT_S + 20, False: 240}
SAVED_SEED, OTHER_SEED, STEP = 7, 999, 7


def _model(seed: int, device: torch.device, world: int) -> nn.Module:
    torch.manual_seed(seed)  # built on CPU: the same weights on every rank and in every process
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16)).to(device)
    fully_shard(model, mesh=init_device_mesh(device.type, (world,)))
    return model


def _manager(root: str, options: dict[str, Any] | None, reshard: bool, saver: str, cuda: bool) -> CheckpointManager:
    writer = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=WAIT_S)  # a failed rank ends the others' wait
    if saver == "sync":
        save: Any = SyncCheckpointSaverConfig(writer_config=writer)
    else:  # on a GPU the defaults: pinned memory, non-blocking copies
        staging = (
            CheckpointStagerConfig()
            if cuda
            else CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
        )
        save = AsyncCheckpointSaverConfig(writer_config=writer, staging_config=staging)
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder()) if reshard else ItemSpec()},
            save=save,
            storage_config=S3StorageConfig(root, options=options),
        )
    )


def act(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank's save or load of ``job`` (the process group is up): ``{"ok": ..., "note": ...}``."""
    cuda = job["cuda"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    manager = _manager(job["root"], job["options"], job["reshard"], job["saver"], cuda)
    try:
        if job["action"] == "save":
            model = _model(SAVED_SEED, device, world)
            future = manager.save(job["path"], {"model": model.state_dict(), "step": STEP})
            if future is not None:
                future.result(timeout=WAIT_S)
            return {"ok": True}
        model = _model(OTHER_SEED, device, world)  # other weights: the load must overwrite every element
        # "step" has no resharder: torch_checkpointing 0.1.1 reads it from step_<rank>.pt, whatever the storage
        # ("Nothing is probed", checkpoint_reader.py), so a load on more ranks than saved asks for the model only.
        into = {"model": model.state_dict()} | ({"step": 0} if job["with_step"] else {})
        loaded = manager.load(job["path"], into=into)
        model.load_state_dict(loaded["model"])
    finally:
        manager.close()
    torch.manual_seed(SAVED_SEED)
    want = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16)).state_dict()
    got = model.state_dict()
    ok = (not job["with_step"] or loaded["step"] == STEP) and got.keys() == want.keys()
    for key, value in got.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        ok = ok and same_bytes(local, torch.chunk(want[key], world, dim=0)[rank])  # FSDP2 shards dim 0 so
    asked = "" if job["with_step"] else " (model only: a load on more ranks than saved)"
    return {"ok": bool(ok), "note": f"rank {rank}: shards on {next(iter(got.values())).device}{asked}"}


def _spawned(rank: int, world: int, job: dict[str, Any], rendezvous: str, out: str) -> None:
    if job["cuda"]:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=GROUP_TIMEOUT
    )
    result: dict[str, Any] = {"ok": False, "note": f"rank {rank}: no result"}
    try:
        result = act(rank, world, job)
    except BaseException as exc:  # noqa: BLE001 - reported to the part
        result = {"ok": False, "note": f"rank {rank}: {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def _phase(world: int, job: dict[str, Any], scratch: Path) -> list[dict[str, Any]]:
    """``job`` on this process (1 rank, the part's group) or on ``world`` spawned gloo ranks, with a deadline."""
    if world == 1:
        return [act(0, 1, job)]
    out = Path(tempfile.mkdtemp(dir=scratch))
    ctx = mp.start_processes(
        _spawned, args=(world, job, str(out / "pg"), str(out)), nprocs=world, join=False, start_method="spawn"
    )
    limit = PHASE_S[bool(job["cuda"])]
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} ranks did not finish {job['action']} within {limit} s")
    return [json.loads((out / f"rank{r}.json").read_text() or "{}") for r in range(world)]


def _scenario(
    rec: Record, name: str, scratch: Path, where: tuple[str, dict[str, Any] | None], plan: dict[str, Any]
) -> None:
    with rec.check(name) as out:
        root, options = where
        job = {"root": root, "options": options, "cuda": plan["cuda"], "reshard": plan["reshard"]}
        path = f"{root}/step_{plan['step']}"
        t0 = time.perf_counter()
        saved = _phase(plan["save_world"], {**job, "action": "save", "path": path, "saver": plan["saver"]}, scratch)
        saved_s = time.perf_counter() - t0
        with_step = plan["load_world"] <= plan["save_world"]
        load = {**job, "action": "load", "path": path, "saver": "sync", "with_step": with_step}
        loaded = _phase(plan["load_world"], load, scratch)
        rows = saved + loaded
        out["ok"] = bool(rows) and all(r.get("ok") for r in rows)
        notes = [r["note"] for r in rows if r.get("note")]
        out["note"] = f"save {saved_s:.2f} s, load {time.perf_counter() - t0 - saved_s:.2f} s; " + "; ".join(notes)


def run(rec: Record, root: Path, cuda: bool, mib: float) -> None:
    del mib  # a small model: the question is the resharding route
    rec.fact("torch-checkpointing", importlib.metadata.version("torch-checkpointing"))
    init_group(root, cuda, "nccl" if cuda else "gloo")
    local = ("local directory", str(root / "torch_checkpointing"), None)
    try:
        with s3_target() as target:
            # Both scenarios on S3 (moto) when it is here, else on the local directory; then a sync one on the
            # local directory too (dcp_s3's local store: the same Storage code, another object store).
            s3 = local if target is None else ("moto", f"{target.root}/run", target.options)
            if cuda:
                first = ("resharding load: 2 gloo ranks (CUDA tensors) -> 1 NCCL rank", 2, 1, "sync")
                second = (
                    "resharding load: 1 NCCL rank, async saver (pinned staging) -> 2 gloo ranks (CUDA)",
                    1,
                    2,
                    "async",
                )
                last = ("resharding load: 2 gloo ranks (CUDA tensors) -> 1 NCCL rank", 2, 1, "sync")
            else:  # the ranks that saved load (no resharder); the local directory's check in this process
                rec.skip(
                    "resharding load (DefaultResharder)",
                    "needs CUDA: torch-checkpointing 0.1.1 gathers metadata on device='cuda'",
                )
                first = ("save + load, no resharder: 2 gloo ranks -> the same 2", 2, 2, "sync")
                second = ("save + load, no resharder: 1 rank, async saver -> 1", 1, 1, "async")
                last = ("save + load, no resharder: 1 rank -> 1", 1, 1, "sync")
            scenarios = [(first, s3), (second, s3)] + ([(last, local)] if s3 is not local else [])
            for step, ((name, save_world, load_world, saver), where) in enumerate(scenarios, start=1):
                plan = {"cuda": cuda, "reshard": cuda, "save_world": save_world, "load_world": load_world}
                _scenario(rec, f"{name}, {where[0]}", root, where[1:], {**plan, "saver": saver, "step": step})
    finally:
        dist.destroy_process_group()
