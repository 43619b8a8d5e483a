"""The write and commit steps of a Megatron save (:mod:`dcp_s3.integrations.megatron`), as Megatron's ``AsyncRequest``.

Megatron splits a ``torch_dist`` save in three: planning (every rank at once, in the training process), the writes
(``async_fn``, in a worker process for an async save: forked by Megatron's ``TemporalAsyncCaller``, or its
persistent worker, which receives the request pickled) and the finalize step (every rank, in the training process,
once every worker ended). Here the writes are ``S3StorageWriter.write_data`` of this rank's items, resolved to their
tensors and bytes during planning (:class:`RankWrite`); the finalize step gathers every rank's results and commits
``.metadata`` on rank 0 — the one commit point — or raises on every rank, leaving the checkpoint that was at the
path as it was. The worker never touches the process group: its results come back through a manager's queue, one
per save (saves in flight at once never take each other's results). The worker first sends its process id, and it
sends its results before it ends; so a worker that no longer runs and sent none died (killed), which the finalize step
reports at once; a worker still running is waited for until a deadline (:data:`RESULT_WAIT_S`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import time
from queue import Empty
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from dcp_s3._dcp.writer import S3StorageWriter
from dcp_s3.errors import DcpS3Error

__all__ = ["RankWrite", "RESULT_WAIT_S", "write_rank", "to_host", "results_queue", "finalize"]

logger = logging.getLogger(__name__)

#: How long the finalize step waits for this rank's write results while the worker still runs (Megatron finalizes
#: once its worker ended or reported the request done, and the results are sent before that: a wait only means
#: something is wrong). A worker that ended without sending them died: that is reported at once, not waited for.
RESULT_WAIT_S = 10.0
#: How often the finalize step looks whether the worker still runs while it waits.
_POLL_S = 0.2


class RankWrite:
    """What ``save_state_dict_async_plan`` needs of a storage writer, over an ``S3StorageWriter``.

    Planning calls ``set_up_storage_writer`` / ``prepare_local_plan`` / ``prepare_global_plan`` (the writer's own,
    collectively: rank 0 checks the bucket and names every rank's objects), then ``prepare_write_data``, which
    resolves this rank's items to their tensors and bytes (in the training process, as Megatron's own writer
    does) so that the worker writes them without the planner or the process group."""

    def __init__(self, writer: S3StorageWriter) -> None:
        self.writer = writer
        self.plan: SavePlan | None = None
        self.resolved: dict[MetadataIndex, Any] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.writer.set_up_storage_writer(is_coordinator, *args, rank=dist.get_rank(), **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.writer.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.writer.prepare_global_plan(plans)

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        # The worker may be a process of its own: it must not count itself in the process group's store (the
        # connection is the training process's), so its plan carries no JobCount (rate hand-off only).
        storage = plan.storage_data
        if dataclasses.is_dataclass(storage) and not isinstance(storage, type) and hasattr(storage, "count"):
            plan = dataclasses.replace(plan, storage_data=dataclasses.replace(storage, count=None))
        self.plan = plan
        self.resolved = {item.index: _resolved(item, planner) for item in plan.items}


def _resolved(item: WriteItem, planner: SavePlanner) -> Any:
    data = planner.resolve_data(item)
    return data.detach() if isinstance(data, torch.Tensor) else data


def to_host(resolved: dict[MetadataIndex, Any]) -> dict[MetadataIndex, Any]:
    """Megatron's ``preload_fn`` for an async save: host copies of the tensors, so that training may go on
    changing its own (and the worker, a process of its own, never touches an accelerator)."""
    return {k: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in resolved.items()}


class _Resolved:
    """The one planner call the writer makes (``resolve_data``), answered from the resolved items."""

    def __init__(self, resolved: dict[MetadataIndex, Any]) -> None:
        self.resolved = resolved

    def resolve_data(self, item: WriteItem) -> Any:
        return self.resolved[item.index]


def write_rank(write: RankWrite, resolved: dict[MetadataIndex, Any], results: Any) -> None:
    """The ``async_fn`` (in the worker process for an async save): write this rank's objects, report the results."""
    try:
        results.put(("worker", os.getpid()))  # first: the finalize step can tell a dead worker from a slow one
        assert write.plan is not None, "prepare_write_data ran before the write"
        written = write.writer.write_data(write.plan, cast(SavePlanner, _Resolved(resolved))).wait()
        results.put(("ok", written))
    except BaseException as exc:  # reported, and raised on every rank by the finalize step
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@functools.cache
def _manager() -> Any:
    return multiprocessing.get_context("spawn").Manager()


def results_queue() -> Any:
    """A queue the worker of an async save can reach however it was started (forked, or Megatron's persistent
    worker, which receives the request pickled): a manager's, as Megatron's own writer uses (one manager per
    process), and one queue per save, so that saves in flight at once never take each other's results."""
    return _manager().Queue()


def _outcome(results: Any) -> tuple[str, Any]:
    """This rank's ``("ok", write results)`` or ``("error", why)``: at once from a worker that died without sending
    them, by :data:`RESULT_WAIT_S` from one still running."""
    deadline = time.monotonic() + RESULT_WAIT_S
    worker: int | None = None
    while True:
        try:
            kind, detail = results.get(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
        except Empty:
            if worker is not None and not _running(worker):
                try:  # what it sent just before it ended
                    kind, detail = results.get(timeout=0)
                except Empty:
                    return "error", f"its write worker (process {worker}) died without reporting (killed?)"
            elif time.monotonic() < deadline:
                continue
            else:
                running = "never reported" if worker is None else f"process {worker}, still running"
                return "error", f"no write results within RESULT_WAIT_S = {RESULT_WAIT_S} s (its worker: {running})"
        if kind != "worker":
            return kind, detail
        worker = detail


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (one that ended, reaped or not, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"  # Z: ended, not yet reaped
    except (OSError, IndexError):
        return True  # no /proc: it runs as far as can be told


def finalize(write: RankWrite, metadata: Metadata | None, results: Any) -> None:
    """Every rank: gather the write results on rank 0, which commits ``.metadata`` unless a rank failed; a failure
    is raised on every rank (and the checkpoint that was at the path is still the one there)."""
    location = write.writer.checkpoint_id
    outcome = _outcome(results)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(outcome, gathered, dst=0)
    verdict: list[str | None] = [None]
    if gathered is not None:
        failed = {r: detail for r, (kind, detail) in enumerate(gathered) if kind != "ok"}
        if failed:
            verdict[0] = "; ".join(f"rank {r}: {d}" for r, d in sorted(failed.items()))
        else:
            try:
                assert metadata is not None, "rank 0 plans the checkpoint's metadata"
                write.writer.finish(metadata, [written for _, written in gathered])
            except Exception as exc:
                verdict[0] = f"commit on rank 0: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise DcpS3Error(f"Megatron save to {location} failed, nothing committed ({verdict[0]})")
    logger.debug("Megatron checkpoint %s committed", location)
