"""Storage options: every setting of a writer, a reader and a store, declared once.

A :class:`Settings` is a frozen value of four frozen parts; each part declares its settings (name,
default, validation) once, as dataclass fields:

- ``client``: :class:`~dcp_s3._objstore.config.ClientConfig` (endpoint, credentials, timeouts, retries, TLS);
- ``transfer``: :class:`~dcp_s3._objstore.config.TransferConfig` (part and range sizes, concurrency);
- ``writing``: :class:`WriterSettings` (overwrite, compression, key prefixes, ``.metadata`` format);
- ``reading``: :class:`ReaderSettings` (``.metadata`` sharing, replica groups, byte items).

The first two live in the object-store layer (which knows nothing of torch) and are used there; the
last two here. The flat keywords users give (``endpoint_url=``, ``part_size=``, ``compression=``...)
are the parts' field names, plus ``client=`` and ``transfer=`` (a whole part): :data:`KEYWORDS` is
built from the fields, so a new field is a keyword everywhere at once (writer, reader, store,
``Checkpointer``, ``StorageOptions``, every integration) and nothing else lists it. Keywords are
merged into the parts once, by :meth:`Settings.of`: a given ``client=``/``transfer=`` first, then
the flat fields over it. An unknown keyword, or a value a part refuses, is a ``ConfigError`` naming it.
A keyword given as None means its default.

How a storage class takes options (``S3StorageWriter``, ``S3StorageReader``, a new writer)::

    class MyWriter(StorageWriter):
        def __init__(self, path=None, *, options: Settings | None = None, **keywords: Any) -> None:
            settings = Settings.of(options, side="MyWriter", refuse=READER_FIELDS, **keywords)
            session = Session(path, pooled(settings.client, ...), settings.transfer)
            ...  # and settings.writing.compression, settings.writing.overwrite...

:class:`dcp_s3.StorageOptions` (:mod:`dcp_s3._dcp.storage_options`) is a ``Settings`` that also
makes writers, readers and stores for locations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dcp_s3._layout import check_key_prefixes
from dcp_s3._metadata.formats import metadata_format_option
from dcp_s3._objstore.config import ClientConfig, TransferConfig, int_option
from dcp_s3._torch_compat import require_transform_descriptors
from dcp_s3.errors import ConfigError

__all__ = [
    "WriterSettings",
    "ReaderSettings",
    "Settings",
    "KEYWORDS",
    "CLIENT_FIELDS",
    "TRANSFER_FIELDS",
    "WRITER_FIELDS",
    "READER_FIELDS",
    "LOCAL_KEYWORDS",
    "pooled",
]


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: must be True or False")


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """What only a save uses (see ``S3StorageWriter`` for each setting's meaning)."""

    #: Replace a checkpoint already at the path (atomically); False: refuse with ``CheckpointExistsError``.
    overwrite: bool = True
    #: With ``overwrite=False``, refuse a server that ignores ``If-None-Match`` (False: HEAD, with a warning).
    require_conditional_writes: bool = True
    #: ``"zstd"`` or None (torch's uncompressed format).
    compression: str | None = None
    #: zstd level (with compression only).
    compression_level: int = 1
    #: Threads compressing frames (with compression only).
    compression_threads: int = 2
    #: Key prefixes the data objects are spread over (1: torch's flat layout).
    key_prefixes: int = 1
    #: ``.metadata`` format: ``"auto"`` (compact for many chunks), ``"dcp"`` (torch's pickle) or ``"compact"``.
    metadata_format: str = "auto"

    def __post_init__(self) -> None:
        _check_bool("overwrite", self.overwrite)
        _check_bool("require_conditional_writes", self.require_conditional_writes)
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"compression={self.compression!r}; expected None or 'zstd'")
        if self.compression:
            require_transform_descriptors(f"compression={self.compression!r}")
            level = int_option("compression_level", self.compression_level, -(1 << 17))
            object.__setattr__(self, "compression_level", level)
            object.__setattr__(
                self, "compression_threads", int_option("compression_threads", self.compression_threads, 1)
            )
        check_key_prefixes(self.key_prefixes)
        metadata_format_option(self.metadata_format)


@dataclass(frozen=True, slots=True)
class ReaderSettings:
    """What only a load uses (see ``S3StorageReader`` for each setting's meaning)."""

    #: Read ``.metadata`` once and broadcast it: True (over ``dcp.load``'s group), False, or a ProcessGroup.
    share_metadata: bool | dist.ProcessGroup = True
    #: The ranks that load exactly what this rank loads (each reads a share, then broadcasts).
    replica_group: dist.ProcessGroup | None = None
    #: Skip the weights-only check of byte items (checkpoints you trust).
    allow_unsafe_byte_items: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.share_metadata, (bool, dist.ProcessGroup)):
            raise ConfigError(f"share_metadata={self.share_metadata!r}: expected True, False or a ProcessGroup")
        if self.replica_group is not None and not isinstance(self.replica_group, dist.ProcessGroup):
            raise ConfigError(f"replica_group={self.replica_group!r}: expected a ProcessGroup or None")
        _check_bool("allow_unsafe_byte_items", self.allow_unsafe_byte_items)


