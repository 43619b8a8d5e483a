"""The local tier's root: which of its entries are rank directories of ours, and what may be named a step there.

A tiered Checkpointer's local root (``Checkpointer(..., local_root=...)``, chosen by the user: it may itself be a
link) holds one directory per rank, ``rank<NNNNN>/``, which dcp_s3 creates and names. So an entry of that name
that is a symbolic link (or anything but a directory) was not made by dcp_s3: it is hostile, or a mistake, and
every path of the tier treats it the same way (:func:`rank_dir_problem` decides, everything else asks it):

* a save refuses, naming it (nothing is written through it);
* a load, normal or resharded, reads nothing through it (that rank has no local copy, and says why);
* ``keep_last_local`` deletes nothing through it;
* ``dcp-s3 ls`` of the root reports it and lists nothing below it.

Beyond that check, each rank directory is opened as a store rooted at the local root with the rank directory as
part of every key (:func:`rank_store`), so the object store's own rule — below its root nothing is followed
through a link (:mod:`dcp_s3._objstore.local`) — covers the rank directory too, even one swapped in after the check.
Inside a rank directory, a link in place of a step's directory or file is refused by that same rule.

``keep_last_local`` deletes only steps named as the tier names them (``{iteration:07d}``, decided by
:mod:`dcp_s3._checkpointer.ownership` like every deletion), never another checkpoint that happens to lie in a rank
directory.
"""

from __future__ import annotations

import os
import re
import stat

from dcp_s3._dcp import Store
from dcp_s3._dcp.store_local import LocalStore

__all__ = ["RANK_DIR_RE", "rank_dir", "rank_dir_problem", "rank_dirs", "rank_store"]

#: The name of a rank directory under a local root: exactly ``rank_dir``'s outputs (five digits, zero-padded,
#: or more without a leading zero from rank 100000 on).
RANK_DIR_RE = re.compile(r"rank([0-9]{5}|[1-9][0-9]{5,})")


def rank_dir(rank: int) -> str:
    """The directory of rank ``rank`` under a local root."""
    return f"rank{rank:05d}"


def rank_dir_problem(local_root: str, name: str) -> str | None:
    """Why ``<local_root>/<name>`` is not a rank directory of ours (a symbolic link, or not a directory), or
    None: a real directory, or nothing yet (a save creates it)."""
    path = os.path.join(local_root, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be examined: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return (
            f"{path} is a symbolic link (to {target}); the local tier's rank directories are made by dcp_s3, "
            "never links: nothing is read, written or deleted through it (replace it with a directory)"
        )
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory; the local tier's rank directories are made by dcp_s3"
    return None


def rank_dirs(local_root: str) -> tuple[dict[int, Store], dict[int, str]]:
    """(the rank directories of ours under ``local_root``, by rank, each as :func:`rank_store`; why each other
    entry named like one is not ours, by rank). Both empty if ``local_root`` is not a directory."""
    ours: dict[int, Store] = {}
    refused: dict[int, str] = {}
    try:
        with os.scandir(local_root) as it:
            names = sorted(e.name for e in it)
    except (FileNotFoundError, NotADirectoryError):
        return ours, refused
    for name in names:
        m = RANK_DIR_RE.fullmatch(name)
        if m is None:
            continue
        why = rank_dir_problem(local_root, name)
        if why is None:
            ours[int(m.group(1))] = rank_store(local_root, int(m.group(1)))
        else:
            refused[int(m.group(1))] = why
    return ours, refused


def rank_store(local_root: str, rank: int) -> Store:
    """Rank ``rank``'s directory under ``local_root`` as a store rooted at ``local_root`` (module docstring):
    nothing is followed through a link from the local root down, the rank directory included."""
    return LocalStore(local_root, below=rank_dir(rank))
