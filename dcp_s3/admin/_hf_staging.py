"""``gc`` of the staging prefixes a failed Hugging Face export leaves (:mod:`dcp_s3._dcp.hf_writer`).

What it owns, and how it proves it. ``S3HuggingFaceStorageWriter`` uploads each rank's piece object to
``<export>/.dcp_s3-hf-staging.<token>/rank-<r>`` (``<token>``: the export id, 16 lowercase ASCII hex digits,
:func:`dcp_s3._layout.new_token`; ``<r>``: the rank, at least 5 ASCII digits) and deletes the prefix when the
save ends; a rank killed while writing leaves it. A prefix is the writer's, and may be removed, only if:

- its last component is exactly ``.dcp_s3-hf-staging.`` followed by a token :func:`dcp_s3._layout.is_token`
  accepts (no other spelling: ``x``, upper-case hex, non-ASCII digits, ``..`` are someone else's);
- every object under it is directly ``rank-<digits>`` (ASCII) — one other object and the whole prefix stays;
- every object was last written more than ``older_than`` ago, and no multipart upload under it received a part
  within that bound (a save in progress).

Anything that fails one of these is reported as skipped with the reason, never deleted. Stale multipart
uploads of piece objects under an owned prefix are aborted with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dcp_s3._dcp import Entry, Upload
from dcp_s3._dcp.hf_writer import STAGING_PREFIX
from dcp_s3._layout import is_token

__all__ = ["StagingGarbage", "find_staging"]

#: A piece object's name under its staging prefix (``_hf_export_plan``: ``rank-{rank:05d}``); ASCII digits only.
_PIECE = re.compile(r"rank-[0-9]{5,}")


@dataclass
class StagingGarbage:
    """Staging prefixes found under a ``gc`` root: those to remove (names ending in ``/``), their objects and
    stale uploads, and the look-alikes or young ones left, with why."""

    prefixes: list[str] = field(default_factory=list)
    objects: list[Entry] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _staging_dir(name: str) -> str | None:
    """The staging prefix (``.../.dcp_s3-hf-staging.<anything>``) ``name`` lies in, if any component of its
    directory starts like one; None otherwise."""
    parts = name.split("/")
    for i, part in enumerate(parts[:-1]):
        if part.startswith(STAGING_PREFIX):
            return "/".join(parts[: i + 1])
    return None


def find_staging(
    entries: Sequence[Entry], stale: Sequence[Upload], busy: Sequence[Upload], cutoff: float
) -> StagingGarbage:
    """The staging prefixes among ``entries`` (and uploads) that ``gc`` may remove (see the module docstring);
    ``stale``/``busy``: the multipart uploads idle for longer than the bound, and the others."""
    found = StagingGarbage()
    groups: dict[str, list[Entry]] = {}
    for entry in entries:
        where = _staging_dir(entry.name)
        if where is not None:
            groups.setdefault(where, []).append(entry)
    uploads: dict[str, tuple[list[Upload], list[Upload]]] = {}
    for kind, listed in ((0, stale), (1, busy)):
        for upload in listed:
            where = _staging_dir(upload.name)
            if where is not None:
                groups.setdefault(where, [])
                uploads.setdefault(where, ([], []))[kind].append(upload)
    for where in sorted(groups):
        objects = groups[where]
        old, young = uploads.get(where, ([], []))
        token = where.rpartition("/")[2][len(STAGING_PREFIX) :]
        names = [o.name[len(where) + 1 :] for o in objects] + [u.name[len(where) + 1 :] for u in old + young]
        foreign = [n for n in names if _PIECE.fullmatch(n) is None]
        if not is_token(token):
            found.skipped.append((where + "/", "not a staging prefix of S3HuggingFaceStorageWriter (its token)"))
        elif foreign:
            found.skipped.append((where + "/", f"holds {foreign[0]!r}, not a piece object of an export's staging"))
        elif young:
            found.skipped.append((where + "/", f"an upload is in progress ({young[0].name})"))
        elif any(o.mtime > cutoff for o in objects):
            found.skipped.append((where + "/", "written within the age bound (an export may be in progress)"))
        else:
            found.prefixes.append(where + "/")
            found.objects.extend(objects)
            found.uploads.extend(old)
    return found
