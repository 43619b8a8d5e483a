"""The on-store layout of the checkpoint manager, and how to find steps in a listing.

A *step* saved by :class:`dcp_s3._checkpointer.manager.Checkpointer` under a root is::

    <root>/<step>.<key>_model/   DCP checkpoint of model_dict[key]   (.metadata + __*_*.distcp,
                                 or p-<hex>/__*_*.distcp with ``key_prefixes``)
    <root>/<step>.<key>_optim/   DCP checkpoint of optimizer_dict[key]
    <root>/<step>.pth            torch.save of iteration, scheduler/scaler/callback state:
                                 written by rank 0 LAST, so it marks a complete step

A re-save of a complete step writes its parts to ``<root>/<step>.<key>_<kind>.<16 hex>/``
instead, named by the rewritten marker's ``part_dirs`` (:mod:`dcp_s3._checkpointer.generations`): a listing
puts such directories in ``Step.stale`` until :func:`dcp_s3._checkpointer.generations.settle` reads the marker.

Steps are recognized at any depth below the root (``run1/0000100`` when listing a bucket).

``<step>`` defaults to ``{iteration:07d}``. A ``<x>.<key>_model`` directory without a marker ``<x>.pth`` is a
step's part only when ``<x>`` is a name the Checkpointer makes (:data:`~dcp_s3._checkpointer.names.CHECKPOINTER_STEPS`);
otherwise it is a directory like any other (``llama.base_model``, a plain DCP checkpoint). A lone ``<step>.pth``
without parts is a legacy single-file checkpoint (``{"model": ..., "optimizer": ..., "iteration": ...}``).
Any other directory that directly holds ``.metadata`` or ``*.distcp`` objects is a plain
DCP checkpoint. ``*.distcp`` objects in a ``p-<hex>`` directory (``S3StorageWriter(key_prefixes=N)``)
belong to the directory above it, unless that ``p-<hex>`` directory holds a ``.metadata`` itself.
Nothing here knows about S3 or torch.distributed. :func:`root_steps` lists the steps from one
delimiter listing of the root (``dcp_s3._checkpointer.generations.find_complete`` then checks the newest): its cost
grows with the number of steps, not of objects (:func:`scan` groups a full recursive listing, for
the tools that need every object).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from dcp_s3._checkpointer.names import CHECKPOINTER_STEPS, number
from dcp_s3._dcp.store import Entry, Store
from dcp_s3._layout import DATA_SUFFIX, METADATA_KEY, is_key_prefix_dir

__all__ = [
    "MARKER_SUFFIX",
    "MARKER_FORMAT",
    "Part",
    "Step",
    "scan",
    "ordered",
    "complete_steps",
    "part_name",
    "root_steps",
    "PART_SUFFIX_RE",
    "PROBE_PATTERN",
    "is_checkpoint_key",
    "is_checkpoint_object",
]

MARKER_SUFFIX = ".pth"
#: Value of the marker's ``"format"`` entry (a legacy single-file checkpoint has none).
MARKER_FORMAT = "dcp_s3.checkpointer/1"
#: A part's name within its step: ``<key>_model`` or ``<key>_optim``.
PART_SUFFIX_RE = re.compile(r"[^./]+_(?:model|optim)")
#: A part directory: ``<step>.<part>``, or a generation of a re-save ``<step>.<part>.<16 hex>``
#: (see :mod:`dcp_s3._checkpointer.generations`).
_PART_RE = re.compile(r"^(?P<step>.+)\.(?P<part>[^./]+_(?:model|optim))(?:\.(?P<gen>[0-9a-f]{16}))?$")


def part_name(step: str, key: str, kind: str) -> str:
    """``<step>.<key>_<kind>``: the DCP checkpoint of one model (kind ``model``) or optimizer (``optim``)."""
    return f"{step}.{key}_{kind}"


@dataclass
class Part:
    """One DCP checkpoint: a directory of objects, committed once its ``.metadata`` exists."""

    name: str  # relative to the root: "0000100.model_model", or "a/b" for a plain DCP checkpoint
    objects: list[Entry] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return any(o.name == _meta(self.name) for o in self.objects)

    @property
    def stored_bytes(self) -> int:
        return sum(o.size for o in self.objects)


@dataclass
class Step:
    """A step of the manager (``kind="step"``) or a plain DCP checkpoint (``kind="dcp"``)."""

    name: str
    kind: str
    marker: Entry | None = None
    parts: dict[str, Part] = field(default_factory=dict)  # by part suffix ("model_model") or "" for dcp
    #: Directories of this step that are not its parts: generation directories (``<step>.<part>.<hex>``)
    #: until :func:`dcp_s3._checkpointer.generations.settle` has read the marker, then those the marker does not name.
    stale: list[Part] = field(default_factory=list)
    #: Why the marker's ``part_dirs`` could not be followed (then the step is not complete).
    error: str = ""
    #: True once ``parts`` are the directories the marker's ``part_dirs`` names (each needs its ``.metadata``).
    named: bool = False

    @property
    def objects(self) -> list[Entry]:
        objs = [o for p in [*self.parts.values(), *self.stale] for o in p.objects]
        return objs + ([self.marker] if self.marker is not None else [])

    @property
    def complete(self) -> bool:
        """Marker present and every part committed (a plain DCP checkpoint: ``.metadata`` present)."""
        if self.kind == "dcp":
            return all(p.committed for p in self.parts.values())
        return self.marker is not None and not self.error and all(p.committed for p in self.parts.values())

    @property
    def stored_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def mtime(self) -> float:
        """When the marker was written; else when the newest object was."""
        if self.marker is not None:
            return self.marker.mtime
        return max((o.mtime for o in self.objects), default=0.0)

    @property
    def iteration(self) -> int | None:
        return number(self.name)


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a else b


def _meta(part: str) -> str:
    return f"{part}/{METADATA_KEY}" if part else METADATA_KEY


def _checkpoint_dir(directory: str, base: str, checkpoints: set[str]) -> str:
    """The directory whose checkpoint object ``<directory>/<base>`` belongs to.

    A data object in a key-prefix directory (``<ckpt>/p-<hex>/__*_*.distcp``) belongs to
    ``<ckpt>``; a ``p-<hex>`` directory holding its own ``.metadata`` is a checkpoint itself.
    """
    parent, _, last = directory.rpartition("/")
    if base.endswith(DATA_SUFFIX) and is_key_prefix_dir(last) and directory not in checkpoints:
        return parent
    return directory


def scan(entries: Iterable[Entry]) -> list[Step]:
    """Group a recursive listing (names relative to the root) into steps and DCP checkpoints."""
    entries = list(entries)
    checkpoints = {e.name.rpartition("/")[0] for e in entries if e.name.rpartition("/")[2] == METADATA_KEY}
    steps: dict[str, Step] = {}
    generations: dict[str, Part] = {}
    loose: dict[str, list[Entry]] = {}
    for entry in entries:
        directory, _, base = entry.name.rpartition("/")
        directory = _checkpoint_dir(directory, base, checkpoints)
        parent, _, last = directory.rpartition("/")
        match = _PART_RE.match(last) if directory else None
        if match:
            name = _join(parent, match["step"])
            step = steps.setdefault(name, Step(name, "step"))
            if match["gen"]:
                if directory not in generations:
                    step.stale.append(generations.setdefault(directory, Part(directory)))
                generations[directory].objects.append(entry)
            else:
                step.parts.setdefault(match["part"], Part(directory)).objects.append(entry)
        elif base.endswith(MARKER_SUFFIX) and len(base) > len(MARKER_SUFFIX):
            name = entry.name[: -len(MARKER_SUFFIX)]
            steps.setdefault(name, Step(name, "step")).marker = entry
        else:
            loose.setdefault(directory, []).append(entry)
    out = []
    for step in steps.values():
        if step.marker is None and not CHECKPOINTER_STEPS.fullmatch(step.name.rpartition("/")[2]):
            # No marker and a name the Checkpointer does not make (``llama.base_model``): not a step's part but a
            # directory of its own, a plain DCP checkpoint if it holds one (never an "incomplete step" to gc).
            for part in [*step.parts.values(), *step.stale]:
                for entry in part.objects:
                    loose.setdefault(part.name, []).append(entry)
        else:
            out.append(step)
    for directory, objs in loose.items():
        names = {o.name.rpartition("/")[2] for o in objs}
        if METADATA_KEY in names or any(n.endswith(DATA_SUFFIX) for n in names):
            out.append(Step(directory, "dcp", parts={"": Part(directory, objs)}))
    return ordered(out)


def ordered(steps: Iterable[Step]) -> list[Step]:
    """Oldest first: by iteration number when every name is a number, else by marker time."""
    steps = list(steps)
    if steps and all(s.iteration is not None for s in steps):
        return sorted(steps, key=lambda s: (s.iteration, s.name))
    return sorted(steps, key=lambda s: (s.mtime, s.name))


def complete_steps(steps: Iterable[Step]) -> list[Step]:
    """Complete manager steps directly under the root (not nested, not plain DCP checkpoints), oldest first
    (for re-saved steps, pass steps that :func:`dcp_s3._checkpointer.generations.settle` has seen)."""
    return ordered(s for s in steps if s.kind == "step" and s.complete and "/" not in s.name)


def root_steps(store: Store) -> list[Step]:
    """Manager steps directly under the root, from one delimiter listing: markers, and part
    directories (``<step>.<key>_model/``) whose objects are not listed (``Part.objects`` empty)."""
    objects, dirs = store.list_dir("")
    steps: dict[str, Step] = {}
    for entry in objects:
        if entry.name.endswith(MARKER_SUFFIX) and len(entry.name) > len(MARKER_SUFFIX):
            name = entry.name[: -len(MARKER_SUFFIX)]
            steps.setdefault(name, Step(name, "step")).marker = entry
    for directory in (d.rstrip("/") for d in dirs):
        match = _PART_RE.match(directory)
        if match:
            step = steps.setdefault(match["step"], Step(match["step"], "step"))
            if match["gen"]:
                step.stale.append(Part(directory))
            else:
                step.parts[match["part"]] = Part(directory)
    return list(steps.values())


#: Name of the writer's capability probe (``.dcp_s3-probe.<token>``); one left by a crash is garbage.
PROBE_PATTERN = re.compile(r"\.dcp_s3-probe\.[0-9a-f]+")


def is_checkpoint_key(name: str) -> bool:
    """True if ``name``'s last component is named like a checkpoint object (wherever it lies)."""
    base = name.rpartition("/")[2]
    return base == METADATA_KEY or base.endswith(DATA_SUFFIX) or PROBE_PATTERN.fullmatch(base) is not None


def is_checkpoint_object(part_dir: str, name: str) -> bool:
    """True if ``name`` (relative to the store root) is an object the DCP checkpoint at ``part_dir`` consists of."""
    rel = name[len(part_dir) + 1 :] if part_dir else name
    if part_dir and not name.startswith(part_dir + "/"):
        return False
    sub, _, base = rel.rpartition("/")
    if sub and not ("/" not in sub and is_key_prefix_dir(sub) and base.endswith(DATA_SUFFIX)):
        return False
    return is_checkpoint_key(base)
