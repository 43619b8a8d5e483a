"""Rank coordination for the checkpoint manager: run on rank 0 and share the outcome.

Rank 0 alone lists, reads markers and deletes; every other rank gets rank 0's result, or its
(picklable) error, so all ranks agree on what to load and fail the same way. Small objects
travel over a CPU group (the default one if it has a CPU backend, else a gloo group made once);
``async_save`` gets a gloo group per part so concurrent parts never interleave collectives.
Without ``torch.distributed`` initialized everything runs locally as rank 0.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from dcp_s3._torch_compat import default_group_has_cpu
from dcp_s3.errors import DcpS3Error

__all__ = ["Ranks", "distributed", "rank", "world_size", "picklable"]

T = TypeVar("T")


def distributed() -> bool:
    """Whether ``torch.distributed`` is initialized (else this process is the only rank)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def picklable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling, else a ``DcpS3Error`` carrying its type name and message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return DcpS3Error(f"on rank 0: {type(error).__name__}: {error}")


class Ranks:
    """The process groups one checkpoint manager uses, created lazily and reused."""

    def __init__(self) -> None:
        self._control: Any = None
        self._control_ready = False
        self._groups: dict[str, Any] = {}

    def control_group(self) -> Any:
        """The group for small object collectives: the default one if it has a CPU backend, else gloo."""
        if not self._control_ready:
            if not default_group_has_cpu():
                self._control = dist.new_group(backend="gloo")
            self._control_ready = True
        return self._control

    def group_for(self, part: str) -> Any:
        """A gloo group per part name for ``async_save`` (concurrent saves must not share a group)."""
        if not distributed():
            return None
        key = part.split(".", 1)[1] if "." in part else part
        if key not in self._groups:
            self._groups[key] = dist.new_group(backend="gloo")
        return self._groups[key]

    def run_on_rank0(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and hand its result, or its error, to every rank."""
        result: Any = None
        error: BaseException | None = None
        if rank() == 0:
            try:
                result = fn()
            except Exception as exc:
                error = exc
        if distributed():
            box = [(result, picklable(error))]
            dist.broadcast_object_list(box, src=0, group=self.control_group())
            result, error = box[0]
        if error is not None:
            raise error
        return result  # type: ignore[no-any-return]
