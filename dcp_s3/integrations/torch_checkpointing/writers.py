"""Which writer id a storage writes a stage's files under: a fresh one for each save of the name.

A commit takes a writer whole (:mod:`.commit`): every object below ``<name>/.dcp_s3-staged/<writer>/`` of the
claimed writers goes into the marker. So one writer must hold the files of exactly one save. torch_checkpointing's
storage sees files, not saves; a save that failed (a file's write raised, a callback raised, the barrier timed out)
tells it nothing, and the same storage (the manager lives on) may save that name again with another set of files.

Where a save begins and ends is said by torch_checkpointing itself, never inferred from a side effect: a save is one
call of its writer's ``CheckpointWriter.write(path, checkpoint_info)`` (0.1.1: every file, the pre-finalize
callback, the barrier, rank 0's ``rename`` (the commit) and the finalize callback happen inside it, on the thread
that called it, in the training process or torch_checkpointing's writer process). While any ``S3Storage`` lives in a
process, that method is wrapped (:class:`dcp_s3.integrations._patching.ContextPatch`; by the writer, not by a
context: torch_checkpointing calls it from its own process and threads, where no block of the user's is open). A
call whose writer holds an ``S3Storage`` first tells it that a save of ``path`` begins (:meth:`StageWriters.begin`):
the writer of an earlier save of that name that never committed is retired, and the first file of this save hands
this storage's claim to a fresh writer (:func:`.commit.reclaim`: the claim must still name the retired writer, an
id only this storage knew). A retired writer's files are never committed, read or deleted here; they stay below
``<name>/`` and go with the checkpoint (like a killed attempt's). A ``mkdir`` is nothing: a callback making (or
re-making) any directory in the stage, the stage's own included, stays in the save.

Every file this storage writes in a save is recorded (:meth:`StageWriters.written`); rank 0's commit refuses a stage
whose listing lacks one (:func:`.commit.commit`'s ``expected``), so a commit names every file of the save, or the
save fails before its marker exists (and a ``finalize_callback`` such as ``KeepLast`` never runs). Another rank's
files are all its writer's objects; one of them lost before the commit is not seen by rank 0. A claim lost in the
middle of a save (removed by someone else) fails that save's next write instead of silently starting a new writer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch_checkpointing.checkpoint_writer import CheckpointWriter

from dcp_s3._dcp.store import Store
from dcp_s3.errors import CheckpointFormatError, ConfigError
from dcp_s3.integrations._patching import ContextPatch, Site
from dcp_s3.integrations.torch_checkpointing import commit as tc_commit

__all__ = ["StageWriters", "watch_saves"]


class StageWriters:
    """The writer of each stage this storage writes into (final name -> writer id), and the files of its save."""

    def __init__(self, store: Callable[[], Store], rank: int, attempt: str) -> None:
        self._store = store
        self.rank = rank
        self.attempt = attempt
        self._lock = threading.Lock()
        self._writers: dict[str, str] = {}  # final name -> this storage's writer id in its stage
        self._files: dict[str, set[str]] = {}  # final name -> files (relative) its writer wrote in this save
        self._retired: dict[str, str] = {}  # final name -> the writer of a save of it that never committed

    def get(self, final: str) -> str | None:
        """The writer of the current save of ``final`` (None if this storage has not written into its stage)."""
        return self._writers.get(final)

    def written(self, final: str) -> set[str]:
        """The files this storage wrote in the current save of ``final`` (relative to it)."""
        with self._lock:
            return set(self._files.get(final, ()))

    def for_file(self, final: str, rel: str) -> str:
        """The writer to write ``rel`` of the stage of ``final`` under, claiming this rank's place if it holds none."""
        store = self._store()
        with self._lock:
            writer = self._writers.get(final)
            if writer is not None and not tc_commit.holds(store, final, self.rank, writer, self.attempt):
                if self._files.get(final):
                    raise CheckpointFormatError(
                        f"rank {self.rank}'s claim in the stage of {store.url(final)} (writer {writer}) was removed "
                        f"while this save was writing it; {len(self._files[final])} files of the save would not be "
                        "committed: the save fails"
                    )
                writer = None
            if writer is None:
                writer = tc_commit.new_writer()
                old = self._retired.get(final)
                if old is not None:
                    tc_commit.reclaim(store, final, self.rank, old, writer, self.attempt)
                else:
                    tc_commit.claim(store, final, self.rank, writer, self.attempt)
                self._retired.pop(final, None)
                self._writers[final] = writer
                self._files[final] = set()
            self._files[final].add(rel)
            return writer

    def begin(self, final: str) -> None:
        """torch_checkpointing's writer begins a save of ``final``: an earlier save's writer (one that never
        committed) is retired; the first file of this save claims a fresh one."""
        with self._lock:
            writer = self._writers.pop(final, None)
            self._files.pop(final, None)
            if writer is not None:
                self._retired[final] = writer

    def committed(self, final: str) -> None:
        """Forget the stage of ``final``: rank 0 committed it."""
        with self._lock:
            self._writers.pop(final, None)
            self._files.pop(final, None)
            self._retired.pop(final, None)


# -- the save boundary torch_checkpointing states: one CheckpointWriter.write call ---------------------------------

#: storage -> what to call when its writer begins a save (``begin(storage, path)``; no reference to the storage
#: itself, which would keep it alive); the storages alive in this process.
_watched: weakref.WeakKeyDictionary[Any, Callable[[Any, Any], None]] = weakref.WeakKeyDictionary()


def _writer_storage(writer: Any) -> Any:
    """The storage torch_checkpointing's writer writes through (0.1.1: set in ``CheckpointWriter.__init__``)."""
    try:
        return vars(writer)["_storage"]
    except (KeyError, TypeError):
        raise ConfigError(
            f"torch_checkpointing's {type(writer).__name__} keeps no storage where 0.1.1 does: a release dcp_s3 does "
            "not know cannot tell its S3Storage where a save begins"
        ) from None


def _one_save(_: bool, original: Callable[..., Any], writer: Any, *args: Any, **kwargs: Any) -> Any:
    storage = _writer_storage(writer)
    begin = _watched.get(storage)
    if begin is not None:
        begin(storage, kwargs["path"] if "path" in kwargs else args[0])
    return original(writer, *args, **kwargs)


_boundaries: ContextPatch[bool] = ContextPatch(
    "torch_checkpointing save boundaries",
    lambda: [Site(CheckpointWriter, "write", _one_save)],
    resolve=lambda _: True,  # dispatched by the writer's storage (_one_save), not by a context
)


def watch_saves(storage: Any, begin: Callable[[Any, Any], None]) -> None:
    """Call ``begin(storage, path)`` whenever torch_checkpointing's writer using ``storage`` begins a save of ``path``, for as
    long as ``storage`` lives (``CheckpointWriter.write`` is wrapped while any watched storage does)."""
    _boundaries.hold()
    _watched[storage] = begin
    weakref.finalize(storage, _boundaries.release)
