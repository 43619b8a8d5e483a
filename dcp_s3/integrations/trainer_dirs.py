"""Local checkpoint directories that stand for S3 locations: the transformers ``Trainer``'s ``output_dir``.

The transformers ``Trainer`` names its checkpoints by local directory (``<output_dir>/checkpoint-<step>``)
and keeps its small files there (``trainer_state.json``, RNG states, the scheduler), while its FSDP
shards go through Accelerate's four checkpoint functions. With ``route_fsdp_checkpoints(local_dirs=
{output_dir: "s3://bucket/run"})`` (:mod:`dcp_s3.integrations.accelerate`) those functions map a
directory under ``output_dir`` to the same relative place under the S3 root (:meth:`LocalDirs.locate`);
the shards go to S3 and only an empty ``pytorch_model_fsdp_<i>`` directory stays locally, the sign
the Trainer's resume looks for.

What the Trainer's rotation deletes locally is deleted in the bucket too (:meth:`LocalDirs.mirror`),
by ownership (:mod:`dcp_s3._checkpointer.ownership`): a mapped ``checkpoint-<step>`` directly under a
mapped root whose shards *this process saved* in the block (:meth:`LocalDirs.record_save`), whose local
directory the Trainer's ``rotate_checkpoints`` removed *during that call*, and whose saved parts are
committed in the bucket, has its S3 checkpoint removed (``.metadata`` first). So ``save_total_limit``
leaves exactly the kept checkpoints in the bucket. Nothing is deleted because a local directory is
absent: a checkpoint only loaded (a resume), one saved by another job, one whose directory vanished
otherwise (a wiped node-local disk, the Trainer's end-of-training ``shutil.rmtree`` with
``save_total_limit=1``) or a block left through an exception keeps its S3 copy — ``dcp-s3 rm`` removes
it when wanted.

Nothing here imports a framework.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from dcp_s3._checkpointer.ownership import Ownership
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._objstore.uri import parse_s3_uri
from dcp_s3.admin._cleanup import remove_checkpoint
from dcp_s3.errors import CheckpointNotFoundError, ConfigError, InvalidCheckpointIdError
from dcp_s3.integrations._locations import s3_location

__all__ = ["LocalDirs", "CHECKPOINT_DIR"]

logger = logging.getLogger(__name__)

#: The Trainer's checkpoint directory names (``PREFIX_CHECKPOINT_DIR`` is ``"checkpoint"``).
CHECKPOINT_DIR = re.compile(r"checkpoint-[0-9]+")  # ASCII digits: dcp_s3._checkpointer.names


def _real(path: Any) -> str:
    return os.path.realpath(os.fspath(path))


class LocalDirs:
    """Local directory roots and the S3 roots they stand for; the mapped checkpoints this process saved."""

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
        #: mapped checkpoint directory (real local path) -> (its S3 root, its name, the parts saved into it)
        self.saved: dict[str, tuple[str, str, set[str]]] = {}

    def __bool__(self) -> bool:
        return bool(self.roots)

    def _root_of(self, path: str) -> tuple[str, str] | None:
        """(mapped local root, path relative to it) for the longest root above ``path``, or None."""
        for root in sorted(self.roots, key=len, reverse=True):
            rel = os.path.relpath(path, root)
            if rel == os.curdir or (rel != os.pardir and not rel.startswith(os.pardir + os.sep)):
                return root, rel
        return None

    def locate(self, directory: Any) -> str | None:
        """The S3 location ``directory`` stands for (the longest mapped root above it), or None."""
        if not self.roots or not isinstance(directory, (str, os.PathLike)) or s3_location(directory):
            return None
        found = self._root_of(_real(directory))
        if found is None:
            return None
        root, rel = found
        return self.roots[root] if rel == os.curdir else f"{self.roots[root]}/{rel.replace(os.sep, '/')}"

    def record_save(self, part_dir: Any) -> None:
        """Remember that this process saved (and committed) the shards of mapped ``part_dir``
        (``<root>/checkpoint-<step>/<part>``): the checkpoint its rotation may later mirror."""
        found = self._root_of(_real(part_dir)) if isinstance(part_dir, (str, os.PathLike)) else None
        if found is None or found[1] == os.curdir:
            return
        root, rel = found
        name, _, part = rel.replace(os.sep, "/").partition("/")
        if CHECKPOINT_DIR.fullmatch(name) and part:
            self.saved.setdefault(os.path.join(root, name), (self.roots[root], name, set()))[2].add(part)

    def present(self) -> set[str]:
        """The saved checkpoint directories that are there now (before the Trainer rotates)."""
        return {path for path in self.saved if os.path.isdir(path)}

    def mirror(self, removed: set[str]) -> list[str]:
        """Remove from S3 the saved checkpoints of ``removed`` — directories that were :meth:`present` before
        the Trainer's rotation and are gone after it — when the ownership rule allows; their locations."""
        deleted = []
        for path in sorted(removed & set(self.saved)):
            if os.path.lexists(path):
                continue
            root, name, parts = self.saved.pop(path)
            location = f"{root}/{name}"
            ownership = Ownership("route_fsdp_checkpoints(local_dirs=...)", root, CHECKPOINT_DIR)
            store = self.options.store(root)
            try:
                if ownership.deletable(store, location, sorted(parts)) is None:
                    continue
            finally:
                store.close()
            try:
                removal = remove_checkpoint(location, recursive=True, **self.options.as_dict())
            except CheckpointNotFoundError:
                logger.debug("no checkpoint to remove at %s (the Trainer's rotation removed %s)", location, path)
                continue
            logger.info(
                "removed %s (%d objects): the Trainer's rotation deleted %s", location, len(removal.objects), path
            )
            deleted.append(location)
        return deleted
