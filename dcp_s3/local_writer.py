"""``SafeFileSystemWriter``: torch's ``FileSystemWriter`` with the commit protocol of ``S3StorageWriter``.

torch's writer names data files ``__{rank}_{n}.distcp`` and, on overwrite, rewrites them in
place and removes ``.metadata`` before renaming the new one over it: a save that fails or is
killed half-way leaves the old ``.metadata`` pointing at half-new files, or no ``.metadata``.
This writer gives every save its own file names (``__{rank}_{token}_{n}.distcp``, ``token``
new for every save), commits by an atomic ``os.replace`` of ``.metadata``, and deletes the
files of the checkpoint it replaced only after that. The checkpoint stays in torch's format
(stock ``FileSystemReader`` loads it). Used by :class:`dcp_s3.Checkpointer` for local
directories.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ._torch_compat import _StoragePrefix
from .errors import CheckpointExistsError, CheckpointFormatError, ConfigError
from .layout import METADATA_KEY, load_metadata, new_token, referenced_objects, replaceable_objects

__all__ = ["SafeFileSystemWriter"]

log = logging.getLogger("dcp_s3")


class SafeFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` whose overwrite never leaves a checkpoint half replaced."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # torch's version warns on every overwrite: here overwriting is the safe, intended default.
        if getattr(self, "rank", None) is not None and not getattr(self, "use_collectives", True):  # torch >= 2.9
            raise ConfigError("SafeFileSystemWriter needs use_collectives=True: the coordinator commits one .metadata")
        Path(self.path).mkdir(parents=True, exist_ok=True)
        if not self.overwrite and (Path(self.path) / METADATA_KEY).exists():
            raise CheckpointExistsError(f"Checkpoint already exists at {self.path} and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = new_token()
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{token}_")) for i, plan in enumerate(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: atomically replace ``.metadata``, then delete the files it no longer names."""
        metadata.storage_data = {wr.index: wr.storage_data for per_rank in results for wr in per_rank}
        metadata.storage_meta = self.storage_meta()
        metadata.version = "1.0.0"
        directory = Path(self.path)
        target = directory / METADATA_KEY
        replaced = _committed_files(target) - referenced_objects(metadata) if self.overwrite else set()
        tmp = directory / f"{METADATA_KEY}.{new_token()}.tmp"
        try:
            with open(tmp, "wb") as f:
                pickle.dump(metadata, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            if self.overwrite:
                os.replace(tmp, target)  # atomic: readers see the old checkpoint or the new one
            else:
                os.link(tmp, target)  # atomic and exclusive: of two racing saves, one commits
        except FileExistsError:
            for name in referenced_objects(metadata):  # this save was not committed: remove its files
                (directory / name).unlink(missing_ok=True)
            raise CheckpointExistsError(
                f"Checkpoint already exists at {self.path} and overwrite=False; another save committed it "
                "while this one was being written"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename is durable before anything it replaced is deleted
        finally:
            os.close(dir_fd)
        for name in sorted(replaced):
            (directory / name).unlink(missing_ok=True)


def _committed_files(metadata_path: Path) -> set[str]:
    """The files the checkpoint committed at ``metadata_path`` uses (empty if none or unreadable)."""
    try:
        data = metadata_path.read_bytes()
    except FileNotFoundError:
        return set()
    try:
        return replaceable_objects(load_metadata(data, str(metadata_path)))
    except CheckpointFormatError as exc:
        log.warning("not deleting the files of the checkpoint being replaced: %s", exc)
        return set()
