"""Where a torch_checkpointing path lies for :class:`dcp_s3.integrations.torch_checkpointing.S3Storage`.

torch_checkpointing hands its storage ``pathlib.Path`` objects: the checkpoint id it was given (an
``s3://`` URL, which ``pathlib`` folds to ``s3:/``, or a name relative to the storage's root), the staged
directory ``<parent>/<temp_dir_prefix><name>`` its writer derives from it, and the files in either. Each
path is one of three places (:class:`Where`):

- a **stage**: a part starting with the temp prefix; its files live below the *final* name
  (:mod:`dcp_s3.integrations.torch_checkpointing.commit`);
- in a **committed** checkpoint: an ancestor (or the path itself) has a commit marker; the path itself
  re-reads the marker (a load looks at the directory first), a file below one read before uses that read;
- **plain**: anything else, an object or a prefix as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dcp_s3._dcp.store import Store
from dcp_s3.errors import InvalidCheckpointIdError
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations.torch_checkpointing import commit as tc_commit
from dcp_s3.integrations.torch_checkpointing.commit import MARKER, STAGED, Manifest

__all__ = ["Where", "split", "in_stage", "locate", "contents", "shown"]

_INTERNAL = (MARKER, STAGED)


@dataclass(frozen=True, slots=True)
class Where:
    """A path's place: ``kind`` "stage" (``name`` the final name), "committed" (``name`` the checkpoint) or
    "plain" (``name`` the object/prefix); ``rest`` the path below ``name`` ("" for ``name`` itself)."""

    kind: str
    name: str
    rest: str = ""
    manifest: Manifest | None = None


def split(path: Path | str, root: str) -> list[str]:
    """``path``'s parts relative to ``root``; refuses paths elsewhere, ``..`` and dcp_s3's own names."""
    text = s3_location(path) or os.fspath(path)  # pathlib folds "s3://" into "s3:/"
    if "://" in text or root.startswith("/") and text.startswith("/"):
        if text.rstrip("/") != root and not text.startswith(root + "/"):
            raise InvalidCheckpointIdError(f"{text!r} is not under this storage's root {root!r}")
        text = text[len(root) :]
    elif text.startswith("/"):
        raise InvalidCheckpointIdError(f"{text!r}: give an s3:// URL under {root!r} or a name relative to it")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts or any(p in _INTERNAL for p in parts):
        raise InvalidCheckpointIdError(f"{os.fspath(path)!r}: '..' and dcp_s3's own names are not paths here")
    return parts


def in_stage(parts: list[str], temp_prefix: str) -> Where | None:
    """The stage ``parts`` lie in (no request), or None."""
    for i, part in enumerate(parts):
        if part.startswith(temp_prefix) and len(part) > len(temp_prefix):
            final = "/".join([*parts[:i], part[len(temp_prefix) :]])
            return Where("stage", final, "/".join(parts[i + 1 :]))
    return None


def locate(parts: list[str], temp_prefix: str, manifests: dict[str, Manifest], store: Store) -> Where:
    """Where ``parts`` lie; ``manifests`` caches the markers read (checkpoint name -> manifest)."""
    stage = in_stage(parts, temp_prefix)
    if stage is not None:
        return stage
    for i in range(1, len(parts)):  # a file of a checkpoint looked at before: no request
        found = manifests.get("/".join(parts[:i]))
        if found is not None:
            return Where("committed", "/".join(parts[:i]), "/".join(parts[i:]), found)
    for i in range(1, len(parts) + 1):
        name = "/".join(parts[:i])
        manifest = tc_commit.read_manifest(store, name)
        if manifest is not None:
            manifests[name] = manifest
            return Where("committed", name, "/".join(parts[i:]), manifest)
        manifests.pop(name, None)
    return Where("plain", "/".join(parts))


def contents(store: Store, name: str) -> tuple[bool, bool, bool]:
    """(has a commit marker, holds plain objects or directories, holds a stage) for the directory ``name``: one
    delimiter listing."""
    objects, dirs = store.list_dir(name + "/")
    marker = any(entry.name == f"{name}/{MARKER}" for entry in objects)
    staged = any(d.rstrip("/") == f"{name}/{STAGED}" for d in dirs)
    plain = len(objects) > int(marker) or len(dirs) > int(staged)
    return marker, plain, staged


def shown(store: Store, name: str, temp_prefix: str) -> list[str]:
    """How the directory ``name`` appears in its parent's listing: its name once committed or if it holds plain
    objects, ``<temp_prefix><name>`` while a stage is claimed; nothing for what a deletion left."""
    marker, plain, staged = contents(store, name)
    base = name.rsplit("/", 1)[-1]
    listed = [base] if marker or plain else []
    if not marker and staged and tc_commit.is_staged(store, name):
        listed.append(temp_prefix + base)
    return listed
