"""Saves of a step, all or nothing: generation directories named by the step's marker.

Every save of a step writes each part to its own *generation directory* ``<step>.<key>_<kind>.<16 hex>/``
(one random token per save, the same on every rank: the save token, :mod:`dcp_s3._checkpointer.saves`),
never touching the parts of any other save; rank 0 then writes the marker ``<step>.pth`` — one atomic
write, the commit of the whole step — with ``"part_dirs": {"<key>_<kind>": "<key>_<kind>.<hex>", ...}``
(relative to the step).

* A *first save* (no marker when it began) commits with a write that never replaces a marker
  (``If-None-Match: *`` on S3, an exclusive link on disk): of two jobs racing the first save of one
  step exactly one commits; the other raises ``CheckpointExistsError`` naming the step and deletes its
  own generation directories (its token's: never a directory the winner's marker names). On a server
  that ignores ``If-None-Match`` the last marker wins, still naming only its own save's directories.
* A *re-save* (a marker exists) rewrites the marker, and only then deletes the directories the previous
  marker named (if the marker is still the one it wrote). A crash at any point leaves the old marker
  and every old part, or the new marker and every new part.

Steps written by earlier versions have first saves in plain ``<step>.<key>_<kind>/`` directories and a
marker without ``part_dirs`` (the layout of :mod:`dcp_s3._checkpointer.steps`, shared with other
checkpointers): they load as always. Readers follow ``part_dirs`` when a marker has it. ``part_dirs``
from a stored marker is validated: each entry must name ``<that step>.<part>`` or
``<that step>.<part>.<16 hex>`` for the parts the marker lists. Directories of a step that its marker
does not name (a killed save, the loser of a race, or the old parts of a re-save killed during its
cleanup) are never loaded; ``dcp-s3 gc`` removes them once they are older than its bound, retention
removes them with their step.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from dcp_s3 import _commit as commit
from dcp_s3._checkpointer.legacy import ALLOW_MISSING_OPTIM_ENV
from dcp_s3._checkpointer.steps import (
    MARKER_SUFFIX,
    PART_SUFFIX_RE,
    Part,
    Step,
    is_checkpoint_object,
    ordered,
    part_name,
    root_steps,
)
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY, is_token
from dcp_s3._untrusted.torch_files import torch_load
from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError, DcpS3Error

__all__ = [
    "PART_DIRS",
    "generation_name",
    "marker_entry",
    "part_dirs_of",
    "load_marker_bytes",
    "read_marker",
    "settle",
    "find_complete",
    "delete_dirs",
    "replaced_dirs",
    "commit_step",
    "plan_parts",
]

log = logging.getLogger(__name__)

#: The marker entry naming each part's directory (absent from markers of first saves of earlier versions).
PART_DIRS = "part_dirs"


def generation_name(step: str, key: str, kind: str, token: str | None) -> str:
    """The directory of a part: ``<step>.<key>_<kind>`` (``token`` None), else ``<step>.<key>_<kind>.<token>``."""
    base = part_name(step, key, kind)
    return base if token is None else f"{base}.{token}"


def part_dirs_of(marker: Any, step: str, where: str) -> dict[str, str] | None:
    """The directories that ``marker``'s ``part_dirs`` names, by part (names relative to the store, like
    ``step``), or None if it has none. Entries are relative to the step (``"m_model.<hex>"`` names
    ``<step>.m_model.<hex>/``, so that a copied or renamed step keeps its meaning). ``CheckpointFormatError``
    (naming ``where``) unless each names ``<part>`` or ``<part>.<16 hex>`` for exactly the parts the
    marker lists: never another step's directory, a path or ``..``."""
    if not isinstance(marker, dict) or PART_DIRS not in marker:
        return None
    dirs, parts = marker[PART_DIRS], marker.get("parts")
    if not isinstance(dirs, dict) or not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise CheckpointFormatError(f"{where}: {PART_DIRS!r} must be a dict and 'parts' a list of part names")
    if set(dirs) != set(parts) or len(parts) != len(set(parts)):
        raise CheckpointFormatError(
            f"{where}: {PART_DIRS!r} names the parts {sorted(map(str, dirs))!r}, the marker lists {sorted(parts)!r}"
        )
    out: dict[str, str] = {}
    tokens: dict[str, str | None] = {}
    for suffix, name in dirs.items():
        if not PART_SUFFIX_RE.fullmatch(suffix):
            raise CheckpointFormatError(f"{where}: {suffix!r} is not a part name (<key>_model or <key>_optim)")
        token = name[len(suffix) + 1 :] if isinstance(name, str) and name.startswith(suffix + ".") else None
        ok = name == suffix or (token is not None and is_token(token))
        if not ok:
            raise CheckpointFormatError(
                f"{where}: {PART_DIRS}[{suffix!r}] = {name!r} is not a directory of this step "
                f"({suffix!r} or {suffix!r}.<16 hex digits>)"
            )
        out[suffix] = f"{step}.{name}"
        tokens[suffix] = token
    commit.check_one_save(tokens, set(list(tokens.values())[:1]), f"{where}: {PART_DIRS}")  # one save's directories
    return out


