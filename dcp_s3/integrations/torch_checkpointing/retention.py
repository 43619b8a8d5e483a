"""Deletion for :class:`dcp_s3.integrations.torch_checkpointing.S3Storage`: by ownership, never by inference.

torch_checkpointing's ``CheckpointManager`` has no retention of its own (0.1.1: it neither lists nor deletes
checkpoints); a user deletes with ``Storage.rmdir``, and :class:`~dcp_s3.integrations.torch_checkpointing.KeepLast`
keeps the newest few. Both come here, and here every deletion asks :mod:`dcp_s3._checkpointer.ownership`:
only a checkpoint under the storage's configured ``root`` whose name its ``checkpoint_names`` pattern matches
in full, and which is committed (its ``.dcp_s3-commit`` marker exists as the store says when it deletes). A
stage that never committed, a plain directory, another scheme's name, the root: refused, nothing deleted.
A checkpoint goes marker first (it is then no checkpoint), then every object under its name
(:func:`dcp_s3._commit.retire`).
"""

from __future__ import annotations

import re

from dcp_s3._checkpointer.names import DIGITS, scheme
from dcp_s3._checkpointer.ownership import Ownership
from dcp_s3._commit import retire
from dcp_s3._dcp.store import Store
from dcp_s3.errors import ConfigError, DeletionRefusedError
from dcp_s3.integrations.torch_checkpointing.commit import MARKER

__all__ = ["ownership", "delete_checkpoint", "committed_checkpoints", "doomed"]


def ownership(store: Store, root: str, names: str) -> Ownership:
    """What may be deleted: committed checkpoints under ``store``'s root (``root`` in messages) named by ``names``."""
    return Ownership(f"S3Storage(root={root})", store.url(""), scheme(names), marker=MARKER)


def delete_checkpoint(store: Store, root: str, names: str, name: str) -> None:
    """Delete the checkpoint ``name`` (relative to the root) if owned and committed; else ``DeletionRefusedError``."""
    if ownership(store, root, names).deletable(store, store.url(name)) is None:
        raise DeletionRefusedError(
            f"not deleting {store.url(name) if name else root}: only committed checkpoints named by "
            f"checkpoint_names={names!r} under {root} are deleted"
        )
    retire(store.object_store, [store.key(f"{name}/{MARKER}")], prefix=store.key(name + "/"))


def committed_checkpoints(store: Store, root: str, names: str, folder: str) -> list[str]:
    """The owned, committed checkpoints directly in ``folder`` (relative to the root), oldest first by the
    numbers in their names (``step_10`` after ``step_9``)."""
    own = ownership(store, root, names)
    lead = folder + "/" if folder else ""
    found = [d.rstrip("/") for d in store.list_dir(lead)[1]]
    found = [n for n in own.owned(found) if store.size(f"{n}/{MARKER}") is not None]
    return sorted(found, key=lambda n: [int(x) for x in re.findall(DIGITS, n)])


def doomed(committed: list[str], count: int) -> list[str]:
    """Which of ``committed`` (oldest first) a retention keeping the newest ``count`` deletes."""
    if count < 1:
        raise ConfigError(f"keep_last count={count}: keep at least one checkpoint")
    return committed[:-count]
