"""What dcp_s3 may delete, decided in one place: by ownership, never by inference.

Every rotation, purge and retention in dcp_s3 asks an :class:`Ownership` before it deletes. The rule:
a caller deletes a checkpoint only when

1. it lies under the root the caller was *configured* with (a constructor argument, never a path read
   from stored state: a restored ``best_model_path``, a resume path, a marker), as a name below that
   root with no empty, ``.`` or ``..`` component;
2. that name is one the caller's own naming scheme produces (:attr:`Ownership.scheme`, matched in full);
3. it is committed — its ``.metadata`` exists (a Checkpointer step: its marker and every part's
   ``.metadata``), as the caller finds it in the store when it deletes. A directory without one (a save
   in progress, what a crash left) is no checkpoint: it neither counts towards a ``keep`` limit nor is
   deleted;
4. never because a local file is absent: what the transformers Trainer removes locally is removed in
   the bucket only for checkpoints this process saved, when the Trainer's own rotation removed them.

What each caller may delete (its root as configured; the names its scheme makes):

- ``Checkpointer(keep_last=)``: under ``save_dir``, complete steps named ``{iteration:07d}``
  (:mod:`dcp_s3._checkpointer.retention`);
- the local tier's ``keep_last_local``: under ``<local_root>/rank<N>``, complete local steps named
  ``{iteration:07d}`` (:mod:`dcp_s3._checkpointer.tiers`);
- ``S3ModelCheckpoint``'s rotation, through ``S3TrainerStrategy.remove_checkpoint``: under its
  ``dirpath``, the names its ``filename`` and ``last`` templates make (``-v<N>``, ``.ckpt``);
- ``route_fsdp_checkpoints(local_dirs=)``: under each mapped ``s3://`` root, ``checkpoint-<N>`` this
  process saved in the block, once the Trainer's ``rotate_checkpoints`` removed its local directory;
- ``S3CheckpointManager``'s ``keep_latest_k`` purge: under ``folder``, ``step-<N>``.
- NeMo AutoModel's ``S3Checkpointer`` ``max_recent_checkpoints``: under ``checkpoint_dir``, ``epoch_<E>_step_<S>``
  whose commit object and DCP parts are there (:mod:`dcp_s3.integrations.nemo_commit`).
- torch_checkpointing's ``S3Storage.rmdir`` and its ``KeepLast`` retention: under the storage's ``root``,
  the names its ``checkpoint_names`` pattern matches, committed by its marker ``.dcp_s3-commit``
  (:mod:`dcp_s3.integrations.torch_checkpointing`).

``dcp-s3 rm`` deletes what its user names and ``dcp-s3 gc`` what no checkpoint needs
(:mod:`dcp_s3.admin._cleanup`): commands, not rotations, and not governed here.

Nor is a save removing what it wrote itself and did not commit — a failed upload's objects, or the
generation directories of a first save that lost the race for its step
(:func:`dcp_s3._checkpointer.generations.commit_step`): those names come from the save's own fresh token,
never from a listing or from stored state, and no checkpoint is deleted.

This module decides; the callers delete (their own deletion order: markers, then ``.metadata``, then the
rest). Nothing here imports a framework.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from dcp_s3._checkpointer.names import CHECKPOINTER_STEPS
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY

__all__ = ["Ownership", "CHECKPOINTER_STEPS", "committed", "refuse"]

log = logging.getLogger(__name__)


def _clean(name: str) -> bool:
    return bool(name) and all(c not in ("", ".", "..") for c in name.split("/"))


@dataclass(frozen=True)
class Ownership:
    """What one caller may delete: names ``scheme`` produces, directly or nested below ``root``.

    ``owner`` names the caller in messages; ``root`` is the location it was configured with (an
    ``s3://`` URL or a local path, without a trailing ``/``; ``""`` when names are relative to a
    store opened at the root); ``marker`` is the object whose presence makes a checkpoint committed
    (``.metadata`` for DCP checkpoints)."""

    owner: str
    root: str
    scheme: re.Pattern[str]
    marker: str = METADATA_KEY

    def owns(self, name: str) -> bool:
        """Whether ``name`` (relative to the root) is one the scheme produces, with no ``.``/``..`` part."""
        return _clean(name) and self.scheme.fullmatch(name) is not None

    def name_of(self, location: str) -> str | None:
        """``location``'s name below the root when the scheme produces it; None for anything else (another
        root, a sibling with the root as a prefix, the root itself, a name of another scheme)."""
        if not isinstance(location, str):
            return None
        root = self.root.rstrip("/")
        if root:
            if not location.startswith(root + "/"):
                return None
            location = location[len(root) + 1 :]
        name = location.rstrip("/")
        return name if self.owns(name) else None

    def owned(self, names: Iterable[str]) -> list[str]:
        """The names of ``names`` this caller owns, in their order."""
        return [n for n in names if self.owns(n)]

    def deletable(self, store: Store, location: str, parts: Iterable[str] = ("",)) -> str | None:
        """The name to delete for ``location`` — owned and committed (each of ``parts``' ``.metadata``
        is in ``store``, opened at the root) — or None, with the reason warned."""
        name = self.name_of(location)
        if name is None:
            refuse(self.owner, location, f"not a name its scheme makes under {self.root or 'its root'}")
            return None
        if not committed(store, name, parts, marker=self.marker):
            log.info("%s: %s is not committed (no %s): not deleted", self.owner, location, self.marker)
            return None
        return name


def committed(store: Store, name: str, parts: Iterable[str] = ("",), *, marker: str = METADATA_KEY) -> bool:
    """Whether every part (``""``: the checkpoint itself) of the checkpoint ``name`` has its ``marker``
    (``.metadata`` unless told)."""
    keys = [f"{name}/{p}/{marker}" if p else f"{name}/{marker}" for p in parts]
    return bool(keys) and all(store.size(k) is not None for k in keys)


def refuse(owner: str, location: object, why: str) -> None:
    """Say that ``owner`` leaves ``location`` alone, and why (a warning: the user must see it)."""
    message = f"dcp_s3: {owner} does not delete {location!r}: {why}"
    log.warning(message)
    warnings.warn(message, stacklevel=3)
