"""The one commit primitive: publish a marker once, read it back as untrusted input, delete marker first.

Every save that dcp_s3 commits has the shape of orbax's commit file: its objects are written under names that
hold a token new to the save (:func:`dcp_s3._layout.new_token`), so a save never touches another's objects, and
then one object — the *marker* (a ``.metadata``, a Checkpointer step's ``<step>.pth``, NeMo's
``dcp_s3_commit.json``, torch_checkpointing's ``.dcp_s3-commit``) — names exactly the objects of that save.
The checkpoint exists once the marker does. This module is the only code that writes a marker *only if absent*
and the only reader that turns a stored marker into names to load:

- :func:`publish` — one conditional PUT (``If-None-Match: *`` on S3, an exclusive link on disk) of the marker.
  Refused because a marker is there, it reads that marker back: the same bytes are this save's own commit (a
  retried PUT whose first attempt landed), other bytes are another save's (:class:`Taken`). Where a server
  ignores ``If-None-Match`` (``conditional=False``), a HEAD first is the best a writer can do.
- :func:`read_marker`, :func:`load_json`, :func:`check_token`, :func:`check_name`, :func:`check_one_save` — a
  stored marker is untrusted: bounded in size before it is read, decoded with every decoding error a
  ``CheckpointFormatError`` naming it, its save token in the format the writer makes, each name it holds a
  relative name of ASCII components (no ``.``/``..``, no separator games), and every part it names one of
  that save's (one save per load: never a mix of two saves' objects).
- :func:`retire` — deletion of a committed checkpoint that its caller's ownership rule allowed
  (:mod:`dcp_s3._checkpointer.ownership` decides): the marker first, so a half-deleted checkpoint is never
  taken for one, then every object below it.

The formats of the markers are their users' (each keeps its own byte layout, so every stored checkpoint reads
as before); this module holds what a commit *does*. It works on the object-store interface
(:class:`dcp_s3._objstore.base.ObjectStore`) and keys, so every layer above can use it. A test
(``tests/test_commit_fence.py``) fails if any other module of dcp_s3 writes an object only if absent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dcp_s3._layout import is_token
from dcp_s3._objstore.base import ObjectStore
from dcp_s3.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
)

__all__ = [
    "MAX_MARKER_BYTES",
    "NAME_COMPONENT",
    "Taken",
    "publish",
    "read_marker",
    "load_json",
    "check_token",
    "is_clean_name",
    "check_name",
    "check_one_save",
    "retire",
]

#: The largest marker :func:`read_marker` reads unless its caller bounds it more tightly.
MAX_MARKER_BYTES = 64 << 20
#: One component of a name a marker may hold: ASCII letters, digits, ``_``, ``.``, ``-``; not ``.``/``..``.
NAME_COMPONENT = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*")
_HEX32 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Taken:
    """Why :func:`publish` did not publish: another save's marker holds the key. ``unreadable``: the
    marker there could not be read back (which save holds the key is then unknown)."""

    unreadable: BaseException | None = None


def publish(store: ObjectStore, key: str, body: bytes, *, conditional: bool = True) -> Taken | None:
    """Publish ``body`` as the marker ``key`` if no marker is there; None once it is this save's, else
    :class:`Taken`.

    ``conditional`` (the server enforces ``If-None-Match``): one conditional PUT, atomic. Else a HEAD first
    and a plain PUT (best effort: the caller warned at planning). A refused PUT reads the marker back: the
    same bytes are this save's own (a retried PUT whose first attempt landed). Errors of the PUT itself (a
    transfer failure) are raised."""
    if not conditional and store.head(key) is not None:
        return Taken()
    try:
        store.put(key, body, if_none_match=conditional)
        return None
    except CheckpointExistsError:
        pass
    try:
        if store.get(key) == body:
            return None
    except (DcpS3Error, OSError) as exc:
        return Taken(exc)
    return Taken()


def read_marker(store: ObjectStore, key: str, *, max_bytes: int = MAX_MARKER_BYTES, head: bool = True) -> bytes | None:
    """The bytes of the marker ``key``, or None if there is none (also when it is deleted while read).
    ``CheckpointFormatError`` if it is larger than ``max_bytes``: checked by a HEAD before it is read, or with
    ``head=False`` (one request) after a GET, which the object store bounds by its ``max_whole_read``."""
    if head:
        info = store.head(key)
        if info is None:
            return None
        if info.size > max_bytes:
            raise CheckpointFormatError(f"{store.url(key)}: {info.size} bytes, more than a marker's {max_bytes}")
    try:
        data = store.get(key)
    except CheckpointNotFoundError:
        return None
    if len(data) > max_bytes:  # without a HEAD, or replaced by a larger one since
        raise CheckpointFormatError(f"{store.url(key)}: {len(data)} bytes, more than a marker's {max_bytes}")
    return data


def load_json(data: bytes, where: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The JSON object ``data`` (a marker at ``where``); with ``keys``, exactly those keys.
    ``CheckpointFormatError`` naming ``where`` for anything else."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise CheckpointFormatError(f"{where}: not a JSON document ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{where}: not a JSON object")
    if keys is not None and set(doc) != set(keys):
        raise CheckpointFormatError(f"{where}: expected the keys {', '.join(keys)}")
    return doc


def check_token(value: object, where: str, *, digits: int = 16) -> str:
    """``value`` if it is a save token as dcp_s3 makes them: 16 lowercase hex digits
    (:func:`dcp_s3._layout.new_token`), or 32 for the ids torch_checkpointing's commit has always stored."""
    ok = is_token(value) if digits == 16 else isinstance(value, str) and _HEX32.fullmatch(value) is not None
    if not ok:
        raise CheckpointFormatError(f"{where}: {str(value)[:40]!r} is not a save token ({digits} hex digits)")
    return value  # type: ignore[return-value]


