"""Sharing what one rank read from S3 with the other ranks of a process group.

Two uses, both in ``S3StorageReader``:

* ``.metadata`` is read by one rank of the ``dcp.load`` and broadcast to the others
  (``share_metadata``), instead of every rank GETting and holding the same object;
* replicas (HSDP replicate groups, or every rank loading the whole model) each read a
  share of their common plan and broadcast it to the others (``replica_group``, see
  ``dcp_s3._dcp.replicated``).

A broadcast on a group that not every rank of the job enters hangs. torch's
``StorageReader.read_metadata`` is not told which group ``dcp.load`` runs on, so
``running_dcp_group`` finds it in the running DCP call itself (the ``_DistWrapper``
that ``dcp.load`` built from its ``process_group``), and the reader shares only over
that exact group; when it cannot be found (``read_metadata`` called outside
``dcp.load``, or a torch release that builds the call differently), every rank reads
for itself, which is always safe.

Collectives run on the group's CPU device when it has one (gloo, or a
``cpu:gloo,cuda:nccl`` group) and on the current CUDA device otherwise (NCCL), so the
same code serves both; tensors are staged between the two as needed.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as _dcp

from dcp_s3._torch_compat import dist_wrapper_class, group_device_types
from dcp_s3.errors import ConfigError, DcpS3Error

__all__ = [
    "running_dcp_group",
    "DcpGroup",
    "collective_device",
    "broadcast_bytes",
    "same_group",
    "group_ranks",
    "check_explicit_group",
    "metadata_source",
    "error_payload",
]

log = logging.getLogger(__name__)

_DCP_DIR = os.path.dirname(os.path.abspath(_dcp.__file__)) + os.sep
_MAX_FRAMES = 16


class DcpGroup:
    """The process group a running ``dcp.load`` uses: ``group`` (None = the default group) and
    the global rank of its coordinator."""

    def __init__(self, group: dist.ProcessGroup | None, coordinator: int) -> None:
        self.group = group
        self.coordinator = coordinator

    def __repr__(self) -> str:
        return f"DcpGroup(ranks={group_ranks(self.group)}, coordinator={self.coordinator})"


def running_dcp_group() -> DcpGroup | None:
    """The group of the ``dcp.load``/``dcp.save`` this call runs inside, or None if there is none
    (or the job is not distributed, or ``no_dist=True``).

    Looks at the frames of torch's ``torch.distributed.checkpoint`` package on the call stack
    (never at user frames) for the ``_DistWrapper`` the call built from its ``process_group``.
    """
    wrapper = dist_wrapper_class()
    if wrapper is None:  # a torch release without it: no detection, no sharing
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if frame.f_code.co_filename.startswith(_DCP_DIR):
            for value in frame.f_locals.values():
                if isinstance(value, wrapper):
                    if not value.use_dist or not dist.is_initialized():
                        return None
                    return DcpGroup(value.group, int(value.global_coordinator_rank))
        frame = frame.f_back
    return None


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (None = the default group), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """Whether two groups have the same members in the same order (a local check, no collective)."""
    return a is b or group_ranks(a) == group_ranks(b)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device tensors must be on for collectives of ``group``: CPU when the group has a
    CPU backend (gloo), else the current CUDA device (NCCL)."""
    types = group_device_types(group if group is not None else dist.group.WORLD)
    if types is None:
        types = ["cuda"] if str(dist.get_backend(group)) == "nccl" else ["cpu"]
    if "cpu" in types or not types:
        return torch.device("cpu")
    if "cuda" in types:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


def error_payload(exc: BaseException) -> bytes:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # an exception that pickles but cannot be rebuilt would fail on the receivers
        return data
    except Exception:
        return pickle.dumps(DcpS3Error(f"{type(exc).__name__}: {exc}"))


def broadcast_bytes(produce: Callable[[], bytes], src: int, group: dist.ProcessGroup | None, what: str) -> bytes:
    """``produce()`` on global rank ``src``, its bytes (or its exception) on every rank of ``group``.

    Every rank of ``group`` must call this with the same ``src``. If ``produce`` raises on
    ``src``, the same exception (pickled; a ``DcpS3Error`` carrying its text if it does not
    pickle) is raised on every rank, so no rank is left waiting. ``what`` names the payload
    in errors.
    """
    device = collective_device(group)
    if dist.get_rank() == src:
        try:
            payload, status = produce(), 0
        except Exception as exc:
            payload, status = error_payload(exc), 1
            error: BaseException | None = exc
        else:
            error = None
        head = torch.tensor([status, len(payload)], dtype=torch.int64, device=device)
        dist.broadcast(head, src=src, group=group)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        dist.broadcast(body.to(device), src=src, group=group)
        if error is not None:
            raise error
        return payload
    head = torch.empty(2, dtype=torch.int64, device=device)
    dist.broadcast(head, src=src, group=group)
    status, length = (int(x) for x in head.tolist())
    body = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(body, src=src, group=group)
    data = body.cpu().numpy().tobytes()
    if status == 0:
        return data
    try:
        error = pickle.loads(data)  # from a rank of this job, which pickled its own exception
    except Exception as unpickle_error:
        raise DcpS3Error(f"rank {src} failed to read {what}; its error could not be unpickled") from unpickle_error
    if not isinstance(error, BaseException):
        raise DcpS3Error(f"rank {src} failed to read {what}")
    raise error


def check_explicit_group(explicit: dist.ProcessGroup | None, running: DcpGroup | None, option: str) -> None:
    """``ConfigError`` when ``option`` names a group other than the running dcp.load's (a sure hang)."""
    if running is not None and not same_group(explicit, running.group):
        raise ConfigError(
            f"{option}: the process group passed (global ranks {group_ranks(explicit)}) is not the one "
            f"dcp.load runs on (global ranks {group_ranks(running.group)}); pass dcp.load's process_group, "
            "or share_metadata=True to use it automatically"
        )


def metadata_source(share: bool | dist.ProcessGroup) -> tuple[dist.ProcessGroup | None, int] | None:
    """(group, global rank that reads) for ``S3StorageReader(share_metadata=share)``, or None: every rank reads."""
    if share is False:
        return None
    running = running_dcp_group()
    if isinstance(share, dist.ProcessGroup):
        check_explicit_group(share, running, "share_metadata")
        if running is None:
            return share, group_ranks(share)[0]
    if running is None:
        return None
    return running.group, running.coordinator
