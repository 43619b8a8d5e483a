"""What a step marker (``<step>.pth``) may hold, by type: the one check of its fields before any is used.

A marker is stored bytes (restricted-unpickled by :func:`dcp_s3._checkpointer.generations.load_marker_bytes`, so it
runs no code), but what it holds is whatever its writer put there: an ``"iteration"`` of ``[1]`` or a
``"world_size"`` of ``10**12`` reaches every reader that trusts it (``int([1])``: a raw ``TypeError`` at the end
of a load; ``range(10**12)``: gigabytes). So every reader of a marker's fields — the manager's load
(:mod:`dcp_s3._checkpointer.step_io`), the local tier (:func:`dcp_s3._checkpointer.tiers.local_copy`, for loads
and ``dcp-s3 ls``) — passes it through :func:`check_marker` first; a marker that fails is unreadable, with the
field and why, and its step is not used. Sizes are checked against what can be true where that is known
(a rank below its world size here; the job's world size, or the rank directories present, where the tier
decides).

The entries checked, when present (each writer of dcp_s3 writes them so): ``format`` a str, ``iteration`` a
whole number, ``parts`` a list of part names (``<key>_model``/``<key>_optim``), ``world_size`` a whole number
>= 1, ``saved_at`` a number, ``part_dirs`` a dict (its entries are checked where they are followed,
:func:`dcp_s3._checkpointer.generations.part_dirs_of`), and for a local-tier copy :data:`LOCAL_ENTRY` (``rank``,
``world_size`` whole numbers, the rank below the world size; ``save`` a str) and :data:`LAYOUT` (a dict; each
layout is checked where it is used, :mod:`dcp_s3._checkpointer.local_layout`). The training state
(``scheduler``, ``grad_scaler``, ``callbacks``) is the user's, restored by its own ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any

from dcp_s3._checkpointer.steps import PART_SUFFIX_RE
from dcp_s3.errors import CheckpointFormatError

__all__ = ["LOCAL_ENTRY", "LAYOUT", "marker_problem", "check_marker"]

#: The marker entry of a local step: which rank of which world size saved it, and which save (``save``: a
#: token drawn by rank 0 for each save, the same on every rank, so that copies of different saves of one
#: step — a rerun — are never taken for one step).
LOCAL_ENTRY = "local_tier"
#: The marker entry of a local step: each part's layout (:func:`dcp_s3._checkpointer.local_layout.layout_of`).
LAYOUT = "local_layout"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def marker_problem(marker: Any) -> str | None:
    """Why the loaded marker ``marker`` holds what no writer of dcp_s3 writes (module docstring), or None."""
    if not isinstance(marker, dict):
        return f"it holds a {type(marker).__name__}, not a dict"
    checks = (
        ("format", lambda v: isinstance(v, str), "a str"),
        ("iteration", _whole, "a whole number"),
        (
            "parts",
            lambda v: isinstance(v, list) and all(isinstance(p, str) and PART_SUFFIX_RE.fullmatch(p) for p in v),
            "a list of part names",
        ),
        ("world_size", lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
        ("saved_at", lambda v: _whole(v) or isinstance(v, float), "a number"),
        ("part_dirs", lambda v: isinstance(v, dict), "a dict"),
        (LAYOUT, lambda v: isinstance(v, dict), "a dict"),
    )
    for name, ok, what in checks:
        if name in marker and not ok(marker[name]):
            return f"{name!r} = {_short(marker[name])} is not {what}"
    if LOCAL_ENTRY in marker:
        entry = marker[LOCAL_ENTRY]
        fine = (
            isinstance(entry, dict)
            and _whole(entry.get("rank"))
            and _whole(entry.get("world_size"))
            and 0 <= entry["rank"] < entry["world_size"]
            and isinstance(entry.get("save", ""), (str, type(None)))
        )
        if not fine:
            return f"{LOCAL_ENTRY!r} = {_short(entry)} names no rank of a world size (and a save token)"
    return None


def check_marker(marker: Any, where: str) -> dict[str, Any]:
    """``marker`` if :func:`marker_problem` finds nothing, else ``CheckpointFormatError`` naming ``where``."""
    problem = marker_problem(marker)
    if problem is not None:
        raise CheckpointFormatError(f"{where}: {problem}")
    return marker  # type: ignore[no-any-return]
