"""torch_checkpointing (Meta's checkpoint library) saving to and loading from S3 through dcp_s3: one storage config.

Chosen where a ``CheckpointManager`` is configured (tested with torch-checkpointing 0.1.1)::

    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from dcp_s3.integrations.torch_checkpointing import KeepLast, S3StorageConfig

    manager = CheckpointManager(CheckpointManager.Config(
        storage_config=S3StorageConfig("s3://bucket/run1", options={"endpoint_url": "http://127.0.0.1:8333"}),
        finalize_callback=KeepLast(3),  # optional retention
    ))
    manager.save("s3://bucket/run1/step_100", {"model": model.state_dict()})  # or "step_100": relative to the root

:class:`S3Storage` implements torch_checkpointing's ``Storage`` over a :class:`dcp_s3._dcp.store.Store`
(the object store, client settings and I/O pool every dcp_s3 tool uses). What it owns, and why:

- **The commit.** torch_checkpointing writes a save under ``<parent>/tmp_<name>`` and rank 0 renames that
  directory onto ``<parent>/<name>`` after a barrier. On S3 the files are written below ``<name>/`` from
  the start and the rename writes a commit marker (:mod:`dcp_s3.integrations.torch_checkpointing.commit`): no copy, no
  delete, atomic, and an occupied destination is refused (``CheckpointExistsError``, an ``OSError``). The
  marker names only the files of this job attempt's writers (:mod:`.attempts`): a restarted job saves a name
  a killed save left behind without ever combining the two. Each save has a fresh writer (:mod:`.writers`): a
  failed save retried by the same manager is not combined with it either.
- **What a listing shows.** ``exists``/``isdir``/``ls`` show ``<name>`` only once committed, with only the
  files its manifest names; an uncommitted stage shows as ``tmp_<name>`` (what it is), never as ``<name>``.
- **One save per load.** Looking at a checkpoint's directory (torch_checkpointing's reader does it first)
  reads its marker; every file then read through it is the object of the writer and ETag that marker
  names, or the read is refused (``CheckpointFormatError``).
- **Deletion by ownership.** ``rmdir`` deletes a committed checkpoint whose name, below the configured
  ``root``, the ``checkpoint_names`` pattern matches, through :mod:`dcp_s3._checkpointer.ownership`;
  anything else is refused (``DeletionRefusedError``). :class:`KeepLast` is a retention on top of it.
- **Bounded memory.** ``stream_write`` is a multipart upload from a fixed pool of part buffers;
  ``stream_read`` serves ``readinto`` with concurrent ranged GETs (:mod:`dcp_s3.integrations.torch_checkpointing.streams`).

What cannot be done: renaming a directory that is not a stage, or a stage onto another name (there is no
rename on S3; ``ConfigError``); writing into a committed checkpoint; ``write_to_temp_dir=False`` (the
library then writes straight to the final name, which nothing commits: those files are plain objects,
listed as soon as they exist). A file renamed onto another (``hf`` consolidation does it) is a
server-side copy and a delete, not atomic as a pair.
"""

from __future__ import annotations

import io
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch_checkpointing.checkpoint_writer import CallbackArgs
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from dcp_s3._checkpointer.names import scheme
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._dcp.store import Store
from dcp_s3._objstore.buffers import BufferPool
from dcp_s3.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DeletionRefusedError,
)
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations.torch_checkpointing import attempts as tc_attempts
from dcp_s3.integrations.torch_checkpointing import commit as tc_commit
from dcp_s3.integrations.torch_checkpointing import paths as tc_paths
from dcp_s3.integrations.torch_checkpointing import retention as tc_retention
from dcp_s3.integrations.torch_checkpointing.commit import MARKER, STAGED, Manifest
from dcp_s3.integrations.torch_checkpointing.paths import Where
from dcp_s3.integrations.torch_checkpointing.streams import ObjectReadStream, ObjectWriteStream
from dcp_s3.integrations.torch_checkpointing.writers import StageWriters, watch_saves

__all__ = ["S3StorageConfig", "S3Storage", "KeepLast"]

_INTERNAL = (MARKER, STAGED)


