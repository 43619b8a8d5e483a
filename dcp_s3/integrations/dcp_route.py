"""An opt-in route: plain ``dcp.save``/``dcp.load``/``dcp.async_save`` calls given only
``checkpoint_id="s3://..."`` use dcp_s3's ``S3StorageWriter``/``S3StorageReader``.

Code that passes only a checkpoint id (torchtitan, Lightning, most training scripts) always gets
torch's own choice of storage: ``FileSystemWriter`` for a path, fsspec (s3fs) for an ``s3://`` id.
With the route on, an ``s3://`` id with no ``storage_writer``/``storage_reader`` gets dcp_s3's
writer or reader, made by :meth:`dcp_s3.StorageOptions.writer`/``reader`` with the route's options::

    from dcp_s3.integrations import dcp_route

    with dcp_route.s3_route({"endpoint_url": "http://127.0.0.1:8333"}):
        dcp.save(state_dict, checkpoint_id="s3://bucket/run1/step-100")

    dcp_route.enable(options)      # process-wide, until dcp_route.disable()

Everything else keeps torch's behaviour: local paths and other schemes, calls that pass their own
storage, and every call while no route is on (torch's function itself is back in place then).

The route replaces the function torch's saver and loader call to pick a storage (a private torch
name: :func:`dcp_s3._torch_compat.storage_setup_sites`); a torch release that picks its storage
another way makes turning the route on raise ``TorchCompatibilityError`` rather than let
``s3://`` ids quietly go to fsspec. ``dcp.async_save`` is wrapped too, so that the writer of an
async save is made when it is called (from torch 2.9 torch would pick it in its upload thread, when
a ``with`` block may already have ended); code that bound ``async_save`` before the route was
turned on still gets dcp_s3 while the route is on.

``s3_route`` blocks belong to the context that opened them (a ``contextvars`` stack: a thread, or an
asyncio task): a save inside thread A's block uses A's options even while thread B is inside a
block of its own. Code running where no block of its own is open (a thread torch or the user
started inside a block) gets the options of the blocks open in other threads when they all agree,
else a ``ConfigError``: with two different routes open, which one it meant cannot be told, and
guessing would send a checkpoint to another endpoint. The process-wide route (``enable``) applies
where no block is open at all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._objstore.uri import s3_location
from dcp_s3._torch_compat import async_save_sites, get_storage_setup, set_storage_setup, storage_setup_sites
from dcp_s3.errors import ConfigError
from dcp_s3.integrations._patching import ContextPatch, Site

__all__ = ["enable", "disable", "s3_route", "active_options", "is_routed"]

logger = logging.getLogger(__name__)

_lock = threading.RLock()
#: The process-wide route's options (``enable``), if on.
_enabled: StorageOptions | None = None


def is_routed(checkpoint_id: object) -> bool:
    """Whether the route takes ``checkpoint_id`` (an ``s3://`` id, or pathlib's fold of one) when it is on; an S3
    look-alike string (``s3:/b/k``, ``S3://b/k``) raises ``InvalidCheckpointIdError`` rather than reach torch's
    local writer."""
    return s3_location(checkpoint_id) is not None


def active_options() -> StorageOptions | None:
    """The options ``s3://`` ids are saved and loaded with now, in this context, or None when no route
    is on. ``ConfigError`` where this context has no block of its own and blocks with different
    options are open in others."""
    own = _patch.current()
    if own is not None:
        return own
    blocks = _patch.open_values()
    if not blocks:
        return _enabled
    first = blocks[0]
    if any(opts != first for opts in blocks):
        endpoints = sorted({str(opts.as_dict().get("endpoint_url", "default endpoint")) for opts in blocks})
        raise ConfigError(
            "an s3:// checkpoint id outside any dcp_s3 route block of this thread, while blocks with different "
            f"options are open in other threads (endpoints {endpoints}): open an s3_route block in this "
            "thread, or pass storage_writer/storage_reader"
        )
    return first


def enable(options: StorageOptions | Mapping[str, Any] | None = None) -> None:
    """Route ``s3://`` ids of ``dcp.save``/``load``/``async_save`` to dcp_s3, process-wide, with
    ``options`` (a ``StorageOptions``, a mapping of its keywords, or None: the defaults); calling it
    again replaces the options. ``TorchCompatibilityError`` where this torch has no hook for it."""
    global _enabled
    opts = StorageOptions.of(options)
    with _lock:
        if _enabled is None:
            _patch.hold()
        _enabled = opts


def disable() -> None:
    """Turn the process-wide route off (``s3_route`` blocks still open keep theirs)."""
    global _enabled
    with _lock:
        if _enabled is not None:
            _enabled = None
            _patch.release()


@contextlib.contextmanager
def s3_route(options: StorageOptions | Mapping[str, Any] | None = None) -> Iterator[StorageOptions]:
    """The route, with ``options``, for the ``with`` block in this context (thread or task; nested blocks: the
    innermost's options); yields the ``StorageOptions``. An async save started in the block finishes through dcp_s3."""
    with _patch.scope(StorageOptions.of(options)) as opts:
        yield opts


def _routed_setup(
    opts: StorageOptions, original: Callable[..., Any], storage: Any, checkpoint_id: Any, reader: bool = False
) -> Any:
    if storage or not is_routed(checkpoint_id):
        return original(storage, checkpoint_id, reader)
    made = opts.reader(checkpoint_id) if reader else opts.writer(checkpoint_id)
    made.reset(checkpoint_id)  # as torch does with the storage it makes
    logger.debug("dcp_s3 route: %s for %s", type(made).__name__, checkpoint_id)
    return made


def _routed_async_save(
    opts: StorageOptions, original: Callable[..., Any], state_dict: Any, *args: Any, **kwargs: Any
) -> Any:
    checkpoint_id: Any = kwargs.get("checkpoint_id")
    if not args and kwargs.get("storage_writer") is None and is_routed(checkpoint_id):
        kwargs["storage_writer"] = opts.writer(checkpoint_id)
    return original(state_dict, *args, **kwargs)


def _sites() -> list[Site]:
    setups = storage_setup_sites()  # TorchCompatibilityError before anything is replaced
    return [
        *(Site(m, "storage setup", _routed_setup, get=get_storage_setup, set=set_storage_setup) for m in setups),
        *(Site(m, "async_save", _routed_async_save) for m in async_save_sites()),
    ]


_patch: ContextPatch[StorageOptions] = ContextPatch(
    "route for s3:// checkpoint ids", _sites, resolve=lambda _: active_options()
)