def is_clean_name(name: object, *, max_len: int = 512, component: re.Pattern[str] = NAME_COMPONENT) -> bool:
    """Whether ``name`` is a relative name of at most ``max_len`` characters whose every component matches
    ``component`` (ASCII: :data:`NAME_COMPONENT` unless told) and is not ``.`` or ``..``: a key made from it
    stays below its checkpoint."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= max_len
        and all(component.fullmatch(c) and c not in (".", "..") for c in name.split("/"))
    )


def check_name(name: object, where: str, *, max_len: int = 512, component: re.Pattern[str] = NAME_COMPONENT) -> str:
    """``name`` if :func:`is_clean_name`, else ``CheckpointFormatError`` naming ``where``."""
    if not is_clean_name(name, max_len=max_len, component=component):
        raise CheckpointFormatError(f"{where}: {str(name)[:80]!r} is not a relative name of ASCII components")
    return name  # type: ignore[return-value]


def check_one_save(owners: Mapping[str, object], saves: Iterable[object], where: str) -> None:
    """One save per load: every part of ``owners`` (part -> the save or writer it names) belongs to one of
    ``saves`` (the marker's own); else ``CheckpointFormatError`` naming the first that does not."""
    allowed = set(saves)
    for part, owner in owners.items():
        if owner not in allowed:
            raise CheckpointFormatError(f"{where}: {str(part)[:80]!r} belongs to no save this marker commits")


def retire(store: ObjectStore, markers: Iterable[str], rest: Iterable[str] = (), *, prefix: str | None = None) -> int:
    """Delete the markers ``markers`` (keys), then the keys ``rest`` and — with ``prefix`` — every object whose key
    starts with it (listed once the markers are gone). The caller's ownership rule decided that the checkpoint may
    go; the markers go first, so what is left of a deletion that failed half-way is never taken for a checkpoint.
    Returns the number of objects deleted after the markers. A ``prefix`` must end with ``/``: ``step_1`` would also
    reach ``step_10``'s objects (``ConfigError``, nothing deleted)."""
    if prefix is not None and not prefix.endswith("/"):
        raise ConfigError(f"retire(prefix={prefix!r}): a directory's prefix ends with '/' (else it reaches siblings)")
    markers = list(markers)
    if markers:
        store.delete(markers)
    rest = list(rest)
    if prefix is not None:
        rest += [o.key for o in store.list_objects(prefix) if not o.key.endswith("/")]
    if rest:
        store.delete(rest)
    return len(rest)