@dataclass
class S3StorageConfig(StorageConfig):
    """Where checkpoints live and how to reach them; pass as ``CheckpointManager.Config(storage_config=...)``.

    ``root``: ``s3://bucket[/prefix]`` (a local directory works too, through dcp_s3's local store); paths
    given to the manager are ``s3://`` URLs under it or names relative to it. ``options``: dcp_s3 storage
    options (``endpoint_url``, ``part_size``, ``max_concurrency``...). ``temp_dir_prefix`` must equal the
    writer's (torch_checkpointing's default ``tmp_``). ``checkpoint_names``: the names (relative to
    ``root``, matched in full) that ``rmdir`` and :class:`KeepLast` may delete. ``rank``/``world_size``:
    this process's, from ``torch.distributed`` when left None. ``attempt``: the job attempt this process's saves
    belong to (32 hex digits), agreed by every rank through the process group's store when left None
    (:mod:`dcp_s3.integrations.torch_checkpointing.attempts`): a restarted job's saves never meet a killed one's.
    """

    root: str
    options: StorageOptions | Mapping[str, Any] | None = None
    temp_dir_prefix: str = "tmp_"
    checkpoint_names: str = r"step_[0-9]+"
    rank: int | None = None
    world_size: int | None = None
    attempt: str | None = None
    _options: StorageOptions = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temp_dir_prefix or "/" in self.temp_dir_prefix:
            raise ConfigError(f"temp_dir_prefix {self.temp_dir_prefix!r}: needs one non-empty name part")
        try:
            scheme(self.checkpoint_names)
        except re.error as exc:
            raise ConfigError(f"checkpoint_names {self.checkpoint_names!r}: not a regular expression ({exc})") from None
        self._options = StorageOptions.of(self.options)  # a bad option fails here, not at the first save
        self.root = s3_location(self.root) or os.fspath(self.root).rstrip("/")
        if self.attempt is not None:
            tc_attempts.check_attempt(self.attempt)

    def __getstate__(self) -> dict[str, Any]:
        # Sent to torch_checkpointing's writer process: the rank is known here, where the process group is.
        state = dict(self.__dict__)
        if dist.is_available() and dist.is_initialized():
            state["rank"] = dist.get_rank() if self.rank is None else self.rank
            state["world_size"] = dist.get_world_size() if self.world_size is None else self.world_size
            if self.attempt is None:  # agreed once, in the training process, where the process group's store is
                self.attempt = state["attempt"] = tc_attempts.agreed_attempt()
        return state

    def create_storage(self) -> S3Storage:
        return S3Storage(self)


