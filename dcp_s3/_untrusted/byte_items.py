"""Byte items (non-tensor values) are checked before any planner sees them.

DCP stores every non-tensor value (optimizer ``param_groups``, extra state, plain ints
and strings) as a ``torch.save`` archive, and torch's ``DefaultLoadPlanner.load_bytes``
reads it back with ``torch.load(..., weights_only=False)``: a pickled ``__reduce__``
would run. The readers therefore refuse, before calling ``planner.load_bytes``, any
byte item that weights-only loading would refuse, whatever planner is used — checked
without running it (see ``dcp_s3._untrusted.weights_only``). ``allow_unsafe_byte_items=True`` on
the reader skips the check for checkpoints you trust.
"""

from __future__ import annotations

from dcp_s3._untrusted.weights_only import byte_item_problem
from dcp_s3.errors import CheckpointFormatError

__all__ = ["byte_item_problem", "check_byte_item", "UNSAFE_HINT"]

UNSAFE_HINT = (
    "if you trust this checkpoint, register the classes with torch.serialization.add_safe_globals "
    "or pass allow_unsafe_byte_items=True to the reader"
)


def check_byte_item(data: bytes | bytearray | memoryview, item: str, where: str) -> None:
    """Raise ``CheckpointFormatError`` naming ``item`` and ``where`` if :func:`byte_item_problem` finds one."""
    problem = byte_item_problem(data)
    if problem is not None:
        raise CheckpointFormatError(f"byte item {item} in {where} is refused: {problem}; {UNSAFE_HINT}")
