"""The commit protocol behind torch_checkpointing's ``rename`` on S3: attempts, claims, markers, manifests.

torch_checkpointing stages a save under ``<parent>/tmp_<name>`` (every rank writes its files there),
meets at a barrier, and then rank 0 renames the staged directory onto ``<parent>/<name>``: that
rename is its commit. S3 has no rename, and copy+delete is neither atomic nor cheap, so the
directory never moves. Its objects are written, from the start, below the *final* name:

- every process of one job attempt shares an attempt id (:mod:`.attempts`: agreed through the process
  group's store, so a restarted job has a new one);
- a rank writing into the stage first claims its place in its attempt:
  ``<name>/.dcp_s3-staged/claims/<attempt>/rank-<r>``, created only if absent (``If-None-Match``), holding a
  writer id fresh for this claim; its files go to ``<name>/.dcp_s3-staged/<writer id>/<relative path>``
  (never overwritten by another writer);
- rank 0's ``rename`` is the commit: it reads the claims of *its* attempt (exactly one per rank
  ``0..world-1``), lists each of those writers' objects, and creates ``<name>/.dcp_s3-commit``
  (``If-None-Match``: an occupied destination is refused, never merged) — a JSON manifest naming a fresh
  save token, the writer of each rank, and each file's writer, size and ETag. Then it deletes the claims
  (this attempt's own);
- a reader resolves ``<name>/<file>`` through the marker it read when it looked at ``<name>``; the
  object key is rebuilt from the validated writer id and file name (under ``<name>/``, never a key
  taken from stored text), and the object's size and ETag must equal the manifest's. Every file of
  one load comes from one save, or the read is refused.

Claims and the marker are published, read back and deleted by :mod:`dcp_s3._commit`, the one commit primitive.

A save killed after a rank claimed its place leaves that claim and its writer's files. The job restarted
(a new attempt) claims places of its own and commits only its own writers' files: a dead attempt's
claims and files are never read, combined or deleted by inference. They stay below ``<name>/``, so
deleting the committed checkpoint (everything under ``<name>/``, marker first) removes them with it;
a stage that never committed is removed by a user (``dcp-s3 rm s3://.../<name>``). Within one attempt a
place is claimed once per storage: another storage's save of the same name after a failed one (a new
manager, in that process or another) finds its place held by another writer and refuses
(``CheckpointExistsError`` naming the stage). The storage whose save failed hands its own place to a fresh
writer when it saves the name again (:mod:`.writers`), so a writer's files are always one save's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from dcp_s3 import _commit as marker
from dcp_s3._checkpointer.names import number
from dcp_s3._dcp.store import Store
from dcp_s3._objstore.base import check_relative_name
from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError

__all__ = [
    "MARKER",
    "STAGED",
    "Manifest",
    "FileEntry",
    "claim",
    "claims",
    "commit",
    "holds",
    "reclaim",
    "is_staged",
    "read_manifest",
    "staged_key",
]

#: The commit marker, directly in the checkpoint's directory: the checkpoint exists once it does.
MARKER = ".dcp_s3-commit"
#: The directory of staged objects and claims, directly in the checkpoint's directory.
STAGED = ".dcp_s3-staged"
FORMAT = "dcp_s3.torch_checkpointing/1"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One committed file: the writer that wrote it, its size and ETag."""

    writer: str
    size: int
    etag: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one commit marker says: its save token, the writer of each rank, and every file."""

    save_token: str
    writers: dict[int, str]
    files: dict[str, FileEntry]

    def top_level(self, rel: str = "") -> list[str]:
        """The names directly in ``rel`` (``""``: the checkpoint's directory)."""
        lead = rel + "/" if rel else ""
        return sorted({f[len(lead) :].split("/", 1)[0] for f in self.files if f.startswith(lead)})

    def is_dir(self, rel: str) -> bool:
        return not rel or any(f.startswith(rel + "/") for f in self.files)


def staged_key(name: str, writer: str, rel: str) -> str:
    """The object name of ``rel`` written by ``writer`` for the checkpoint ``name``."""
    return f"{name}/{STAGED}/{writer}/{rel}"


def _claims_of(name: str, attempt: str) -> str:
    return f"{name}/{STAGED}/claims/{check_id(attempt)}/"


def _claim_name(name: str, rank: int, attempt: str) -> str:
    return f"{_claims_of(name, attempt)}rank-{rank}"


def new_writer() -> str:
    return uuid.uuid4().hex


def check_id(value: object) -> str:
    """``value`` if it is a writer, attempt or save id as dcp_s3 makes them (32 lowercase hex digits)."""
    return marker.check_token(value, "id", digits=32)


def claim(store: Store, name: str, rank: int, writer: str, attempt: str) -> bool:
    """Claim rank ``rank``'s place in ``attempt``'s stage of ``name`` for ``writer``; True if newly claimed.

    ``CheckpointExistsError`` if ``name`` is committed already, or another writer of this attempt holds
    the place (a save of ``name`` in this attempt that never committed)."""
    _refuse_committed(store, name)
    place = _claim_name(name, rank, attempt)
    body = _claim_body(rank, writer)
    if marker.publish(store.object_store, store.key(place), body) is None:
        return True
    try:
        held = _writer_of(store.read(place), store.url(place))
    except CheckpointNotFoundError:  # removed between the two requests: that save committed (or was removed)
        if marker.publish(store.object_store, store.key(place), body) is None:
            return True
        raise CheckpointExistsError(f"{store.url(place)} already exists") from None
    if held != writer:
        raise CheckpointExistsError(
            f"rank {rank} cannot save {store.url(name)}: {store.url(place)} belongs to writer {held}, a save of "
            f"that name in this job attempt ({attempt}) that never committed; its files are not mixed with this "
            f"save's. Save under the next step's name, or remove that stage (dcp-s3 rm {store.url(name)}) once no "
            "job writes there, then save again"
        )
    return False


def reclaim(store: Store, name: str, rank: int, old: str, writer: str, attempt: str) -> None:
    """Hand rank ``rank``'s place in ``attempt``'s stage of ``name`` from ``old`` to ``writer``: the next save of
    ``name`` by the process whose save under ``old`` never committed (only that process knows ``old``, a fresh
    id). A place ``old`` no longer holds is claimed as :func:`claim` does; ``old``'s files stay, never committed."""
    _refuse_committed(store, name)
    if holds(store, name, rank, old, attempt):
        store.write(_claim_name(name, rank, attempt), _claim_body(rank, writer), overwrite=True)
    else:
        claim(store, name, rank, writer, attempt)


def _refuse_committed(store: Store, name: str) -> None:
    if store.size(f"{name}/{MARKER}") is not None:
        raise CheckpointExistsError(
            f"{store.url(name)} is a committed checkpoint; delete it before saving that name again"
        )


def _claim_body(rank: int, writer: str) -> bytes:
    return json.dumps({"rank": rank, "writer": writer}).encode()


def holds(store: Store, name: str, rank: int, writer: str, attempt: str) -> bool:
    """Whether ``writer`` still holds rank ``rank``'s place in ``attempt``'s stage of ``name``."""
    try:
        return _writer_of(store.read(_claim_name(name, rank, attempt)), name) == writer
    except CheckpointNotFoundError:
        return False


def is_staged(store: Store, name: str) -> bool:
    """Whether any attempt claimed a place in the stage of ``name`` (and did not commit it)."""
    return any(True for _ in store.list_objects(f"{name}/{STAGED}/claims/"))


def claims(store: Store, name: str, attempt: str) -> dict[int, str]:
    """The writer of each rank that claimed a place in ``attempt``'s stage of ``name`` (other attempts' claims,
    a dead attempt's, are not read)."""
    found: dict[int, str] = {}
    lead = _claims_of(name, attempt)
    for entry in store.list_objects(lead):
        found_rank = number(entry.name[len(lead) :].removeprefix("rank-"))
        if found_rank is None:
            raise CheckpointFormatError(f"{store.url(entry.name)}: not a claim dcp_s3 writes")
        found[found_rank] = _writer_of(store.read(entry.name), store.url(entry.name))
    return found


def commit(
    store: Store, name: str, world_size: int, attempt: str, expected: Mapping[str, set[str]] | None = None
) -> Manifest:
    """Commit ``attempt``'s stage of ``name`` (rank 0, after every rank finished writing): the marker, then this
    attempt's claims removed. Refuses (``CheckpointExistsError``) an occupied destination and
    (``CheckpointFormatError``) a stage whose claims in ``attempt`` are not one writer per rank ``0..world_size-1``,
    or one whose listing lacks a file of ``expected`` (writer -> the files the caller knows it wrote in this save):
    the marker then is never written."""
    writers = claims(store, name, attempt)
    if sorted(writers) != list(range(world_size)):
        raise CheckpointFormatError(
            f"cannot commit {store.url(name)}: job attempt {attempt} holds claims of ranks {sorted(writers)} in its "
            f"stage, not of each of the {world_size} ranks of this save (a rank wrote nothing); claims of other "
            "attempts are never used"
        )
    files: dict[str, FileEntry] = {}
    for rank, writer in sorted(writers.items()):
        lead = store.key(f"{name}/{STAGED}/{writer}/")
        for obj in store.object_store.list_objects(lead):
            rel = check_relative_name(obj.key[len(lead) :], store.url(f"{name}/{STAGED}/{writer}"))
            if rel in files:
                raise CheckpointFormatError(
                    f"cannot commit {store.url(name)}: ranks {rank} and another both wrote {rel!r}"
                )
            files[rel] = FileEntry(writer, obj.size, obj.etag)
    for writer, rels in (expected or {}).items():
        missing = sorted(rel for rel in rels if files.get(rel, FileEntry("", 0, "")).writer != writer)
        if writer not in writers.values() or missing:
            raise CheckpointFormatError(
                f"cannot commit {store.url(name)}: files of this save are not in its stage under writer {writer} "
                f"({', '.join(missing) or 'its claim is gone'}); the commit would not name them, so nothing is "
                "committed"
            )
    manifest = Manifest(uuid.uuid4().hex, dict(writers), files)
    body = {
        "format": FORMAT,
        "save_token": manifest.save_token,
        "writers": {str(r): w for r, w in writers.items()},
        "files": {rel: [e.writer, e.size, e.etag] for rel, e in files.items()},
    }
    if marker.publish(store.object_store, store.key(f"{name}/{MARKER}"), json.dumps(body, sort_keys=True).encode()):
        raise CheckpointExistsError(
            f"refusing to commit onto {store.url(name)}: a checkpoint is committed there already"
        )
    store.delete([_claim_name(name, r, attempt) for r in writers])
    return manifest


def read_manifest(store: Store, name: str) -> Manifest | None:
    """The commit marker of ``name``, validated (it is untrusted input), or None if ``name`` is not committed."""
    where = store.url(f"{name}/{MARKER}")
    raw = marker.read_marker(store.object_store, store.key(f"{name}/{MARKER}"), head=False)  # one GET, as before
    if raw is None:
        return None
    try:
        body = marker.load_json(raw, where)
        if body.get("format") != FORMAT:
            raise CheckpointFormatError(f"format {body.get('format')!r}")
        writers = {int(r): check_id(w) for r, w in body["writers"].items()}
        files, owners = {}, {}
        for rel, (writer, size, etag) in body["files"].items():
            if not isinstance(size, int) or size < 0 or not isinstance(etag, str):
                raise CheckpointFormatError(f"entry {rel!r}")
            owners[rel] = writer
            files[check_relative_name(rel, where)] = FileEntry(writer, size, etag)
        marker.check_one_save(owners, writers.values(), where)
        return Manifest(check_id(body["save_token"]), writers, files)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointFormatError(f"{where} is not a commit marker dcp_s3 writes: {exc}") from exc


def _writer_of(raw: bytes, where: str) -> str:
    try:
        return check_id(marker.load_json(raw, where)["writer"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{where} is not a claim dcp_s3 writes: {exc}") from exc