class S3Storage(Storage):
    """torch_checkpointing's ``Storage`` on S3 (see the module docstring for what each method guarantees)."""

    def __init__(self, config: S3StorageConfig) -> None:
        self.config = config
        state = config.__getstate__()
        self.rank: int = state["rank"] if state["rank"] is not None else 0
        self.world_size: int = state["world_size"] if state["world_size"] is not None else 1
        self.attempt: str = state["attempt"] or tc_attempts.new_attempt()  # no process group: an attempt of its own
        self._store: Store | None = None
        self._pool: BufferPool | None = None
        self._store_lock = threading.Lock()
        self._writers = StageWriters(lambda: self.store, self.rank, self.attempt)  # a fresh writer for each save
        self._manifests: dict[str, Manifest] = {}  # checkpoint -> marker read when its directory was looked at
        watch_saves(self, S3Storage.begin_save)  # torch_checkpointing's writer says where each save begins

    def begin_save(self, path: Path | str) -> None:
        """torch_checkpointing's writer begins a save of ``path`` (its final name): :mod:`.writers`."""
        self._writers.begin(self.name_of(path))

    @property
    def store(self) -> Store:
        with self._store_lock:
            if self._store is None:
                self._store = self.config._options.store(self.config.root)
                transfer = self._store.session.transfer
                self._pool = BufferPool(transfer.max_concurrency + 2, transfer.part_size)
            return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- paths -------------------------------------------------------------------------------------

    def name_of(self, path: Path | str) -> str:
        """``path`` as a name relative to the root (``""``: the root itself)."""
        return "/".join(self._parts(path))

    def _parts(self, path: Path | str) -> list[str]:
        return tc_paths.split(path, self.config.root)

    def _where(self, path: Path | str) -> Where:
        return tc_paths.locate(self._parts(path), self.config.temp_dir_prefix, self._manifests, self.store)

    # -- writing -----------------------------------------------------------------------------------

    def _write_name(self, path: Path | str) -> str:
        where = self._where(path)
        if where.kind == "committed":
            raise CheckpointExistsError(f"{self.store.url(where.name)} is committed; its files are not rewritten")
        if where.kind == "plain":
            return where.name
        if not where.rest:
            raise ConfigError(f"{path}: a directory, not a file to write")
        return tc_commit.staged_key(where.name, self._writers.for_file(where.name, where.rest), where.rest)

    def stream_write(self, path: Path) -> io.IOBase:
        name = self._write_name(path)
        store = self.store
        assert self._pool is not None
        writer = store.object_store.open_writer(store.key(name), pool=self._pool, executor=store.session.executor)
        return ObjectWriteStream(writer, store.url(name))

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Nothing: no directory to make (a stage is claimed by its first file), and no sign of anything (a save
        begins where torch_checkpointing's writer says: :mod:`dcp_s3.integrations.torch_checkpointing.writers`)."""
        self._parts(path)  # a path elsewhere is refused, as for every other call

    # -- reading -----------------------------------------------------------------------------------

    def _source(self, path: Path | str) -> tuple[str, int, str | None]:
        """(object name, size, ETag the commit recorded or None) of the file at ``path``."""
        where = self._where(path)
        store = self.store
        if where.kind == "committed":
            assert where.manifest is not None
            entry = where.manifest.files.get(where.rest)
            if entry is None:
                raise CheckpointNotFoundError(f"{store.url(where.name)} has no file {where.rest!r}")
            return tc_commit.staged_key(where.name, entry.writer, where.rest), entry.size, entry.etag
        if where.kind == "stage":
            writer = self._writers.get(where.name)
            if writer is None or not where.rest:
                raise CheckpointNotFoundError(f"{path}: no file this process wrote in that stage")
            name = tc_commit.staged_key(where.name, writer, where.rest)
        else:
            name = where.name
        head = store.object_store.head(store.key(name))
        if head is None:
            raise CheckpointNotFoundError(f"{store.url(name)}: not found")
        return name, head.size, None

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A seekable stream over the file (always streamed: ``pre_read_full_file`` and ``direct_io`` do not
        apply to an object store)."""
        name, size, etag = self._source(path)
        store = self.store
        if etag is not None:
            head = store.object_store.head(store.key(name))
            if head is None:
                raise CheckpointNotFoundError(
                    f"{store.url(name)}, a file of the save this load looked at, is gone: that checkpoint was deleted "
                    "(or saved again) since; look at it again to load what is there now"
                )
            if head.size != size or head.etag != etag:
                raise CheckpointFormatError(
                    f"{store.url(name)} is not the object its checkpoint's commit recorded (size {size}, ETag {etag}): "
                    "refusing to combine two saves"
                )
        known = read_args.known_size_bytes if read_args is not None else None
        if known is not None and known != size:
            raise CheckpointFormatError(f"{store.url(name)} holds {size} bytes, the reader expected {known}")
        return ObjectReadStream(store, name, size)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        with self.stream_read(path, read_args) as stream:
            return stream.readall()

    def getsize(self, path: Path) -> int:
        return self._source(path)[1]

    # -- listing -----------------------------------------------------------------------------------

    def exists(self, path: Path) -> bool:
        where = self._where(path)
        if where.kind == "committed":
            assert where.manifest is not None
            return where.rest in where.manifest.files or where.manifest.is_dir(where.rest)
        if where.kind == "stage":
            if not where.rest:
                return tc_commit.is_staged(self.store, where.name)
            try:
                self._source(path)
                return True
            except CheckpointNotFoundError:
                return False
        return not where.name or self.store.size(where.name) is not None or self._has_children(where.name)

    def isdir(self, path: Path) -> bool:
        where = self._where(path)
        if where.kind == "committed":
            assert where.manifest is not None
            return where.manifest.is_dir(where.rest)
        if where.kind == "stage":
            return not where.rest and tc_commit.is_staged(self.store, where.name)
        return not where.name or self._has_children(where.name)

    def _has_children(self, name: str) -> bool:
        return tc_paths.contents(self.store, name)[1]

    def ls(self, path: Path) -> list[str]:
        """The names in a directory: committed checkpoints by their name, uncommitted stages as
        ``<temp_dir_prefix><name>``, plain objects and directories as they are."""
        where = self._where(path)
        if where.kind == "committed":
            assert where.manifest is not None
            if not where.manifest.is_dir(where.rest):
                raise CheckpointNotFoundError(f"{path}: not a directory of {self.store.url(where.name)}")
            return where.manifest.top_level(where.rest)
        if where.kind == "stage":
            raise ConfigError(f"{path}: the files of an uncommitted stage are not listed")
        lead = where.name + "/" if where.name else ""
        objects, dirs = self.store.list_dir(lead)
        names = [entry.name[len(lead) :] for entry in objects if entry.name[len(lead) :] not in _INTERNAL]
        for sub in dirs:
            if sub.rstrip("/").rsplit("/", 1)[-1] not in _INTERNAL:
                names.extend(tc_paths.shown(self.store, sub.rstrip("/"), self.config.temp_dir_prefix))
        if not names and where.name:
            raise CheckpointNotFoundError(f"{self.store.url(where.name)}: no such directory")
        return sorted(names)

    # -- committing, renaming, deleting ---------------------------------------------------------------

    def rename(
        self, src_path: Path, dst_path: Path, is_directory: bool = False, background_cleanup: bool = False
    ) -> None:
        """Commit a stage onto its own name (the directory is not moved: a marker makes it a checkpoint), or
        move one object onto another (a server-side copy, then a delete). Anything else: ``ConfigError``.
        An occupied destination: ``CheckpointExistsError`` (an ``OSError``), per torch_checkpointing's table."""
        src, dst = self._where(src_path), self._where(dst_path)
        store = self.store
        if src.kind == "stage" and not src.rest:
            if (dst.kind, dst.name, dst.rest) not in (("plain", src.name, ""), ("committed", src.name, "")):
                raise ConfigError(
                    f"S3Storage commits the stage {src_path} only onto {store.url(src.name)}, not {dst_path}"
                )
            if dst.kind == "committed" or store.size(src.name) is not None or self._has_children(src.name):
                raise CheckpointExistsError(f"refusing to commit {src_path} onto {store.url(src.name)}: it is occupied")
            writer = self._writers.get(src.name)
            expected = {writer: self._writers.written(src.name)} if writer is not None else {}
            self._manifests[src.name] = tc_commit.commit(store, src.name, self.world_size, self.attempt, expected)
            self._writers.committed(src.name)
            return
        if src.kind == "plain" and store.size(src.name) is not None:
            if dst.kind != "plain" or not dst.name:
                raise ConfigError(f"S3Storage moves a plain object only onto a plain name, not {dst_path}")
            if self._has_children(dst.name):
                raise CheckpointExistsError(f"refusing to move {src_path} onto the directory {store.url(dst.name)}")
            store.copy_from(store, src.name, dst.name)
            store.delete([src.name])
            return
        raise ConfigError(
            f"S3Storage cannot rename {src_path}: S3 has no rename; only a stage (its commit) and single objects move"
        )

    def delete(self, path: Path) -> None:
        """Delete one plain object; the files of a checkpoint or a stage go only with their checkpoint."""
        where = self._where(path)
        if where.kind != "plain" or not where.name:
            raise DeletionRefusedError(
                f"{path}: a file of a checkpoint or stage; rmdir deletes a committed checkpoint whole"
            )
        if self.store.size(where.name) is None:
            raise CheckpointNotFoundError(f"{self.store.url(where.name)}: not found")
        self.store.delete([where.name])

    def rmdir(self, path: Path) -> None:
        """Delete a committed checkpoint this storage owns (:mod:`dcp_s3.integrations.torch_checkpointing.retention`); anything
        else is refused with ``DeletionRefusedError`` and nothing is deleted."""
        name = self.name_of(path)
        tc_retention.delete_checkpoint(self.store, self.config.root, self.config.checkpoint_names, name)
        self._manifests.pop(name, None)

    def committed(self, folder: str = "") -> list[str]:
        """The committed checkpoints this storage owns directly in ``folder``, oldest first."""
        config = self.config
        return tc_retention.committed_checkpoints(
            self.store, config.root, config.checkpoint_names, self.name_of(folder)
        )

    def keep_last(self, count: int, folder: str = "") -> list[str]:
        """Delete all but the newest ``count`` committed checkpoints owned in ``folder``; returns what went."""
        gone = tc_retention.doomed(self.committed(folder), count)
        for name in gone:
            self.rmdir(Path(name))
        return gone

    def remap_path(self, path: Path) -> str:
        return self.store.url("/".join(self._parts(path)))


@dataclass(frozen=True)
class KeepLast:
    """A ``finalize_callback`` keeping the newest ``count`` committed checkpoints next to each one saved: runs
    on rank 0 after the commit and deletes, through :meth:`S3Storage.keep_last`, only what it owns."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"KeepLast(count={self.count}): keep at least one checkpoint")

    def __call__(self, args: CallbackArgs) -> None:
        storage = args.storage
        if not isinstance(storage, S3Storage):
            raise ConfigError(f"KeepLast works with S3Storage, not {type(storage).__name__}")
        if storage.rank == 0:
            storage.keep_last(self.count, storage.name_of(args.path).rpartition("/")[0])
