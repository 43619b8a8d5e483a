"""The commit of a save (coordinator only): ``.metadata`` PUT last, then the objects it replaced deleted.

A checkpoint exists if and only if its ``.metadata`` does, and a save only ever creates objects no other save
uses (their names hold a token new to the save), so until the PUT here lands the checkpoint already at the path
is untouched and loads bit-exact.

- ``overwrite=True`` (:func:`commit_replacing`): the PUT replaces the old ``.metadata`` atomically; then the
  objects the old one used and the new one does not are deleted, but only while ``.metadata`` is still this
  save's. If another save committed after it, that save deletes what it replaced and this one's objects are
  left for ``dcp-s3 gc``. Two saves racing to one path each commit a complete ``.metadata`` naming only their
  own objects, so the result is one save's data, never a mix. Which objects the replaced checkpoint used is read
  from its ``.metadata`` and narrowed by :func:`dcp_s3._layout.replaceable_objects`; an unreadable one is
  replaced and its objects are left, not guessed.
- ``overwrite=False`` (:func:`commit_once`): :func:`dcp_s3._commit.publish`, a conditional PUT
  (``If-None-Match: *``) where the server enforces it, else a HEAD first (best effort, warned at planning); a
  save that finds a checkpoint committed meanwhile deletes its own objects and raises ``CheckpointExistsError``.

Deletes here are best effort: a failure is a ``RuntimeWarning`` naming how many objects were left for ``gc``.
"""

from __future__ import annotations

import logging
import warnings

from dcp_s3._commit import publish
from dcp_s3._dcp.session import Session
from dcp_s3._layout import METADATA_KEY, replaceable_objects
from dcp_s3._metadata.formats import load_metadata
from dcp_s3.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    DcpS3Error,
)

__all__ = ["commit_once", "commit_replacing", "delete_quietly", "exists_error"]

log = logging.getLogger(__name__)


def exists_error(checkpoint_id: str, advice: str) -> CheckpointExistsError:
    """The error of a save with ``overwrite=False`` that finds a checkpoint at ``checkpoint_id``."""
    # torch's FileSystemWriter says "Checkpoint already exists"; code written against it matches that text.
    return CheckpointExistsError(f"Checkpoint already exists at {checkpoint_id} and overwrite=False; {advice}")


def commit_replacing(session: Session, checkpoint_id: str, body: bytes, ours: set[str]) -> None:
    """``overwrite=True``: PUT ``body`` as ``.metadata``, then delete the objects of the checkpoint it
    replaced that ``ours`` (the objects ``body`` references) does not hold, while ``.metadata`` is still ours."""
    key = session.key(METADATA_KEY)
    replaced = _committed_objects(session, key) - ours
    etag = session.object_store.put(key, body)
    # Only while .metadata is still ours: a save that committed after us deletes what it replaced, ours then
    # left for gc.
    if replaced and _still_committed(session, key, etag, body):
        delete_quietly(session, checkpoint_id, sorted(replaced), "objects of the replaced checkpoint")


def commit_once(session: Session, checkpoint_id: str, body: bytes, ours: set[str], conditional: bool) -> None:
    """``overwrite=False``: PUT ``body`` as ``.metadata`` only if no checkpoint is there (``conditional``: by
    ``If-None-Match``, else by a HEAD first); else delete ``ours`` (this save's objects) and raise."""
    # Not conditional: a HEAD first, best effort (warned). A retried PUT whose first attempt did land finds
    # its own bytes (they hold this save's id): published.
    taken = publish(session.object_store, session.key(METADATA_KEY), body, conditional=conditional)
    if taken is None:
        return
    if taken.unreadable is not None:  # which save holds the path is unknown: delete nothing
        raise taken.unreadable
    delete_quietly(session, checkpoint_id, sorted(ours), "objects of a save that was not committed")
    advice = "another save committed it while this one was being written"
    raise exists_error(checkpoint_id, f"{advice}; this save was not committed" if conditional else advice)


def delete_quietly(session: Session, checkpoint_id: str, names: list[str], what: str) -> None:
    """Best-effort delete of ``names`` (relative to the checkpoint); a failure is a warning, not an error."""
    if not names:
        return
    try:
        session.object_store.delete([session.key(n) for n in names])
    except DcpS3Error as exc:
        warnings.warn(
            f"could not delete {len(names)} {what} under {checkpoint_id} ({exc}); `dcp-s3 gc` removes them later",
            RuntimeWarning,
            stacklevel=2,
        )


def _still_committed(session: Session, key: str, etag: str, body: bytes) -> bool:
    """Whether ``.metadata`` still holds ``body`` (this save's): by ETag, or by content where
    the server's HEAD carries none (the JuiceFS/MinIO gateway)."""
    head = session.object_store.head(key)
    if head is None:
        return False
    if head.etag and etag:
        return head.etag == etag
    try:
        return session.object_store.get(key) == body
    except CheckpointNotFoundError:
        return False


def _committed_objects(session: Session, key: str) -> set[str]:
    """The objects the checkpoint now committed at this path uses (empty if there is none)."""
    object_store = session.object_store
    try:
        data = object_store.get(key)  # one GET, no HEAD first: a 404 answers "no checkpoint" as well
    except BucketNotFoundError:
        raise
    except CheckpointNotFoundError:
        return set()
    try:
        return replaceable_objects(load_metadata(data, object_store.url(key)))
    except CheckpointFormatError as exc:
        # Unreadable: replace it, but leave its objects to ``dcp-s3 gc`` rather than guess.
        log.warning("not deleting the objects of the checkpoint being replaced: %s", exc)
        return set()
