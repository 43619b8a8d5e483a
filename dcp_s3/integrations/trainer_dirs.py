"""Local checkpoint directories that stand for S3 locations: the transformers ``Trainer``'s ``output_dir``.

The transformers ``Trainer`` names its checkpoints by local directory (``<output_dir>/checkpoint-<step>``)
and keeps its small files there (``trainer_state.json``, RNG states, the scheduler), while its FSDP
shards go through Accelerate's four checkpoint functions. With ``route_fsdp_checkpoints(local_dirs=
{output_dir: "s3://bucket/run"})`` (:mod:`dcp_s3.integrations.accelerate`) those functions map a
directory under ``output_dir`` to the same relative place under the S3 root (:meth:`LocalDirs.locate`);
the shards go to S3 and only an empty ``pytorch_model_fsdp_<i>`` directory stays locally, the sign
the Trainer's resume looks for.

What the Trainer deletes locally is deleted in the bucket too (:meth:`LocalDirs.mirror_deletions`):
a mapped ``checkpoint-<step>`` directory this process saw — saved into, or present when the Trainer
rotated — whose local directory is gone has its S3 checkpoints removed (``.metadata`` first). So
``save_total_limit`` leaves exactly the kept checkpoints in the bucket. Nothing is deleted on the
strength of a directory this process never saw (another node's disk does not hold rank 0's
directories).

Nothing here imports a framework.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from dcp_s3.admin.cleanup import remove_checkpoint
from dcp_s3.errors import CheckpointNotFoundError, ConfigError, InvalidCheckpointIdError
from dcp_s3.integrations.lightning_io import s3_location
from dcp_s3.objstore.config import parse_s3_uri
from dcp_s3.store.storage_options import StorageOptions

__all__ = ["LocalDirs", "CHECKPOINT_DIR"]

logger = logging.getLogger("dcp_s3")

#: The Trainer's checkpoint directory names (``PREFIX_CHECKPOINT_DIR`` is ``"checkpoint"``).
CHECKPOINT_DIR = re.compile(r"checkpoint-\d+")


def _real(path: Any) -> str:
    return os.path.realpath(os.fspath(path))


class LocalDirs:
    """Local directory roots and the S3 roots they stand for; the mapped checkpoint directories seen."""

    def __init__(self, local_dirs: Mapping[Any, str] | None, options: StorageOptions) -> None:
        self.options = options
        self.roots: dict[str, str] = {}
        for local, target in (local_dirs or {}).items():
            if not isinstance(local, (str, os.PathLike)):
                raise ConfigError(f"local_dirs: key {local!r} is not a local directory path")
            try:
                parse_s3_uri(target, require_key=False)
            except InvalidCheckpointIdError as exc:
                raise ConfigError(f"local_dirs[{os.fspath(local)!r}]: {exc}") from None
            self.roots[_real(local)] = target.rstrip("/")
        #: mapped checkpoint directory (real local path) -> its S3 location
        self.seen: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.roots)

    def locate(self, directory: Any) -> str | None:
        """The S3 location ``directory`` stands for (the longest mapped root above it), or None."""
        if not self.roots or not isinstance(directory, (str, os.PathLike)) or s3_location(directory):
            return None
        path = _real(directory)
        for root in sorted(self.roots, key=len, reverse=True):
            rel = os.path.relpath(path, root)
            if rel == os.curdir:
                return self.roots[root]
            if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
                self._see(path)
                return f"{self.roots[root]}/{rel.replace(os.sep, '/')}"
        return None

    def _see(self, path: str) -> None:
        """Remember the checkpoint directory at or above ``path`` (``checkpoint-<step>``), if any."""
        parent, name = os.path.split(path)
        while parent not in self.roots and name:
            parent, name = os.path.split(parent)
        if parent in self.roots:
            self._remember(parent, name)

    def _remember(self, root: str, name: str) -> None:
        if CHECKPOINT_DIR.fullmatch(name):
            self.seen[os.path.join(root, name)] = f"{self.roots[root]}/{name}"

    def see_checkpoints(self, directory: Any) -> None:
        """Remember the mapped checkpoint directories now in ``directory`` (before the Trainer rotates)."""
        root = _real(directory)
        if root not in self.roots or not os.path.isdir(root):
            return
        for name in os.listdir(root):
            if os.path.isdir(os.path.join(root, name)):
                self._remember(root, name)

    def mirror_deletions(self) -> list[str]:
        """Remove from S3 every seen checkpoint directory that is gone locally; returns their locations."""
        removed = []
        for path, location in sorted(self.seen.items()):
            if os.path.lexists(path):
                continue
            del self.seen[path]
            try:
                removal = remove_checkpoint(location, recursive=True, **self.options.as_dict())
            except CheckpointNotFoundError:
                logger.debug("no checkpoint to remove at %s (its local directory %s is gone)", location, path)
                continue
            logger.info("removed %s (%d objects): its local directory %s was deleted", location,
                        len(removal.objects), path)
            removed.append(location)
        return removed
