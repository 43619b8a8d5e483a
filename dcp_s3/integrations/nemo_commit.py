"""The commit of an ``S3Checkpointer`` save (:mod:`dcp_s3.integrations.nemo_automodel`): one save per checkpoint,
proven by its save token, and the retention of committed checkpoints by ownership.

A NeMo AutoModel checkpoint ``<checkpoint_dir>/<name>/`` on S3 holds one save: every object of it below
``<name>/save.<token>/`` (NeMo's own layout there: ``model/``, ``optim/``, ``rng/...``), and the commit
``<name>/dcp_s3_commit.json``, written last by rank 0 with a PUT that never replaces another
(:func:`dcp_s3._commit.publish`; :class:`Commit`: the token, the DCP parts, each small file with its size). Loads
read the commit once (rank 0, shared) and read everything below the one save it names; a stored commit is untrusted
input, checked field by field (:meth:`Commit.parse`) before any name in it is used.

A save's DCP parts may be uploaded asynchronously (NeMo's ``is_async``): their upload futures are recorded with the
save (:meth:`Saves.add_upload`), and :meth:`Saves.commit` waits for them on every rank, with a deadline, before it
gathers: the commit is written only after every rank's upload completed, and a failed or late upload on any rank
fails the commit on every rank, nothing written.

Retention deletes under the configured root only ``epoch_<E>_step_<S>`` names (NeMo's scheme) whose commit
and DCP parts are there (:mod:`dcp_s3._checkpointer.ownership`), commit first. Nothing here imports NeMo.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dcp_s3 import _commit as marker
from dcp_s3._checkpointer.ownership import Ownership, refuse
from dcp_s3._checkpointer.ownership import committed as parts_committed
from dcp_s3._checkpointer.ranks import Ranks, distributed, world_size
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY, new_token
from dcp_s3.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    S3TransferError,
)

__all__ = [
    "COMMIT",
    "FORMAT",
    "SAVE_DIR",
    "CHECKPOINT_NAMES",
    "MAX_COMMIT_BYTES",
    "MAX_FILE_BYTES",
    "COMPONENT",
    "Commit",
    "Saves",
    "split_part",
]

logger = logging.getLogger(__name__)

#: The commit of a checkpoint, written last by rank 0 (a JSON document).
COMMIT = "dcp_s3_commit.json"
#: The commit's format tag.
FORMAT = "dcp_s3.nemo_automodel/1"
#: The directory of one save's objects inside a checkpoint: ``save.<token>``.
SAVE_DIR = "save."
#: NeMo's checkpoint names (``epoch_<E>_step_<S>``, as ``list_automodel_checkpoints`` matches them).
CHECKPOINT_NAMES = re.compile(r"epoch_[0-9]+_step_([0-9]+)")  # ASCII digits: dcp_s3._checkpointer.names
#: The largest commit read (NeMo's are a few kilobytes) and the largest small file it may list.
MAX_COMMIT_BYTES = 1 << 20
MAX_FILE_BYTES = 1 << 30
COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Commit:
    """A committed save as its commit names it: token, DCP parts, small files (relative name -> size)."""

    token: str
    parts: tuple[str, ...]
    files: dict[str, int]

    def to_json(self) -> bytes:
        return json.dumps(
            {"format": FORMAT, "save": self.token, "parts": list(self.parts), "files": self.files}, sort_keys=True
        ).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Commit:
        """The commit stored at ``where``, checked field by field; ``CheckpointFormatError`` naming the field."""
        doc = marker.load_json(data, where, ("format", "save", "parts", "files"))
        if doc["format"] != FORMAT:
            raise CheckpointFormatError(f"{where}: format {str(doc['format'])[:40]!r} is not {FORMAT!r}")
        token, parts, files = marker.check_token(doc["save"], f"{where}: save"), doc["parts"], doc["files"]
        if not isinstance(parts, list) or not all(isinstance(p, str) and COMPONENT.fullmatch(p) for p in parts):
            raise CheckpointFormatError(f"{where}: parts is not a list of names of one path component")
        if not isinstance(files, dict) or not all(
            marker.is_clean_name(k, component=COMPONENT)
            and isinstance(v, int)
            and not isinstance(v, bool)
            and 0 <= v <= MAX_FILE_BYTES
            for k, v in files.items()
        ):
            raise CheckpointFormatError(
                f"{where}: files is not a map of clean relative names to sizes of at most {MAX_FILE_BYTES} bytes"
            )
        return cls(token, tuple(parts), dict(files))


class Saves:
    """What an ``S3Checkpointer`` and its lifecycle share: the store, the saves in progress on this rank,
    the commits read (one per checkpoint, for the checkpointer's life), and the rank-0-then-share helper."""

    def __init__(self, options: StorageOptions, root: str | None, owner: str, upload_wait_s: float = 1800.0) -> None:
        self.options = options
        self.root = root  # the configured checkpoint_dir when it is on S3
        self.owner = owner
        self.upload_wait_s = upload_wait_s  # the deadline of each wait for an async upload
        self.ranks = Ranks()
        self.pending: dict[str, tuple[str, list[str], dict[str, int]]] = {}  # ckpt -> (token, parts, my files)
        self.uploads: dict[str, list[concurrent.futures.Future[Any]]] = {}  # ckpt -> this rank's async uploads
        self.commits: dict[str, Commit] = {}
        self._stores: dict[str, Store] = {}

    def store(self, ckpt: str) -> Store:
        """The store rooted at checkpoint ``ckpt`` (one per checkpoint, reused)."""
        if ckpt not in self._stores:
            self._stores[ckpt] = self.options.store(ckpt)
        return self._stores[ckpt]

    def root_store(self) -> Store:
        assert self.root is not None
        return self.store(self.root)

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()

    # -- saving ---------------------------------------------------------------------------------------------

    def begin(self, ckpt: str) -> None:
        """Every rank: rank 0 refuses a committed ``ckpt`` and draws the save token; every rank records it."""

        def draw() -> str:
            if self.store(ckpt).size(COMMIT) is not None:
                raise CheckpointExistsError(
                    f"Checkpoint directory {ckpt} already holds a published checkpoint ({COMMIT}). Remove it (delete "
                    f"{ckpt}/{COMMIT} first, then every object under {ckpt}/; the dcp-s3 commands do not know this "
                    "layout), or point checkpoint.checkpoint_dir at a fresh directory, before re-running this step."
                )
            return new_token()

        self.pending[ckpt] = (self.ranks.run_on_rank0(draw), [], {})
        self.uploads[ckpt] = []
        self.commits.pop(ckpt, None)

    def _save(self, ckpt: str) -> tuple[str, list[str], dict[str, int]]:
        save = self.pending.get(ckpt)
        if save is None:
            raise ConfigError(
                f"{ckpt}: no save in progress; call checkpointer.lifecycle.reserve({ckpt!r}) on every rank first, "
                "as NeMo's recipes do"
            )
        return save

    def part_writer(self, ckpt: str, part: str) -> Any:
        """A DCP writer for DCP part ``part`` of the save in progress at ``ckpt`` (recorded for its commit)."""
        token, parts, _ = self._save(ckpt)
        if part not in parts:
            parts.append(part)
        return self.options.writer(f"{ckpt}/{SAVE_DIR}{token}/{part}")

    def add_upload(self, ckpt: str, upload: concurrent.futures.Future[Any]) -> None:
        """Record an async upload of the save in progress at ``ckpt``: its commit waits for it."""
        self._save(ckpt)
        self.uploads.setdefault(ckpt, []).append(upload)

    def wait_upload(self, upload: concurrent.futures.Future[Any]) -> str | None:
        """Wait for one async upload at most ``upload_wait_s`` seconds: None when it completed, else
        why not (its error, or the deadline)."""
        try:
            upload.result(timeout=self.upload_wait_s)
        except concurrent.futures.TimeoutError:
            return f"an upload of its DCP parts did not complete within {self.upload_wait_s} s"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            return f"an upload of its DCP parts failed ({type(exc).__name__}: {str(exc)[:500]})"
        return None

    def _uploads_failed(self, ckpt: str) -> str | None:
        """Every rank: wait for each async upload of the save in progress at ``ckpt``; the first failure, or None."""
        for upload in self.uploads.get(ckpt, []):
            failed = self.wait_upload(upload)
            if failed:
                return failed
        return None

    def write_file(self, ckpt: str, rel: str, data: bytes) -> None:
        """Write small file ``rel`` of the save in progress at ``ckpt`` (recorded for its commit)."""
        token, _, files = self._save(ckpt)
        self.store(ckpt).write(f"{SAVE_DIR}{token}/{rel}", data)
        files[rel] = len(data)

    def commit(self, ckpt: str) -> None:
        """Every rank: wait for this rank's async uploads of the save (each with its deadline), gather what each
        rank wrote; rank 0 checks each DCP part is committed and writes the commit (never replacing one). An upload
        that failed or did not complete on any rank is an ``S3TransferError`` on every rank, nothing committed (the
        save is then over: a later commit of it is refused)."""
        token, parts, files = self._save(ckpt)
        failed = self._uploads_failed(ckpt)
        gathered: list[Any] = [(parts, files, failed)]
        if distributed():
            gathered = [None] * world_size()
            dist.all_gather_object(gathered, (parts, files, failed), group=self.ranks.control_group())
        failures = [(r, why) for r, (_, _, why) in enumerate(gathered) if why]
        if failures:
            del self.pending[ckpt]
            self.uploads.pop(ckpt, None)
            rank_of, why = failures[0]
            raise S3TransferError(f"{ckpt}: save {token} not committed, nothing written: on rank {rank_of}, {why}")
        if any(sorted(p) != sorted(parts) for p, _, _ in gathered):
            raise ConfigError(f"{ckpt}: the ranks saved different DCP parts: {[p for p, _, _ in gathered]}")
        merged: dict[str, int] = {}
        for _, rank_files, _ in gathered:
            merged.update(rank_files)
        commit = Commit(token, tuple(parts), merged)

        def write() -> None:
            store = self.store(ckpt)
            missing = [p for p in parts if store.size(f"{SAVE_DIR}{token}/{p}/{METADATA_KEY}") is None]
            if missing:
                raise CheckpointNotFoundError(f"{ckpt}: DCP parts {missing} of save {token} are not committed")
            if marker.publish(store.object_store, store.key(COMMIT), commit.to_json()):
                raise CheckpointExistsError(f"{ckpt}: another save committed this checkpoint ({COMMIT}) meanwhile")

        self.ranks.run_on_rank0(write)
        del self.pending[ckpt]
        self.uploads.pop(ckpt, None)
        self.commits[ckpt] = commit
        logger.info("committed NeMo checkpoint %s (save %s: parts %s, %d files)", ckpt, token, parts, len(merged))

    # -- loading --------------------------------------------------------------------------------------------

    def read_commit(self, store: Store, where: str) -> Commit | None:
        """The commit of the checkpoint ``store`` is rooted at, checked; None when there is none."""
        data = marker.read_marker(store.object_store, store.key(COMMIT), max_bytes=MAX_COMMIT_BYTES)
        return None if data is None else Commit.parse(data, f"{where}/{COMMIT}")

    def committed(self, ckpt: str) -> Commit:
        """The commit of ``ckpt``, read by rank 0 on the first call for it and shared (a collective then);
        ``CheckpointNotFoundError`` when ``ckpt`` holds no committed checkpoint."""
        if ckpt not in self.commits:

            def read() -> Commit:
                commit = self.read_commit(self.store(ckpt), ckpt)
                if commit is None:
                    raise CheckpointNotFoundError(f"{ckpt}: no committed checkpoint there (no {COMMIT})")
                return commit

            self.commits[ckpt] = self.ranks.run_on_rank0(read)
        return self.commits[ckpt]

    def part_reader(self, ckpt: str, part: str) -> Any:
        """A DCP reader for DCP part ``part`` of the committed save at ``ckpt``."""
        commit = self.committed(ckpt)
        if part not in commit.parts:
            raise CheckpointNotFoundError(
                f"{ckpt}: its save {commit.token} holds no DCP part {part!r} ({commit.parts})"
            )
        return self.options.reader(f"{ckpt}/{SAVE_DIR}{commit.token}/{part}")

    def read_file(self, ckpt: str, rel: str) -> bytes | None:
        """Small file ``rel`` of the committed save at ``ckpt``, or None when its commit lists none; a stored object
        of another size than the commit says is a ``CheckpointFormatError``."""
        commit = self.committed(ckpt)
        size = commit.files.get(rel)
        if size is None:
            return None
        name = f"{SAVE_DIR}{commit.token}/{rel}"
        stored = self.store(ckpt).size(name)
        if stored != size:
            raise CheckpointFormatError(f"{ckpt}/{name}: {stored} bytes stored, its commit says {size}")
        return self.store(ckpt).read(name)

    # -- retention (rank 0) ---------------------------------------------------------------------------------

    def ownership(self) -> Ownership:
        """What retention may delete: NeMo's checkpoint names directly under the configured root."""
        assert self.root is not None
        return Ownership(self.owner, self.root, CHECKPOINT_NAMES)

    def committed_names(self) -> list[str]:
        """Rank 0: the names NeMo's scheme makes under the root that hold a commit object, oldest step first
        (one listing and one HEAD per name; whether each commit is sound is :meth:`checkpoint`'s question)."""
        store = self.root_store()
        _, subdirs = store.list_dir("")
        owned = [n for n in self.ownership().owned(d.rstrip("/") for d in subdirs) if store.size(f"{n}/{COMMIT}")]
        return sorted(owned, key=lambda n: int(CHECKPOINT_NAMES.fullmatch(n).group(1)))  # type: ignore[union-attr]

    def checkpoint(self, name: str) -> list[str] | None:
        """Rank 0: the DCP part directories of checkpoint ``name`` under the root (``save.<token>/<part>``) when it
        is one — its commit reads and every part it names is committed — else None, with the reason warned for a
        commit that does not read (it is neither loaded as the latest, nor counted, nor deleted by retention)."""
        location = f"{self.root}/{name}"
        try:
            commit = self.read_commit(self.store(location), location)
        except CheckpointFormatError as exc:
            refuse(self.owner, location, f"its commit does not read, so it is no checkpoint ({exc})")
            return None
        if commit is None or not commit.parts:
            return None
        parts = [f"{SAVE_DIR}{commit.token}/{p}" for p in commit.parts]
        return parts if parts_committed(self.root_store(), name, parts) else None

    def latest(self) -> str | None:
        """Rank 0: the newest checkpoint under the root (by step), as a location, or None."""
        return next((f"{self.root}/{n}" for n in reversed(self.committed_names()) if self.checkpoint(n)), None)

    def prune(self, keep: int) -> None:
        """Rank 0: delete every checkpoint under the root but the newest ``keep`` (by step), each when the ownership
        rule allows: its commit first (it is then no checkpoint: a half-deleted one is never loaded), then every
        other object below it. Names whose commit does not read or whose parts are missing are not counted."""
        found = [(n, parts) for n in self.committed_names() if (parts := self.checkpoint(n))]
        store = self.root_store()
        for name, parts in found[: max(len(found) - keep, 0)]:
            location = f"{self.root}/{name}"
            if self.ownership().deletable(store, location, parts) is None:
                continue
            marker.retire(store.object_store, [store.key(f"{name}/{COMMIT}")], prefix=store.key(f"{name}/"))
            self.commits.pop(location, None)
            logger.info("pruned old NeMo checkpoint %s", location)


def split_part(path: str) -> tuple[str, str]:
    """``<ckpt>/<part>`` -> (ckpt, part)."""
    ckpt, _, part = path.rstrip("/").rpartition("/")
    return ckpt, part