def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


CLIENT_FIELDS = _names(ClientConfig)
TRANSFER_FIELDS = _names(TransferConfig)
WRITER_FIELDS = _names(WriterSettings)
READER_FIELDS = _names(ReaderSettings)
#: Every keyword a ``Settings`` takes: the parts' fields (no name in two parts: tests/store/test_settings_path.py),
#: and ``client``/``transfer`` (a whole part).
KEYWORDS = CLIENT_FIELDS | TRANSFER_FIELDS | WRITER_FIELDS | READER_FIELDS | {"client", "transfer"}
#: Keywords that mean something for a local directory (the rest are S3's: client, parts, conditional writes).
LOCAL_KEYWORDS = (KEYWORDS - CLIENT_FIELDS - {"client", "part_size", "max_direct_part_size"}) - {
    "require_conditional_writes"
}
#: Keywords whose values a repr leaves out (request arguments: KMS key ids, encryption contexts); it counts their keys.
_SECRET_VALUES = frozenset({"request_args"})


def _part(name: str, value: Any, cls: type) -> Any:
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ConfigError(f"{name}={value!r} must be a dcp_s3.{cls.__name__}")
    return value


def pooled(client: ClientConfig, pool: int) -> ClientConfig:
    """``client`` with a connection pool of at least ``pool`` (what a writer, reader or store needs)."""
    return client.override(max_pool_connections=max(pool, client.max_pool_connections))


@dataclass(frozen=True, init=False, eq=False)
class Settings:
    """Storage settings: the four parts, parsed from keywords once, when made.

    ``Settings(**keywords)``: the keywords of :data:`KEYWORDS` (None: the default). ``ConfigError``
    naming any unknown keyword or refused value.
    """

    client: ClientConfig
    transfer: TransferConfig
    writing: WriterSettings
    reading: ReaderSettings
    #: The keywords as given (None values dropped): what ``as_dict``, ``replace`` and the repr show.
    given: Mapping[str, Any]

    def __init__(self, **keywords: Any) -> None:
        given = {k: v for k, v in keywords.items() if v is not None}
        unknown = sorted(set(given) - KEYWORDS)
        if unknown:
            raise ConfigError(f"unknown storage option(s) {unknown}; accepted: {sorted(KEYWORDS)}")
        client = _part("client", given.get("client"), ClientConfig)
        transfer = _part("transfer", given.get("transfer"), TransferConfig)
        set_ = object.__setattr__
        set_(self, "client", client.override(**{k: v for k, v in given.items() if k in CLIENT_FIELDS}))
        set_(self, "transfer", transfer.override(**{k: v for k, v in given.items() if k in TRANSFER_FIELDS}))
        set_(self, "writing", WriterSettings(**{k: v for k, v in given.items() if k in WRITER_FIELDS}))
        set_(self, "reading", ReaderSettings(**{k: v for k, v in given.items() if k in READER_FIELDS}))
        set_(self, "given", given)

    @classmethod
    def of(
        cls,
        options: Settings | Mapping[str, Any] | None = None,
        *,
        side: str | None = None,
        refuse: frozenset[str] = frozenset(),
        **overrides: Any,
    ) -> Any:
        """``options`` (a ``Settings``, a mapping of keywords, or None: the defaults) with ``overrides``
        merged over it, once (an override given as None changes nothing). ``side``/``refuse``: a storage
        class's name and the keywords it refuses (the other side's), as ``ConfigError`` naming them."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        wrong = sorted(refuse & overrides.keys())
        if wrong:  # before S3StorageWriter/S3StorageReader shared Settings, Python refused these (TypeError)
            raise ConfigError(f"{side} takes no option(s) {wrong}")
        if isinstance(options, Settings):
            base = options if isinstance(options, cls) else cls(**options.given)
        elif options is None:
            base = cls()
        elif isinstance(options, Mapping):
            base = cls(**options)
        else:
            raise ConfigError(f"storage options {options!r}: expected a {cls.__name__}, a mapping or None")
        return base.replace(**overrides) if overrides else base

    def as_dict(self) -> dict[str, Any]:
        """The keywords as given (a copy)."""
        return dict(self.given)

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` merged over the keywords (one given as None is removed)."""
        return type(self)(**{**self.given, **changes})

    def check_local(self, root: str) -> None:
        """``ConfigError`` if a keyword that means nothing on local disk (S3's) was given for ``root``."""
        s3_only = sorted(set(self.given) - LOCAL_KEYWORDS)
        if s3_only:
            raise ConfigError(f"storage options {s3_only} apply to s3:// locations only, not to local path {root!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Settings):
            return NotImplemented
        parts = ("client", "transfer", "writing", "reading")
        return all(getattr(self, p) == getattr(other, p) for p in parts)

    __hash__ = None  # type: ignore[assignment]  # parts may hold unhashable values (request_args)

    def __repr__(self) -> str:
        shown = (f"{k}=<{len(v)} keys>" if k in _SECRET_VALUES else f"{k}={v!r}" for k, v in sorted(self.given.items()))
        return f"{type(self).__name__}({', '.join(shown)})"
