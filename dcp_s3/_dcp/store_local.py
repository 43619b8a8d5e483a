"""The local-disk side of :class:`dcp_s3._dcp.store.Store`: paths, and the symbolic-link policy."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from dcp_s3._dcp.options import Settings
from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._dcp.session import LocalDir, Session
from dcp_s3._dcp.store import Store
from dcp_s3._dcp.writer import S3StorageWriter
from dcp_s3._objstore.base import check_relative_name

__all__ = ["LocalStore"]


class LocalStore(Store):
    """Files under a local directory (which need not exist yet).

    Names from elsewhere (object keys) are checked by
    :func:`~dcp_s3._objstore.base.check_relative_name` before they
    become paths. Below the root no symbolic link is followed (see :mod:`dcp_s3._objstore.local`):
    reads refuse a link where a directory or an object should be, writes and deletes never act
    through one. ``follow_symlinks`` (a tree the user trusts, ``dcp-s3 cp --follow-symlinks``):
    listings descend into linked directories and reads follow links; writes and deletes still
    never do. :meth:`links_out` tells which paths resolve outside the root.
    ``below`` (a clean relative directory name): the store's objects are those under ``<root>/<below>``,
    and ``below`` is walked as part of every key, so a link there is refused like any other below the
    root (the local tier's rank directories: :mod:`dcp_s3._checkpointer.local_root`).
    Checkpoints here are written and read by ``S3StorageWriter``/``S3StorageReader`` through
    the local object store: same format, checksums, compression and commit protocol as on S3.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        follow_symlinks: bool = False,
        below: str = "",
        options: Settings | None = None,
        **keywords: Any,
    ) -> None:
        root = os.path.abspath(os.fspath(root))
        settings = Settings.of(options, **keywords)  # a bad option is refused now
        settings.check_local(root)  # and one that means nothing on disk (S3's: client, parts)
        self.follow_symlinks = follow_symlinks
        session = Session(None, settings.client, settings.transfer)
        session.location = LocalDir(root, follow_symlinks=follow_symlinks)
        prefix = check_relative_name(below, root) if below else ""
        super().__init__(session, prefix, root, options=settings)

    def path(self, name: str) -> str:
        return self.url(name)

    def writer(self, name: str, *, overwrite: bool | None = None) -> S3StorageWriter:
        """A DCP storage writer for ``name``, its store rooted here: the directories from this root
        down to the checkpoint (a step's part directory) are never followed through a link either."""
        writer = super().writer(name, overwrite=overwrite)
        writer._session.anchor_local(self.root)
        return writer

    def reader(self, name: str, kind: type[S3StorageReader] = S3StorageReader) -> S3StorageReader:
        """A DCP storage reader for ``name``, rooted here like :meth:`writer`'s."""
        reader = super().reader(name, kind)
        reader._session.anchor_local(self.root)
        return reader

    def links_out(self, names: Iterable[str] = ("",)) -> list[tuple[str, str]]:
        """(path, real target) of every symbolic link at or under ``names`` (files or directories,
        existing or not: the nearest existing ancestor counts) that resolves outside the root."""
        real_root = os.path.realpath(self.root)

        def outside(path: str) -> str | None:
            real = os.path.realpath(path)
            return None if os.path.commonpath([real, real_root]) == real_root else real

        found: dict[str, str] = {}
        for name in names:
            top = self.path(name)
            target = outside(top)
            if target is not None:
                link = top
                while os.path.dirname(link) != link and outside(os.path.dirname(link)) is not None:
                    link = os.path.dirname(link)  # report the link itself, not a path below it
                found[link] = os.path.realpath(link)
                continue
            for dirpath, dirnames, filenames in os.walk(top):
                for entry in dirnames + filenames:
                    path = os.path.join(dirpath, entry)
                    if os.path.islink(path) and (target := outside(path)) is not None:
                        found[path] = target
        return sorted(found.items())
