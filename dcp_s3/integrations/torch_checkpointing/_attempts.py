"""Which job attempt a process of a torch_checkpointing save belongs to: one id shared by every rank of an attempt.

torch_checkpointing 0.1.1 gives its storage no collective and no save id: each rank writes its files, the ranks meet
at a barrier on the process group's store, and rank 0 renames. What every rank of one job attempt does share is that
store (the ``TCPStore`` a launcher sets up, which the barrier uses too). The first process to ask sets
``dcp_s3/torch_checkpointing/attempt/<restart count>`` to a fresh id there with a compare-and-set, and every other
process of the attempt reads the same value back:

- a job restarted after a crash has a new process group, so a new store and a new id; ``torchrun`` restarting its
  workers in place (the agent's store outlives them) gives them a new ``TORCHELASTIC_RESTART_COUNT``, so a new key;
- a store that outlived a crashed attempt and is reused with the same restart count (not something a launcher
  does) hands the new attempt the dead one's id: its claims then meet the dead attempt's and the save is refused,
  never combined (:mod:`.commit`).

Without a process group (one process) each :class:`~dcp_s3.integrations.torch_checkpointing.S3Storage` is an attempt
of its own.
"""

from __future__ import annotations

import os
import uuid

from dcp_s3._torch_compat import default_store
from dcp_s3.errors import CheckpointFormatError, ConfigError
from dcp_s3.integrations.torch_checkpointing._commit import check_id

__all__ = ["KEY", "agreed_attempt", "check_attempt", "new_attempt"]

#: The store key (with ``/<restart count>``) holding the attempt id.
KEY = "dcp_s3/torch_checkpointing/attempt"


def new_attempt() -> str:
    return uuid.uuid4().hex


def check_attempt(value: str) -> str:
    """``value`` if it is an attempt id (32 lowercase hex digits); ``ConfigError`` otherwise."""
    try:
        return check_id(value)
    except CheckpointFormatError:
        raise ConfigError(f"attempt {value!r}: expected 32 lowercase hex digits") from None


def agreed_attempt() -> str | None:
    """This job attempt's id, agreed through the default process group's store; None without a process group."""
    store = default_store()
    if store is None:
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agreed = store.compare_set(f"{KEY}/{restart}", "", new_attempt())  # "": set only if absent; returns the value
    return check_id(agreed.decode() if isinstance(agreed, bytes) else agreed)
