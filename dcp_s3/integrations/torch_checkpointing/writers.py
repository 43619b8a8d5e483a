"""Which writer id a storage writes a stage's files under: a fresh one for each save of the name.

A commit takes a writer whole (:mod:`.commit`): every object below ``<name>/.dcp_s3-staged/<writer>/`` of the
claimed writers goes into the marker. So one writer must never hold files of two saves. torch_checkpointing's
storage sees files, not saves, and a save that failed (a file's write raised, a callback raised, the barrier timed
out) tells it nothing: it leaves its claim and files, and the same storage (the manager lives on) may save that name
again with another set of files. Without a boundary the retry would reuse the writer, and the failed save's files
it does not rewrite would be committed with it.

The boundary is where torch_checkpointing's writer (0.1.1, ``CheckpointWriter._prepare_save_dirs``) prepares a
save: it makes every parent directory of the save's files (``Storage.mkdir``) before it writes the first of them.
So a ``mkdir`` of a stage's directory in which this storage's writer already wrote a file begins a new save: that
writer is retired, and the next write into the stage hands this storage's claim to a fresh writer
(:func:`.commit.reclaim`: the claim must still name the retired writer, an id only this storage knew). The retired
writer's files are never committed, read or deleted here; they stay below ``<name>/`` and go with the checkpoint
(like a killed attempt's). A ``mkdir`` of a directory this writer wrote nothing in (a callback making a
subdirectory for files it adds before the commit) continues the save.

Not seen: a retry that writes nothing on a rank (no ``mkdir`` there), or only into directories the failed save
left empty; such a rank still commits its earlier writer's files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dcp_s3.integrations.torch_checkpointing import commit as tc_commit
from dcp_s3.store.base import Store

__all__ = ["StageWriters"]


class StageWriters:
    """The writer of each stage this storage writes into (final name -> writer id), and the directories it wrote in."""

    def __init__(self, store: Callable[[], Store], rank: int, attempt: str) -> None:
        self._store = store
        self.rank = rank
        self.attempt = attempt
        self._lock = threading.Lock()
        self._writers: dict[str, str] = {}  # final name -> this storage's writer id in its stage
        self._dirs: dict[str, set[str]] = {}  # final name -> directories (relative, "" the stage) written in
        self._retired: dict[str, str] = {}  # final name -> the writer of a save of it that never committed

    def get(self, final: str) -> str | None:
        """The writer of the current save of ``final`` (None if this storage has not written into its stage)."""
        return self._writers.get(final)

    def for_file(self, final: str, rel: str) -> str:
        """The writer to write ``rel`` of the stage of ``final`` under, claiming this rank's place if it holds none."""
        store = self._store()
        with self._lock:
            writer = self._writers.get(final)
            if writer is None or not tc_commit.holds(store, final, self.rank, writer, self.attempt):
                writer = tc_commit.new_writer()
                old = self._retired.get(final)
                if old is not None:
                    tc_commit.reclaim(store, final, self.rank, old, writer, self.attempt)
                else:
                    tc_commit.claim(store, final, self.rank, writer, self.attempt)
                self._retired.pop(final, None)
                self._writers[final] = writer
                self._dirs[final] = set()
            self._dirs[final].add(rel.rpartition("/")[0])
            return writer

    def prepare(self, final: str, rel: str) -> None:
        """A ``mkdir`` of ``rel`` in the stage of ``final``: a new save if this storage's writer wrote in ``rel``."""
        with self._lock:
            if rel.strip("/") in self._dirs.get(final, ()):
                self._retired[final] = self._writers.pop(final)
                del self._dirs[final]

    def committed(self, final: str) -> None:
        """Forget the stage of ``final``: rank 0 committed it."""
        with self._lock:
            self._writers.pop(final, None)
            self._dirs.pop(final, None)
            self._retired.pop(final, None)
