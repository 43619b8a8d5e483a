"""One save per load: which save a stored step holds, proven by its save token.

Every save of a :class:`~dcp_s3._checkpointer.manager.Checkpointer` step draws one random token (16 hex
digits, the same on every rank) and writes each part to a generation directory ``<step>.<part>.<token>/``
(:mod:`dcp_s3._checkpointer.generations`); the step's marker, written last, names them in ``part_dirs``.
So the *save token* of a committed step is the token its marker's ``part_dirs`` share. A step written
by an earlier version (plain ``<step>.<part>/`` directories, no ``part_dirs``) has none: it is still one
save when all its parts are read through the one marker rank 0 read, but it is never proven equal to
another copy of the step. A local-tier copy records the token of its save (``local_tier.save`` in its
marker, :func:`dcp_s3._checkpointer.tiers.save_of`); its promotion writes the S3 step under that same token.

How each load path proves one save:

* a plain load (:mod:`dcp_s3._checkpointer.step_io`): rank 0 reads the marker once and every rank loads
  the directories that one marker names (a save committing meanwhile cannot mix in: its directories
  carry another token);
* a tier load from the local copies of every rank: the copies' tokens agree (an all-gather);
* a resharded tier load: the copies of every saving rank carry one token
  (:mod:`dcp_s3._checkpointer.tier_reshard`);
* a *mixed* tier load (some ranks local, the others from S3): rank 0 reads the S3 marker once
  (:func:`stored_save`), every rank gets the same :class:`StoredSave`, and a rank loads its local copy
  only if its token equals the S3 step's; otherwise it reads S3 too (or, when no rank can stay local,
  the whole step is loaded from S3). A step neither can serve is skipped, and ``last_load`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dcp_s3._checkpointer.generations import load_marker_bytes, part_dirs_of
from dcp_s3._checkpointer.steps import MARKER_FORMAT, MARKER_SUFFIX, PART_SUFFIX_RE
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = ["StoredSave", "save_token", "stored_save"]


@dataclass(frozen=True)
class StoredSave:
    """A committed step as rank 0 read it: its marker's bytes, the directory of each part, its save token."""

    step: str
    marker_data: bytes
    dirs: dict[str, str]
    token: str | None  # None: plain directories (an earlier version's save), never proven equal to a copy


def save_token(step: str, dirs: Mapping[str, str]) -> str | None:
    """The token every part directory of ``step`` carries (``<step>.<part>.<token>``), or None when they
    carry none or not the same one."""
    tokens: set[str | None] = set()
    for suffix, name in dirs.items():
        rest = name[len(step) + 1 :] if name.startswith(step + ".") else ""
        tokens.add(rest[len(suffix) + 1 :] if rest.startswith(suffix + ".") else None)
    return tokens.pop() if len(tokens) == 1 and None not in tokens else None


def stored_save(store: Store, step: str) -> StoredSave:
    """Rank 0: read ``step``'s marker (one GET) and HEAD each part's ``.metadata``.
    ``CheckpointNotFoundError`` (saying why) unless the step is committed there, every part too;
    ``CheckpointFormatError`` for a marker that is not a Checkpointer step's or names what it must not."""
    name = step + MARKER_SUFFIX
    where = store.url(name)
    try:
        data = store.read(name)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{store.url(step)} is not committed (no marker)") from None
    marker: Any = load_marker_bytes(data, where)
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        raise CheckpointFormatError(f"{where} is not a step marker of the Checkpointer")
    parts = marker.get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, str) and PART_SUFFIX_RE.fullmatch(p) for p in parts):
        raise CheckpointFormatError(f"{where}: 'parts' = {parts!r} is not a list of part names")
    dirs = part_dirs_of(marker, step, where) or {p: f"{step}.{p}" for p in parts}
    for directory in sorted(dirs.values()):
        if store.size(f"{directory}/{METADATA_KEY}") is None:
            raise CheckpointNotFoundError(f"{store.url(directory)} is not committed (no {METADATA_KEY})")
    return StoredSave(step, data, dirs, save_token(step, dirs))
