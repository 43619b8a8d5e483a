"""The integrations' one lookup of "which checkpoints are committed, and which is the latest".

Every integration that resumes or retains (torchtitan's step folder, NeMo's ``epoch_<E>_step_<S>``, Lightning's
``*.ckpt``, torch_checkpointing's ``checkpoint_names``) asks the same question of the store: which directories
directly in a folder carry a name of its scheme (:mod:`dcp_s3._checkpointer.ownership`; ASCII digits only,
:mod:`dcp_s3._checkpointer.names`) and hold their commit marker (``.metadata`` unless told). The answer comes from
one listing and one HEAD per name, newest first for :func:`latest` (it stops at the first committed one).

Absent only on proof: a name counts as not committed when its marker is a 404, or when ``accept`` (the caller's
check of its own marker, such as NeMo's commit document) answers False for it (a malformed marker, warned by the
caller). Anything else — a 500, a timeout, a refused connection on the marker or the listing — raises
(``S3TransferError`` naming the key): a lookup never answers an older checkpoint (a rollback) or one fewer (a
retention deleting the wrong one) because the newest could not be read.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from dcp_s3._checkpointer.names import DIGITS
from dcp_s3._checkpointer.ownership import Ownership
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY

__all__ = ["ANY_NAME", "step_order", "listed", "committed", "latest"]

#: A scheme taking any one directory name (a lookup that is not a deletion: Lightning's ``list_checkpoints``).
ANY_NAME = re.compile(r"[^/]+")
_NUMBER = re.compile(DIGITS)


def step_order(name: str) -> list[int]:
    """The ASCII numbers in ``name``, in order: sorts ``step_10`` after ``step_9`` and ``epoch_1_step_2`` after
    ``epoch_0_step_9``."""
    return [int(n) for n in _NUMBER.findall(name)]


def _owns(scheme: Ownership | re.Pattern[str], name: str, within: str) -> bool:
    if isinstance(scheme, Ownership):  # the name relative to the ownership's root (the store's)
        return scheme.owns(name)
    return within not in (".", "..") and scheme.fullmatch(within) is not None


def listed(
    store: Store, scheme: Ownership | re.Pattern[str], folder: str = "", *, order: Callable[[str], object] = step_order
) -> list[str]:
    """The directories directly in ``folder`` (relative to ``store``'s root; ``""``: the root) whose name the
    scheme takes, committed or not, oldest first by ``order``; names relative to the root. An :class:`Ownership`
    judges the name relative to the root (``folder`` included), a pattern the name within ``folder``."""
    lead = folder.strip("/") + "/" if folder.strip("/") else ""
    names = [(d.rstrip("/"), d[len(lead) :].rstrip("/")) for d in store.list_dir(lead)[1]]
    return sorted((name for name, within in names if _owns(scheme, name, within)), key=order)  # type: ignore[arg-type]


def _is_committed(store: Store, name: str, marker: str, accept: Callable[[str], bool] | None) -> bool:
    return store.size(f"{name}/{marker}") is not None and (accept is None or accept(name))


def committed(
    store: Store,
    scheme: Ownership | re.Pattern[str],
    folder: str = "",
    *,
    marker: str | None = None,
    order: Callable[[str], object] = step_order,
    accept: Callable[[str], bool] | None = None,
) -> list[str]:
    """The names of :func:`listed` whose ``marker`` (an :class:`Ownership`'s, else ``.metadata``) is in the store
    and that ``accept`` takes, oldest first."""
    marker = marker or (scheme.marker if isinstance(scheme, Ownership) else METADATA_KEY)
    return [n for n in listed(store, scheme, folder, order=order) if _is_committed(store, n, marker, accept)]


def latest(
    store: Store,
    scheme: Ownership | re.Pattern[str],
    folder: str = "",
    *,
    marker: str | None = None,
    order: Callable[[str], object] = step_order,
    accept: Callable[[str], bool] | None = None,
) -> str | None:
    """The newest name of :func:`committed` (asked newest first, stopping at the first), or None."""
    marker = marker or (scheme.marker if isinstance(scheme, Ownership) else METADATA_KEY)
    names = listed(store, scheme, folder, order=order)
    return next((n for n in reversed(names) if _is_committed(store, n, marker, accept)), None)
