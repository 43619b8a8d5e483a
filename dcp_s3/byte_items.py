"""Byte items (non-tensor values) are checked before any planner sees them.

DCP stores every non-tensor value (optimizer ``param_groups``, extra state, plain ints
and strings) as a ``torch.save`` archive, and torch's ``DefaultLoadPlanner.load_bytes``
reads it back with ``torch.load(..., weights_only=False)``: a pickled ``__reduce__``
would run. The readers therefore refuse, before calling ``planner.load_bytes``, any
byte item that weights-only loading would refuse, whatever planner is used — checked
without running it (see ``dcp_s3.weights_only``). ``allow_unsafe_byte_items=True`` on
the reader skips the check for checkpoints you trust.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .errors import CheckpointFormatError
from .weights_only import byte_item_problem

__all__ = ["byte_item_problem", "check_byte_item", "CheckedFileSystemReader", "UNSAFE_HINT"]

UNSAFE_HINT = (
    "if you trust this checkpoint, register the classes with torch.serialization.add_safe_globals "
    "or pass allow_unsafe_byte_items=True to the reader"
)


def check_byte_item(data: bytes | bytearray | memoryview, item: str, where: str) -> None:
    """Raise ``CheckpointFormatError`` naming ``item`` and ``where`` if :func:`byte_item_problem` finds one."""
    problem = byte_item_problem(data)
    if problem is not None:
        raise CheckpointFormatError(f"byte item {item} in {where} is refused: {problem}; {UNSAFE_HINT}")


class _CheckedPlanner:
    """Forwards to a planner, checking each byte item before its ``load_bytes``."""

    def __init__(self, planner: LoadPlanner, where: str) -> None:
        self._planner, self._where = planner, where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.read()
        check_byte_item(data, read_item.storage_index.fqn, self._where)
        self._planner.load_bytes(read_item, io.BytesIO(data))


class CheckedFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with dcp_s3's byte item check (for checkpoints on local disk)."""

    def __init__(self, path: Any, *, allow_unsafe_byte_items: bool = False, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.allow_unsafe_byte_items = allow_unsafe_byte_items

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self.allow_unsafe_byte_items:
            planner = _CheckedPlanner(planner, str(self.path))  # type: ignore[assignment]
        return super().read_data(plan, planner)
