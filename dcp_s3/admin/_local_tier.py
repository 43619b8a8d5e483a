"""``dcp-s3 ls <local_root>``: the node-local tier of a tiered Checkpointer, step by step.

A local root (``Checkpointer(..., local_root=...)``) holds one directory per rank, ``rank<NNNNN>/``, each
with that rank's committed copies of its steps (:mod:`dcp_s3._checkpointer.tiers`). For every step found
there, :func:`list_local_tier` tells which ranks hold a committed copy, whether the step is complete locally
(copies of every rank of the world size that saved it, all of one save — as a resharded load from this
root needs them, :mod:`dcp_s3._checkpointer.tier_reshard`) and, given the S3 root, whether the step is
committed on S3, and whether as the promotion of that same save (the S3 generation directories carry the
save's token), and the promotion lag.

The lag is the time between the two commits as their storage recorded them: the S3 marker's
``LastModified`` (S3's clock) minus the newest local marker's modification time among the step's copies
(the node's clock), so it holds to the agreement of the two clocks and S3's whole-second resolution (a
promotion within a second may read slightly negative). The markers' own ``saved_at`` is the time of the ``save`` call and is the same in
both tiers, so it cannot measure the lag. Markers are stored bytes: they are read by the restricted checks
of the load, and one that cannot be read or is hostile is reported on its row, never raised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dcp_s3._checkpointer.generations import find_complete, part_dirs_of, read_marker
from dcp_s3._checkpointer.local_root import rank_dirs
from dcp_s3._checkpointer.markers import LOCAL_ENTRY
from dcp_s3._checkpointer.steps import MARKER_SUFFIX, root_steps
from dcp_s3._checkpointer.tier_reshard import Copy, copies_problem, scan_copies
from dcp_s3._checkpointer.tiers import save_of
from dcp_s3._dcp import Store, open_store
from dcp_s3._objstore.uri import s3_location
from dcp_s3.errors import CheckpointNotFoundError, ConfigError, DcpS3Error

__all__ = ["LocalStep", "is_local_tier_root", "list_local_tier", "refused_rank_dirs"]


@dataclass
class LocalStep:
    """One row of ``dcp-s3 ls <local_root>``."""

    name: str
    iteration: int | None
    world_size: int | None  # of the job that saved it (None: the copies disagree, or none is readable)
    ranks: list[int]  # rank directories holding a committed, readable copy
    complete: bool  # copies of every rank of ``world_size``, all of one save
    why: str = ""  # why it is not complete
    #: rank directory -> why its copy's marker could not be read (unreadable or hostile bytes).
    problems: dict[int, str] = field(default_factory=dict)
    committed_at: float | None = None  # the newest local marker's modification time among the copies
    #: With an S3 root: "complete" (this save, promoted), "complete, another save", "complete, save unknown"
    #: (the local copies are not of one save, or record none), "incomplete", "absent", "unreadable"; None
    #: without one.
    s3: str | None = None
    s3_committed_at: float | None = None  # the S3 marker's LastModified
    s3_error: str = ""
    lag: float | None = None  # s3_committed_at - committed_at, for a promotion of this save
    save: str | None = None  # the save token, if every readable copy is of one save


def is_local_tier_root(uri: str) -> bool:
    """Whether ``uri`` is a local directory holding ``rank<NNNNN>`` entries (a tiered Checkpointer's local root;
    entries that are not rank directories of ours, such as links, count: they are reported, never read)."""
    if "://" in uri or s3_location(uri) is not None:
        return False
    ours, refused = rank_dirs(os.path.abspath(uri))
    return bool(ours or refused)


def refused_rank_dirs(local_root: str) -> dict[int, str]:
    """Why each ``rank<NNNNN>`` entry under ``local_root`` that is not a rank directory of ours (a symbolic
    link, a file) is not read, by rank (:mod:`dcp_s3._checkpointer.local_root`)."""
    return rank_dirs(os.path.abspath(local_root))[1]


def list_local_tier(local_root: str, s3: str | None = None, **s3_options: Any) -> list[LocalStep]:
    """Every step under the local root ``local_root``, oldest first; with ``s3`` (the Checkpointer's S3 root
    and its storage options) also its state there (module docstring). Rank entries that are links are not
    read (:func:`refused_rank_dirs` says why); a step missing their copies says so."""
    if "://" in local_root:
        raise ConfigError(f"{local_root}: a local tier root is a local directory")
    root = os.path.abspath(local_root)
    if not is_local_tier_root(root):
        raise CheckpointNotFoundError(
            f"{local_root}: no rank<NNNNN>/ directories: not the local root of a Checkpointer(local_root=...)"
        )
    found, refused = scan_copies(root)
    rows = [_row(step, by_rank, refused) for step, by_rank in found.items()]
    rows.sort(key=lambda r: (len(r.name), r.name))
    if s3 is not None:
        _add_s3(rows, open_store(s3, **s3_options))
    return rows


def _row(step: str, by_rank: dict[int, Copy | str], refused: dict[int, str]) -> LocalStep:
    copies = [c for _, c in sorted(by_rank.items()) if isinstance(c, Copy)]
    problems = {r: c for r, c in by_rank.items() if isinstance(c, str)}
    worlds = {c.marker[LOCAL_ENTRY]["world_size"] for c in copies}
    iterations = {c.marker.get("iteration") for c in copies}
    (iteration,) = iterations if len(iterations) == 1 else (None,)
    why = copies_problem(by_rank, refused) or ""
    saves = {save_of(c.marker) for c in copies}
    return LocalStep(
        name=step,
        iteration=iteration if type(iteration) is int else None,
        world_size=next(iter(worlds)) if len(worlds) == 1 else None,
        ranks=[c.rank for c in copies],
        complete=not why,
        why=why,
        problems=problems,
        committed_at=max((c.committed_at for c in copies), default=None),
        save=next(iter(saves)) if len(saves) == 1 else None,
    )


def _add_s3(rows: list[LocalStep], store: Store) -> None:
    listed = {s.name: s for s in root_steps(store)}
    complete = {s.name for s in find_complete(store, None)}
    for row in rows:
        step = listed.get(row.name)
        if step is None or step.marker is None:
            row.s3 = "incomplete" if step is not None else "absent"
            continue
        if row.name not in complete:
            row.s3 = "incomplete"
            continue
        row.s3_committed_at = step.marker.mtime
        try:
            found = read_marker(store, row.name)
            dirs = None if found is None else part_dirs_of(found[1], row.name, store.url(row.name + MARKER_SUFFIX))
        except (DcpS3Error, OSError) as exc:
            row.s3, row.s3_error = "unreadable", f"{type(exc).__name__}: {exc}"
            continue
        tokens = {d.rsplit(".", 1)[1] for d in (dirs or {}).values() if "." in d}
        if row.save is None:
            row.s3 = "complete, save unknown"
        elif row.committed_at is not None and tokens == {row.save}:
            row.s3 = "complete"
            row.lag = row.s3_committed_at - row.committed_at
        else:
            row.s3 = "complete, another save"
