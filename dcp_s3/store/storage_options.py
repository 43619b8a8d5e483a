"""One set of storage options for both sides of a checkpoint: :class:`StorageOptions`.

``S3StorageWriter`` and ``S3StorageReader`` take different keywords (``part_size`` and
``compression`` are the writer's, ``share_metadata`` the reader's), and each refuses the other's.
Code that saves and loads with the same settings (a training loop, a framework integration) gives
them once here; :meth:`StorageOptions.writer` and :meth:`StorageOptions.reader` hand each class the
keywords that are its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dcp_s3.errors import ConfigError
from dcp_s3.storage.reader import S3StorageReader
from dcp_s3.storage.writer import S3StorageWriter
from dcp_s3.store.base import Store
from dcp_s3.store.opening import open_object, open_store
from dcp_s3.store.options import parse_storage_options

__all__ = ["StorageOptions"]

#: Options whose values a repr leaves out (request arguments: KMS key ids, encryption contexts); it counts their keys.
_SECRET_VALUES = frozenset({"request_args"})


class StorageOptions:
    """Storage options (``S3StorageWriter``/``S3StorageReader`` keywords, and the ``ClientConfig``
    settings ``connect_timeout``, ``read_timeout``, ``retry_attempts``, ``retry_mode``), checked once,
    when made: an option neither class accepts, or a value either would refuse, is a ``ConfigError``
    naming it.

        options = StorageOptions(endpoint_url="http://127.0.0.1:8333", part_size=32 << 20, compression="zstd")
        dcp.save(state_dict, storage_writer=options.writer("s3://bucket/run1/step-100"))
        dcp.load(state_dict, storage_reader=options.reader("s3://bucket/run1/step-100"))

    Each side gets the options that are its own (``part_size``, ``compression`` and the other
    writer-only options do nothing on a load: the reader finds the compression from what is stored);
    the shared ones (client, credentials, ``max_concurrency``, ``transfer``...) go to both. On a
    local path only the options that mean something there are accepted (see ``open_store``).
    """

    __slots__ = ("_options",)

    def __init__(self, **options: Any) -> None:
        parse_storage_options(options)  # checked now, not at the first save
        self._options: dict[str, Any] = dict(options)

    @classmethod
    def of(cls, options: StorageOptions | Mapping[str, Any] | None) -> StorageOptions:
        """``options`` itself, or a ``StorageOptions`` of the mapping (none: the defaults)."""
        if isinstance(options, StorageOptions):
            return options
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise ConfigError(f"storage options {options!r}: expected a StorageOptions, a mapping or None")
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        """The options as given (a copy): ``S3StorageWriter``/``S3StorageReader``/``Checkpointer`` keywords."""
        return dict(self._options)

    def replace(self, **changes: Any) -> StorageOptions:
        """A copy with ``changes`` applied (an option given as None is removed)."""
        merged = {**self._options, **changes}
        return StorageOptions(**{k: v for k, v in merged.items() if v is not None})

    def writer(self, checkpoint: str | os.PathLike[str], *, overwrite: bool | None = None) -> S3StorageWriter:
        """An ``S3StorageWriter`` for ``checkpoint`` (``s3://bucket/key`` or a local directory) with
        the writer's share of these options; ``overwrite`` overrides the option of that name."""
        store, name = self._parent(checkpoint)
        return store.writer(name, overwrite=overwrite)

    def reader(
        self, checkpoint: str | os.PathLike[str], kind: type[S3StorageReader] = S3StorageReader
    ) -> S3StorageReader:
        """An ``S3StorageReader`` (or ``kind``, a subclass taking its arguments) for ``checkpoint`` with the
        reader's share of these options."""
        store, name = self._parent(checkpoint)
        return store.reader(name, kind)

    def store(self, root: str | os.PathLike[str]) -> Store:
        """A :class:`~dcp_s3.store.Store` rooted at ``root`` with these options (what the
        ``Checkpointer`` and the command-line tools use: listings, deletes, writers and readers)."""
        return open_store(root, **self._options)

    def _parent(self, checkpoint: str | os.PathLike[str]) -> tuple[Store, str]:
        return open_object(checkpoint, **self._options)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorageOptions) and other._options == self._options

    __hash__ = None  # type: ignore[assignment]  # options may hold unhashable values (dicts, groups)

    def __repr__(self) -> str:
        shown = (
            f"{k}=<{len(v or {})} keys>" if k in _SECRET_VALUES else f"{k}={v!r}"
            for k, v in sorted(self._options.items())
        )
        return f"StorageOptions({', '.join(shown)})"