def marker_entry(suffix: str, token: str | None) -> str:
    """The ``part_dirs`` value naming part ``suffix`` of generation ``token``."""
    return suffix if token is None else f"{suffix}.{token}"


def plan_parts(
    store: Store,
    step: str,
    marker: Any,
    marker_name: str,
    model_keys: list[str],
    optim_keys: list[str],
    allow_missing: bool,
) -> tuple[dict[str, str], dict[str, str]]:
    """For a load of ``step`` (rank 0): (the directory of each part to load, ``"load"``/``"missing"`` by
    optimizer key). A re-saved step's marker names the directories (validated); else ``<step>.<part>``.
    A model part missing or not committed is ``CheckpointNotFoundError``, an optimizer part too unless
    ``allow_missing``; a part that a marker with ``part_dirs`` does not name is missing."""
    named = part_dirs_of(marker, step, store.url(marker_name))
    suffixes = [f"{k}_model" for k in model_keys] + [f"{k}_optim" for k in optim_keys]
    dirs = {s: f"{step}.{s}" if named is None else named.get(s, f"{step}.{s}") for s in suffixes}

    def present(suffix: str) -> bool:
        return (named is None or suffix in named) and store.size(f"{dirs[suffix]}/{METADATA_KEY}") is not None

    for key in model_keys:
        if not present(f"{key}_model"):
            raise CheckpointNotFoundError(
                f"model checkpoint {store.url(dirs[f'{key}_model'])} is missing or incomplete"
            )
    optim: dict[str, str] = {}
    for key in optim_keys:
        if present(f"{key}_optim"):
            optim[key] = "load"
        elif allow_missing:
            optim[key] = "missing"
        else:
            raise CheckpointNotFoundError(
                f"optimizer checkpoint {store.url(dirs[f'{key}_optim'])} is missing; pass allow_missing_optim=True "
                f"(or set {ALLOW_MISSING_OPTIM_ENV}=1) to continue with fresh optimizer state"
            )
    return dirs, optim


def load_marker_bytes(data: bytes, where: str) -> Any:
    """The marker loaded weights-only; ``CheckpointFormatError`` if it is not a readable torch.save file."""
    return torch_load(data, where)


def read_marker(store: Store, step: str) -> tuple[bytes, Any] | None:
    """(bytes, loaded value) of ``<step>.pth``, or None if there is none."""
    name = step + MARKER_SUFFIX
    data = commit.read_marker(store.object_store, store.key(name))  # None also when deleted while read
    return None if data is None else (data, load_marker_bytes(data, store.url(name)))


def settle(store: Store, steps: Iterable[Step]) -> list[Step]:
    """Steps from :func:`~dcp_s3._checkpointer.steps.scan` or :func:`~dcp_s3._checkpointer.steps.root_steps` with their parts as
    their markers name them: a step with generation directories (and a marker) has its marker read
    (one GET) and its ``parts`` set to the directories ``part_dirs`` names, every other directory of
    the step moved to ``stale``. A step without generation directories is returned as it is (no
    request). A marker proved unusable — gone (404) or malformed (``CheckpointFormatError``) — sets
    ``Step.error``: such a step is not complete, and nothing of it is touched by ``gc``. Any other error
    (a 500 after the retries, a timeout, throttling, access denied) may pass and proves nothing: it is
    raised, so that no caller takes an older step for the newest (absent is not unavailable)."""
    out = []
    for step in steps:
        if step.kind == "step" and step.stale and step.marker is not None and not (step.named or step.error):
            try:
                _follow_marker(store, step)
            except (CheckpointFormatError, CheckpointNotFoundError) as exc:
                step.error = f"{type(exc).__name__}: {exc}"
                log.warning("step %s is not complete: its marker cannot be followed: %s", store.url(step.name), exc)
        out.append(step)
    return out


def _follow_marker(store: Store, step: Step) -> None:
    where = store.url(step.name + MARKER_SUFFIX)
    data = store.read(step.name + MARKER_SUFFIX)
    dirs = part_dirs_of(load_marker_bytes(data, where), step.name, where)
    if dirs is None:
        return  # the plain directories are the step's; the generations stay stale
    every = {p.name: p for p in [*step.parts.values(), *step.stale]}
    step.parts = {suffix: every.pop(name) if name in every else Part(name) for suffix, name in dirs.items()}
    step.stale = sorted(every.values(), key=lambda p: p.name)
    step.named = True


def replaced_dirs(previous: Any, step: str, suffixes: Iterable[str], where: str) -> list[str]:
    """The directories the marker ``previous`` (loaded) names for ``step``: its ``part_dirs``, or for a
    marker without one the plain ``<step>.<part>`` directory of each part it lists (of ``suffixes``
    when it lists none: another checkpointer's marker)."""
    dirs = part_dirs_of(previous, step, where)
    if dirs is not None:
        return sorted(dirs.values())
    parts = previous.get("parts") if isinstance(previous, dict) else None
    if not isinstance(parts, list) or not all(isinstance(p, str) and PART_SUFFIX_RE.fullmatch(p) for p in parts):
        parts = list(suffixes)
    return sorted(f"{step}.{p}" for p in parts)


def delete_dirs(store: Store, dirs: Iterable[str]) -> int:
    """Delete the checkpoint objects of part directories (every ``.metadata`` first, so none of them
    looks committed while half deleted); other files in them stay. Returns the number deleted."""
    names: list[str] = []
    for directory in dirs:
        names += [e.name for e in store.list_objects(directory + "/") if is_checkpoint_object(directory, e.name)]
    first = [store.key(n) for n in names if n.rpartition("/")[2] == METADATA_KEY]
    commit.retire(store.object_store, first, [store.key(n) for n in names if n.rpartition("/")[2] != METADATA_KEY])
    return len(names)


def commit_step(
    store: Store, step: str, marker: bytes, token: str | None, suffixes: list[str], *, first: bool = False
) -> None:
    """Rank 0, once every part is committed: write the marker ``<step>.pth`` (the step's commit).

    ``first`` (a first save: there was no marker when the save began): the marker is written only if
    there still is none (atomically); if another save committed the step meanwhile, this save's own
    generation directories (``token``'s) are deleted and ``CheckpointExistsError`` names the step.

    Else, for a re-save (``token``), the marker read just before is the one replaced: after the write,
    the directories it named (and the new marker does not) are deleted, only if the marker still
    holds ``marker`` (a save that committed since deletes what it replaced; ours are then left
    for ``gc``). A replaced marker that cannot be read, or names what it must not, has nothing deleted."""
    name = step + MARKER_SUFFIX
    if first:
        _commit_first(store, step, marker, token, suffixes)
        return
    previous: tuple[bytes, Any] | None = None
    if token is not None:
        try:
            previous = read_marker(store, step)
        except (DcpS3Error, OSError) as exc:
            log.warning("not deleting the parts of the replaced step %s: %s", store.url(step), exc)
    store.write(name, marker)
    if previous is None:
        return
    try:
        replaced = set(replaced_dirs(previous[1], step, suffixes, store.url(name)))
        replaced -= {f"{step}.{marker_entry(s, token)}" for s in suffixes}
        if replaced and store.read(name) == marker:
            n = delete_dirs(store, sorted(replaced))
            log.info("re-saved step %s: deleted %d objects of the parts it replaced", store.url(step), n)
    except (DcpS3Error, OSError) as exc:  # the step is saved; what is left over is gc's
        log.warning(
            "re-saved step %s, but could not delete the parts it replaced (`dcp-s3 gc` removes them later): %s",
            store.url(step),
            exc,
        )


