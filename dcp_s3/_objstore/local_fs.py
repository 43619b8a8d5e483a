"""What :mod:`dcp_s3._objstore.local` does to the file system: below its root, never through a link.

:class:`Dirs` opens the directory holding a key by walking its components from a descriptor
of the root, each with ``O_DIRECTORY | O_NOFOLLOW`` (``dir_fd=`` the one before), creating
them (``mkdir(dir_fd=...)``) for writes. Every later step (create the temporary file, rename,
link, unlink, ``fstat``) then acts relative to that descriptor, so a link swapped in after a
check changes nothing: the name it replaced is looked up again in the directory already
opened, never resolved through the link. :func:`os_errors` turns every ``OSError`` into the
:mod:`dcp_s3.errors` class of the same builtin, naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dcp_s3.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    S3AccessDeniedError,
    S3TransferError,
)

__all__ = ["Dirs", "new_temp", "unlink_quietly", "os_errors", "wrap_os_error", "TMP_PREFIX"]

TMP_PREFIX = ".tmp-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def wrap_os_error(exc: OSError, action: str, where: str) -> DcpS3Error:
    """The dcp_s3 error for ``exc`` (same builtin: ``PermissionError`` stays one), naming ``where``."""
    detail = exc.strerror or str(exc) or type(exc).__name__
    code = errno.errorcode.get(exc.errno) if isinstance(exc.errno, int) else None
    if code:
        detail = f"{detail} ({code})"
    err: DcpS3Error
    if isinstance(exc, FileNotFoundError):
        err = CheckpointNotFoundError(f"{action} {where}: not found: {detail}")
    elif isinstance(exc, FileExistsError):
        err = CheckpointExistsError(f"{action} {where}: already exists: {detail}")
    elif isinstance(exc, PermissionError):
        err = S3AccessDeniedError(f"{action} {where}: permission denied: {detail}")
    else:
        err = S3TransferError(f"{action} {where} failed: {detail}")
    err.errno = exc.errno  # type: ignore[attr-defined]  # all four are OSErrors; str() stays the message
    return err


@contextmanager
def os_errors(action: str, where: str) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block (not already a dcp_s3 error) as :func:`wrap_os_error`'s."""
    try:
        yield
    except DcpS3Error:
        raise
    except OSError as exc:
        raise wrap_os_error(exc, action, where) from exc


def new_temp(dfd: int) -> tuple[int, str]:
    """A new temporary file in directory ``dfd`` (mode 0600, as ``mkstemp``): (descriptor, name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        name = TMP_PREFIX + secrets.token_hex(8)
        try:
            return os.open(name, flags, 0o600, dir_fd=dfd), name
        except FileExistsError:
            continue
    raise S3TransferError("could not create a temporary file: 100 random names in a row were taken")


def unlink_quietly(name: str, dfd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)


class Dirs:
    """Opens directories below ``root`` without following links; ``path_of(key)`` names them in errors."""

    def __init__(self, root: str, path_of: Callable[[str], str]) -> None:
        self.root = root
        self._path = path_of

    def link_error(self, key: str, sub: str) -> CheckpointFormatError:
        where = "" if sub == key else f" (a directory of {key!r})"
        return CheckpointFormatError(
            f"{self._path(sub)}{where} is a symbolic link; links below the directory {self.root} are never "
            "followed (a crafted checkpoint could reach files outside it): replace it with the directory or file "
            "itself"
        )

    def refuse_link(self, dfd: int, name: str, key: str, sub: str | None = None) -> None:
        """``CheckpointFormatError`` if ``name`` in ``dfd`` is a symbolic link."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise self.link_error(key, sub or key)

    def linked(self, base: str) -> bool:
        """Whether directory ``base`` (a clean relative name) is reached through a link below the root."""
        path = self.root
        for name in base.split("/"):
            path = os.path.join(path, name)
            if os.path.islink(path):
                return True
        return False

    def lexists(self, dfd: int, name: str) -> bool:
        try:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def open(self, key: str, dirs: list[str], *, create: bool, follow: bool) -> int:
        """A descriptor of directory ``dirs`` (components, relative to the root) holding ``key``.

        The root itself is opened by path (it may be a link the user chose). ``create``: make what
        is missing (writes); else a missing one is ``CheckpointNotFoundError``. A component that is
        a link is ``CheckpointFormatError`` unless ``follow``; a file there is not found (reads)
        or ``CheckpointFormatError`` (writes).
        """
        if create:
            os.makedirs(self.root, exist_ok=True)
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self._path(key)} does not exist ({self.root} does not)") from None
        except NotADirectoryError:
            raise ConfigError(f"{self.root} exists and is not a directory") from None
        flags = _DIR_FLAGS | (0 if follow else os.O_NOFOLLOW)
        try:
            for i, name in enumerate(dirs):
                try:
                    nfd = os.open(name, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise CheckpointNotFoundError(f"{self._path(key)} does not exist") from None
                    with contextlib.suppress(FileExistsError):  # made by a concurrent writer
                        os.mkdir(name, dir_fd=fd)
                    nfd = os.open(name, flags, dir_fd=fd)  # a link swapped in meanwhile fails here
                except NotADirectoryError:  # O_NOFOLLOW | O_DIRECTORY on a link: ENOTDIR, as on a file
                    sub = "/".join(dirs[: i + 1])
                    self.refuse_link(fd, name, key, sub)
                    if not create:
                        raise CheckpointNotFoundError(
                            f"{self._path(key)} does not exist ({self._path(sub)} is a file)"
                        ) from None
                    raise CheckpointFormatError(
                        f"{self._path(sub)} is a file where a directory of {key!r} should be"
                    ) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd
