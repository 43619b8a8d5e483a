"""Every private or version-dependent torch API that dcp_s3 uses, in one place.

dcp_s3 supports torch 2.7 through 2.15 (``pyproject.toml``). When a new torch release
breaks something, this module is the place to look: other modules import torch's private
names from here, never from torch directly.

Public DCP APIs we rely on, all present from 2.7: ``_StorageInfo.transform_descriptors``,
``SavePlan.usable``, ``StorageMeta(modules=)``, ``dcp.save/load(no_dist=)``.
Differences inside the supported range (checked in each release's source):

- 2.9: ``state_dict_saver.AsyncSaveResponse`` and ``dcp.async_save(no_dist=)``
  (:func:`async_save`); ``staging.DefaultStager``/``StagingOptions`` (:func:`default_stager`); saver and loader pass ``rank``/``use_collectives`` to hooks
  whose signature has ``**kwargs``.
- 2.9: the loader retries a failed ``read_metadata()`` as ``read_metadata(rank=...)``;
  until 2.11 it then drops both errors (``AssertionError("metadata is None")``), so
  readers answer the retry with :func:`placeholder_metadata`.

Private names whose silent rename would change what dcp_s3 does (an override no longer called, an
attribute set that torch no longer reads) are looked up with :func:`torch_private`, which raises
``TorchCompatibilityError`` naming the missing name and this torch's version.
``tests/test_private_torch_names.py`` parses every other module to keep torch's private names here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import types
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zstandard
from torch import _weights_only_unpickler as weights_only_unpickler  # torch's weights-only allowlist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import _version as dcp_version  # DefaultLoadPlanner's pre-2.4 key handling
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from dcp_s3.errors import CheckpointFormatError, ConfigError, TorchCompatibilityError

__all__ = [
    "TORCH_VERSION",
    "torch_private",
    "checkpoint_failures",
    "narrow_tensor_by_index",
    "flatten_state_dict",
    "dcp_version",
    "_EmptyStateDictLoadPlanner",
    "_StorageInfo",
    "_StoragePrefix",
    "_load_state_dict",
    "element_size",
    "default_group_has_cpu",
    "default_store",
    "group_device_types",
    "async_save",
    "default_stager",
    "require_transform_descriptors",
    "placeholder_metadata",
    "weights_only_unpickler",
    "weights_only_blocklisted_modules",
    "weights_only_allowed_globals",
    "weights_only_user_allowed_globals",
    "MEM_FORMAT_ENCODING",
    "get_layout",
    "REBUILD_PREFIX",
    "REBUILD_FROM_TYPE_V2",
    "rebuild_functions",
    "torch_zip_reader",
    "record_size",
    "dist_wrapper_class",
    "decode_torch_transforms",
    "torch_save_bound",
    "ZSTD_MAX_WINDOW",
    "flatten_state_dict_as_before_2_4",
    "OverridableSavePlanner",
    "storage_setup_sites",
    "get_storage_setup",
    "set_storage_setup",
    "async_save_sites",
]

TORCH_VERSION = torch.__version__

try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
except ImportError:  # torch < 2.9: async_save returns the upload's future itself
    AsyncSaveResponse = None  # type: ignore[assignment,misc]
try:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # torch < 2.9
    DefaultStager = StagingOptions = None  # type: ignore[assignment,misc]

#: ``dcp.async_save`` takes ``no_dist=`` (torch >= 2.9).
ASYNC_SAVE_HAS_NO_DIST = "no_dist" in inspect.signature(dcp.async_save).parameters
#: ``_StorageInfo`` records a per-item transform (torch >= 2.7); compressed items need it.
HAS_TRANSFORM_DESCRIPTORS = "transform_descriptors" in {f.name for f in dataclasses.fields(_StorageInfo)}


def torch_private(owner: Any, name: str, where: str | None = None) -> Any:
    """``owner.name``, a private torch name dcp_s3 relies on; ``TorchCompatibilityError`` where this
    torch has no such name (renamed or removed: dcp_s3 needs a change for this release). ``where``
    names ``owner`` in the message (default: the module's or class's own name)."""
    try:
        return getattr(owner, name)
    except AttributeError:
        if where is None:
            module = isinstance(owner, types.ModuleType)
            where = owner.__name__ if module else f"{owner.__module__}.{owner.__qualname__}"
        raise TorchCompatibilityError(
            f"dcp_s3 relies on torch's private {where}.{name}, which torch {TORCH_VERSION} does not have "
            f"(dcp_s3/_torch_compat.py needs updating for this torch release)"
        ) from None


def checkpoint_failures(exc: BaseException) -> list[BaseException]:
    """The exceptions a torch ``CheckpointException`` carries, in its ranks' order ([] for any other
    exception). Its ``failures`` maps a rank to ``(exception, traceback summary)`` (torch's private
    ``WRAPPED_EXCEPTION``); a bare exception there is taken as it is. With ``no_dist`` torch keys the
    failure by rank 0 whatever the process's rank: name the rank yourself."""
    if not isinstance(exc, CheckpointException):
        return []
    out: list[BaseException] = []
    for _, failure in sorted(exc.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(cause, BaseException):
            out.append(cause)
    return out


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return int(torch._utils._element_size(dtype))


def group_device_types(group: Any) -> list[str] | None:
    """The device types ``group``'s backends serve (``["cpu"]`` for gloo, ``["cuda"]`` for NCCL), or
    None where this torch does not say."""
    try:
        types = group._device_types
    except AttributeError:
        return None
    return [d.type if isinstance(d, torch.device) else str(d) for d in types]


def default_group_has_cpu() -> bool:
    """True if the default process group has a backend for CPU tensors (e.g. gloo)."""
    group: Any = dist.distributed_c10d._get_default_group()
    return torch.device("cpu") in group._device_types


def default_store() -> dist.Store | None:
    """The default process group's key-value store (``TCPStore`` for a ``torchrun`` job), or None without
    one. Private in every supported release (``distributed_c10d._get_default_store``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return cast(dist.Store, dist.distributed_c10d._get_default_store())
    except (AttributeError, RuntimeError, ValueError):  # a renamed helper or a group with no store
        return None


def async_save(state_dict: Any, *, no_dist: bool, **kwargs: Any) -> Future[Any]:
    """``dcp.async_save(state_dict, **kwargs)``; returns the future of the upload on every torch.

    torch < 2.9 has no ``no_dist=``: it decides by whether a process group is initialized,
    which is what ``no_dist`` says whenever it is not set against an initialized group.
    """
    if ASYNC_SAVE_HAS_NO_DIST:
        kwargs["no_dist"] = no_dist
    elif no_dist and dist.is_available() and dist.is_initialized():
        raise ConfigError(
            f"async_save(no_dist=True) inside an initialized process group needs torch>=2.9 (this is torch "
            f"{TORCH_VERSION})"
        )
    response: Any = dcp.async_save(state_dict, **kwargs)
    if AsyncSaveResponse is not None and isinstance(response, AsyncSaveResponse):
        return response.upload_completion
    return cast(Future[Any], response)


def default_stager() -> Any:
    """torch's ``DefaultStager`` for an ``async_save``: its default options where an accelerator is available; without
    one (where those assert) no pinned memory and no non-blocking copies, staging still in its background thread."""
    if DefaultStager is None or StagingOptions is None:
        raise TorchCompatibilityError(
            f"torch.distributed.checkpoint.staging.DefaultStager needs torch>=2.9 ({TORCH_VERSION})"
        )
    if torch.accelerator.is_available():
        return DefaultStager()
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False))


def require_transform_descriptors(feature: str) -> None:
    """``ConfigError`` unless this torch records per-item transforms (needed by ``feature``)."""
    if not HAS_TRANSFORM_DESCRIPTORS:
        raise ConfigError(
            f"{feature} needs torch>=2.7 (its _StorageInfo.transform_descriptors records how each item "
            f"is encoded); this is torch {TORCH_VERSION}"
        )


def placeholder_metadata() -> Metadata:
    """An empty ``Metadata`` to hand to torch's loader in place of one that could not be read.

    From 2.9, when ``read_metadata()`` raises, torch's loader retries with
    ``read_metadata(rank=...)`` (rank-local metadata); if that raises too it fails with
    ``AssertionError("metadata is None")`` and, before 2.12, drops both errors. A reader that
    answers the retry with this placeholder and raises the first error from
    ``set_up_storage_reader`` (called next, inside the same collective step) gets its own
    error to every rank, as torch 2.7/2.8 do.
    """
    return Metadata(state_dict_metadata={})


# -- used by the security checks (dcp_s3._untrusted) and dcp_s3._planners.sharing -----------------------------

#: ``torch.serialization._get_layout``: how pickled metadata names a tensor layout.
get_layout = torch.serialization._get_layout
#: ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``: how ``TensorProperties`` pickles
#: its memory format (an enum that checkpoints' metadata names).
MEM_FORMAT_ENCODING = _MEM_FORMAT_ENCODING
#: Names of the functions torch.save's pickles call to rebuild tensors (strings inside pickles).
REBUILD_PREFIX = "torch._utils._rebuild_"
REBUILD_FROM_TYPE_V2 = "torch._tensor._rebuild_from_type_v2"


def weights_only_blocklisted_modules() -> Any:
    """The modules torch's weights-only unpickler refuses even when allowlisted (``_blocklisted_modules``)."""
    return torch_private(weights_only_unpickler, "_blocklisted_modules")


def weights_only_allowed_globals() -> dict[str, Any]:
    """torch's own weights-only allowlist, by dotted name (``_get_allowed_globals()``)."""
    return cast(dict[str, Any], torch_private(weights_only_unpickler, "_get_allowed_globals")())


def weights_only_user_allowed_globals() -> dict[str, Any]:
    """What the user registered with ``torch.serialization.add_safe_globals``, by dotted name
    (``_get_user_allowed_globals()``)."""
    return cast(dict[str, Any], torch_private(weights_only_unpickler, "_get_user_allowed_globals")())


def rebuild_functions() -> dict[str, Any]:
    """torch's tensor rebuild functions (``torch._utils._rebuild_*`` and ``_rebuild_from_type_v2``),
    by name: the byte-item checker decides which of them a pickle may call."""
    found = {name: getattr(torch._utils, name) for name in dir(torch._utils) if name.startswith("_rebuild_")}
    found["_rebuild_from_type_v2"] = torch._tensor._rebuild_from_type_v2
    return found


def torch_zip_reader(blob: bytes) -> Any:
    """torch's own zip reader over ``blob`` (so the pickle checked is the one torch.load would run)."""
    return torch._C.PyTorchFileReader(io.BytesIO(blob))


def record_size(archive: Any) -> Any:
    """``archive.get_record_size`` (torch >= 2.8), else the size of each record as read (2.7)."""
    method = getattr(archive, "get_record_size", None)
    if method is not None:
        return method
    return lambda name: len(archive.get_record(name))


def dist_wrapper_class() -> Any:
    """torch's ``_DistWrapper`` (what ``dcp.load``/``dcp.save`` build from their process group), or None."""
    try:
        from torch.distributed.checkpoint.utils import _DistWrapper
    except ImportError:
        return None
    return _DistWrapper


#: Largest zstd window a ``stream.zstd`` item may ask for (torch's writer uses zstd's defaults:
#: 2 MiB at level 3, 8 MiB at level 19): bounds the decoder's own scratch memory.
ZSTD_MAX_WINDOW = 64 << 20
_READ_PIECE = 1 << 20


def _transform_streams(descriptors: list[str], raw: io.BufferedIOBase) -> Any:
    """The stream of decoded bytes, as torch's ``FileSystemReader`` builds it (private:
    ``_StorageReaderTransforms``), except that torch's own ``stream.zstd`` gets a zstd decoder
    with a bounded window."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard

    stream: Any = raw
    for ex in ExtensionRegistry().from_descriptor_list(descriptors):  # ValueError for unknown names
        if type(ex) is ZStandard:
            stream = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(stream)
        elif isinstance(ex, StreamTransformExtension):
            stream = ex.transform_from(stream)
    return stream


def decode_torch_transforms(descriptors: list[str], data: bytes | bytearray, where: str, limit: int) -> bytearray:
    """Undo torch's own storage transforms (``FileSystemWriter(_extensions=[ZStandard()])``) on one
    item's stored bytes, as torch's ``FileSystemReader`` does, producing at most ``limit`` bytes.

    The output is read in pieces of at most 1 MiB: an item that would decode to more than
    ``limit`` is a ``CheckpointFormatError`` once ``limit`` is passed, before more is allocated.
    """
    out = bytearray()
    try:
        stream = _transform_streams(descriptors, io.BytesIO(data))
        while True:
            piece = stream.read(min(_READ_PIECE, limit + 1 - len(out)))
            if not piece:
                return out
            out += piece
            if len(out) > limit:
                raise CheckpointFormatError(
                    f"{where}: undoing transforms {descriptors} gives more than the {limit} bytes the "
                    f"metadata allows for this item (a decompression bomb, or a mislabelled item)"
                )
    except CheckpointFormatError:
        raise
    except Exception as exc:  # ValueError for unknown names, zstd errors for bad bytes, ImportError before 2.7
        raise CheckpointFormatError(
            f"{where}: cannot undo transforms {descriptors} (dcp_s3 reads its own dcp_s3.zstd-frames/1 and /2 and "
            f"torch's registered extensions): {type(exc).__name__}: {exc}"
        ) from exc


@functools.cache
def _empty_save_size(ndim: int) -> int:
    buf = io.BytesIO()
    torch.save(torch.empty((0,) * ndim), buf)
    return len(buf.getvalue())


def torch_save_bound(nbytes: int, ndim: int) -> int:
    """Most bytes a ``torch.save`` archive of one ``ndim``-dimensional tensor of ``nbytes`` bytes
    (storage no larger than the tensor, as torch's ``FileSystemWriter`` saves chunks) can take.

    The container's overhead is measured on this torch (an empty tensor of that rank: ~1.5 KiB
    in 2.13), plus 20 bytes per dimension (a size and a stride as 8-byte ints instead of the
    empty tensor's 0), 64 bytes of record alignment and 1 KiB for records other torch versions add.
    """
    return nbytes + _empty_save_size(ndim) + 20 * ndim + 64 + 1024


# -- used by the planners (planners/load.py, planners/scale.py) ---------------------------------------


def flatten_state_dict_as_before_2_4(state_dict: Any) -> tuple[Any, Any]:
    """``flatten_state_dict(state_dict)`` with the keys of checkpoints saved by torch <= 2.3, as
    ``DefaultLoadPlanner.create_local_plan`` computes them (``_version._derived_version = "2_3"``
    for the call, then None again so that later saves use the current keys)."""
    torch_private(dcp_version, "_derived_version")  # a rename would silently give the current keys
    dcp_version._derived_version = "2_3"
    try:
        return flatten_state_dict(state_dict)
    finally:
        dcp_version._derived_version = None


#: What ``OverridableSavePlanner`` overrides, or sets, of torch's ``DefaultSavePlanner``.
_SAVE_PLANNER_METHOD = "_create_global_plan"  # torch 2.7-2.15
_SAVE_PLANNER_KEY = "_cached_plans_key"


class OverridableSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose private override points have public names.

    torch's ``create_global_plan`` (with or without plan caching) calls ``self._create_global_plan``;
    here that calls :meth:`build_global_plan`, which subclasses override (its default is torch's).
    Plan caching keys its cache by ``self._cached_plans_key``: :meth:`set_plans_cache_key`.

    A torch that renamed one of them would stop calling the override, or stop reading the key (the
    plans of another group's save would then be mixed into this one's): constructing the planner
    raises ``TorchCompatibilityError`` instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torch_private(DefaultSavePlanner, _SAVE_PLANNER_METHOD)
        super().__init__(*args, **kwargs)
        torch_private(self, _SAVE_PLANNER_KEY, "DefaultSavePlanner()")  # set by torch's __init__

    def set_plans_cache_key(self, key: str) -> None:
        """Key torch's plan cache (process-wide, by default the class's name) by ``key``."""
        self._cached_plans_key = key

    def build_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The global plans and metadata from the ranks' plans (torch's ``_create_global_plan``)."""
        return cast(tuple[list[SavePlan], Metadata], super()._create_global_plan(all_plans))

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return self.build_global_plan(all_plans)


# -- used by dcp_s3.integrations.dcp_route ---------------------------------------------------------------

#: What ``dcp.save``/``dcp.load`` (and ``dcp.async_save``, through ``save`` or directly) call to pick a
#: ``StorageWriter``/``StorageReader`` for a ``checkpoint_id`` when none is given: torch's
#: ``_storage_utils._storage_setup(storage, checkpoint_id, reader)``, which ``state_dict_saver`` and
#: ``state_dict_loader`` import by name (torch 2.7-2.15), so it is looked up as their global.
_STORAGE_SETUP = "_storage_setup"
_STORAGE_SETUP_PARAMS = ("storage", "checkpoint_id", "reader")


def storage_setup_sites(modules: Sequence[types.ModuleType] | None = None) -> tuple[types.ModuleType, ...]:
    """The modules whose global ``_storage_setup`` torch's save and load call (torch's
    ``state_dict_saver`` and ``state_dict_loader`` unless ``modules`` is given), each checked:
    ``TorchCompatibilityError`` where one has no such function, or one whose parameters are not
    ``(storage, checkpoint_id, reader)`` (a torch that picks its storage another way: replacing
    the function would then change nothing, and s3:// ids would silently go to fsspec)."""
    if modules is None:
        modules = (state_dict_saver, state_dict_loader)
    for module in modules:
        setup = torch_private(module, _STORAGE_SETUP)
        try:
            params = tuple(inspect.signature(setup).parameters)
        except (TypeError, ValueError):
            params = ()
        if params != _STORAGE_SETUP_PARAMS:
            raise TorchCompatibilityError(
                f"dcp_s3 relies on torch's private {module.__name__}.{_STORAGE_SETUP}{_STORAGE_SETUP_PARAMS}, "
                f"which in torch {TORCH_VERSION} takes {params} (dcp_s3/_torch_compat.py needs updating for "
                f"this torch release)"
            )
    return tuple(modules)


def get_storage_setup(module: types.ModuleType) -> Callable[..., Any]:
    """``module._storage_setup`` (one of :func:`storage_setup_sites`)."""
    return cast(Callable[..., Any], getattr(module, _STORAGE_SETUP))


def set_storage_setup(module: types.ModuleType, setup: Callable[..., Any]) -> None:
    """Make ``module``'s save or load call ``setup`` to pick its storage (one of :func:`storage_setup_sites`)."""
    setattr(module, _STORAGE_SETUP, setup)


def async_save_sites() -> tuple[types.ModuleType, ...]:
    """The modules whose ``async_save`` attribute is ``dcp.async_save`` (the package and
    ``state_dict_saver``). From 2.9 ``async_save`` picks the storage of an id-only call in its
    upload thread, not in the caller's; a route that must decide in the caller wraps it here."""
    return (dcp, state_dict_saver)