def _commit_first(store: Store, step: str, marker: bytes, token: str | None, suffixes: list[str]) -> None:
    taken = commit.publish(store.object_store, store.key(step + MARKER_SUFFIX), marker)
    if taken is None:  # ours (also when a retried PUT found its own first attempt's bytes)
        return
    lost = (
        f"step {store.url(step)} was committed by another save while this first save of it ran (two jobs "
        "saving the same step): the step is the other save, every part of it; this save is not stored"
    )
    if taken.unreadable is not None:  # which save holds the step is unknown: delete nothing
        raise CheckpointExistsError(f"{lost} (its marker could not be read back: {taken.unreadable})")
    mine = [f"{step}.{marker_entry(s, token)}" for s in suffixes] if token is not None else []
    try:  # named by this save's token alone: never by the marker that won
        delete_dirs(store, mine)
        left = "its parts were deleted"
    except (DcpS3Error, OSError) as exc:
        left = f"its parts {mine} are left for `dcp-s3 gc` ({exc})"
    raise CheckpointExistsError(f"{lost}, {left}")


def _parts_committed(store: Store, step: Step) -> bool:
    """Whether every part of ``step`` has its ``.metadata``. A part without one counts only if it holds
    an object: some servers (SeaweedFS) keep listing a directory whose objects were all deleted. A part
    that the marker's ``part_dirs`` names always needs its ``.metadata``."""
    if step.error:
        return False
    return all(
        store.size(f"{p.name}/{METADATA_KEY}") is not None or (not step.named and not store.list_objects(p.name + "/"))
        for p in step.parts.values()
    )


def find_complete(
    store: Store,
    count: int | None = 1,
    unreadable: dict[str, str] | None = None,
    names: re.Pattern[str] | None = None,
) -> list[Step]:
    """The newest ``count`` (None: all) complete manager steps directly under the root, oldest first;
    with ``names``, only steps whose name it matches in full (a resume considers only the names its own
    scheme makes: :data:`dcp_s3._checkpointer.names.CHECKPOINTER_STEPS`).

    As :func:`complete_steps` over a full listing, at the cost of one delimiter listing of the root
    and a HEAD of each part's ``.metadata`` for the steps with a marker, newest first, until ``count``
    are found (steps named other than by a number are ordered by marker time: then all are checked).
    The steps' ``parts`` hold no objects. A step with generation directories (every save since first
    saves have them, see the module docstring) also costs a GET of its marker, whose ``part_dirs`` names
    its parts. A step whose marker cannot be followed is not complete; ``unreadable`` (if given) gets why.
    """

    def complete(step: Step) -> bool:
        settle(store, [step])  # a GET of the marker if the step has generation directories
        if step.error and unreadable is not None:
            unreadable[step.name] = step.error
        return _parts_committed(store, step)

    candidates = [s for s in root_steps(store) if s.marker is not None and (names is None or names.fullmatch(s.name))]
    if candidates and all(s.iteration is not None for s in candidates):
        found: list[Step] = []
        for step in reversed(ordered(candidates)):
            if count is not None and len(found) >= count:
                break
            if complete(step):
                found.append(step)
        return found[::-1]
    done = ordered(s for s in candidates if complete(s))
    return done if count is None else done[len(done) - count :] if count else []
