"""Accelerate 1.15 (and the transformers ``Trainer``) FSDP sharded-state saves and loads to ``s3://`` through dcp_s3.

    from dcp_s3.integrations.accelerate import route_fsdp_checkpoints

    with route_fsdp_checkpoints(options={"endpoint_url": ...}):
        save_fsdp_model(fsdp_plugin, accelerator, model, "s3://bucket/run/step-100")   # accelerate.utils'
        save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, "s3://bucket/run/step-100")

Accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``/``load_fsdp_model``/``load_fsdp_optimizer``
build torch's ``FileSystemWriter``/``FileSystemReader`` themselves (after ``os.makedirs`` of the
output directory), and ``Accelerator.save_state``/``load_state`` and the transformers ``Trainer``
call them by the names they imported: no plugin, argument or subclass reaches the writer. Inside
:func:`route_fsdp_checkpoints` those names — in every loaded ``accelerate``/``transformers``
module that holds them, and so in any imported later — are this module's functions of the same
signature: an ``s3://`` directory with ``SHARDED_STATE_DICT`` (FSDP2, ``use_dcp=True``) is saved
and loaded through dcp_s3 in Accelerate's own layout (``<dir>/pytorch_model_fsdp_<i>`` with the
key ``model``, ``<dir>/optimizer_<i>`` with ``optimizer``) and nothing is written to local disk;
every other call goes to Accelerate's function unchanged, and so does every call made where no block of
its own is open (a block belongs to its thread or asyncio task). After the last block the names are Accelerate's again.
The four functions are public here too, with an ``options`` keyword, for code that calls them itself.

The transformers ``Trainer`` passes local directories (``<output_dir>/checkpoint-<step>``): with
``local_dirs={output_dir: "s3://bucket/run"}`` a directory under ``output_dir`` stands for the same
place under the S3 root (:mod:`dcp_s3.integrations.trainer_dirs`); its shards go to S3, the Trainer's
small files stay in ``output_dir``, and the checkpoints saved in the block that its ``save_total_limit``
rotation deletes locally are deleted in the bucket too (transformers' ``rotate_checkpoints`` is wrapped
in the block). Loading deletes nothing, and neither does leaving the block (normally or through an
exception): see :mod:`dcp_s3._checkpointer.ownership`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import accelerate.accelerator  # noqa: F401  (binds the four names Accelerator.save_state/load_state call)
import accelerate.utils  # noqa: F401  (binds them for `from accelerate.utils import ...`, as transformers does)
import accelerate.utils.fsdp_utils as _fsdp_utils
import torch.distributed.checkpoint as dcp
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import StateDictType

from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3.errors import ConfigError, DcpS3Error
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations._patching import ContextPatch, Handler, Site
from dcp_s3.integrations.trainer_dirs import LocalDirs

__all__ = [
    "route_fsdp_checkpoints",
    "save_fsdp_model",
    "load_fsdp_model",
    "save_fsdp_optimizer",
    "load_fsdp_optimizer",
]

_NAMES = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
#: Accelerate's own functions, as its module defines them (what every call that is not routed runs).
_ORIGINAL = {name: getattr(_fsdp_utils, name) for name in _NAMES}


#: ``local_dirs`` as the public functions take it: a mapping local directory -> S3 root, or its LocalDirs.
LocalDirsArg = Mapping[Any, str] | LocalDirs | None


def _local_dirs(local_dirs: LocalDirsArg, options: StorageOptions) -> LocalDirs:
    return local_dirs if isinstance(local_dirs, LocalDirs) else LocalDirs(local_dirs, options)


def _routed(fsdp_plugin: Any, directory: Any, use_dcp: bool, what: str, local_dirs: LocalDirs) -> str | None:
    """The S3 location when this call is dcp_s3's (an ``s3://`` directory, or one under a mapped local
    directory), None when it is Accelerate's; ``ConfigError`` for a state-dict type or FSDP version
    that is not supported there."""
    location = s3_location(directory) or local_dirs.locate(directory)
    if location is None:
        return None
    if fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT or not use_dcp:
        raise ConfigError(
            f"{what}({location}): only SHARDED_STATE_DICT saved with DCP (use_dcp=True) goes to S3; "
            f"state_dict_type is {fsdp_plugin.state_dict_type}, use_dcp={use_dcp}"
        )
    if fsdp_plugin.fsdp_version != 2:
        raise ConfigError(f"{what}({location}): FSDP version {fsdp_plugin.fsdp_version}; S3 takes FSDP2 only")
    return location


def _mirror(local_dirs: LocalDirs, removed: set[str]) -> None:
    """Delete in S3 the saved checkpoints whose local directory the Trainer's rotation just removed; a
    failure is a warning: the checkpoint stays in the bucket, training goes on."""
    try:
        local_dirs.mirror(removed)
    except DcpS3Error as exc:
        warnings.warn(f"dcp_s3: a checkpoint deleted locally could not be deleted in S3: {exc}", stacklevel=3)


def _part(location: str, name: str) -> str:
    """Accelerate's rule: the directory itself when it is already named ``name``, else ``name`` in it."""
    return location if location.rsplit("/", 1)[-1] == name else f"{location}/{name}"


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    output_dir: Any,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    options: StorageOptions | Mapping[str, Any] | None = None,
    local_dirs: LocalDirsArg = None,
) -> None:
    """Accelerate's ``save_fsdp_model``; an ``s3://`` (or mapped local) ``output_dir`` saves through dcp_s3."""
    storage_options = StorageOptions.of(options)
    dirs = _local_dirs(local_dirs, storage_options)
    location = _routed(fsdp_plugin, output_dir, use_dcp, "save_fsdp_model", dirs)
    if location is None:
        _ORIGINAL["save_fsdp_model"](
            fsdp_plugin, accelerator, model, output_dir, model_index, adapter_only=adapter_only, use_dcp=use_dcp
        )
        return
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    state_dict = _fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only, sd_options=sd_options)
    writer = storage_options.writer(f"{location}/{FSDP_MODEL_NAME}_{model_index}")
    dcp.save({"model": state_dict}, storage_writer=writer)
    if s3_location(output_dir) is None:  # a mapped local directory: the sign the Trainer's resume looks for
        os.makedirs(os.path.join(output_dir, f"{FSDP_MODEL_NAME}_{model_index}"), exist_ok=True)
        dirs.record_save(os.path.join(output_dir, f"{FSDP_MODEL_NAME}_{model_index}"))


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    input_dir: Any,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    options: StorageOptions | Mapping[str, Any] | None = None,
    local_dirs: LocalDirsArg = None,
) -> Any:
    """Accelerate's ``load_fsdp_model``; an ``s3://`` (or mapped local) ``input_dir`` loads through dcp_s3."""
    storage_options = StorageOptions.of(options)
    location = _routed(fsdp_plugin, input_dir, use_dcp, "load_fsdp_model", _local_dirs(local_dirs, storage_options))
    if location is None:
        return _ORIGINAL["load_fsdp_model"](
            fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only=adapter_only, use_dcp=use_dcp
        )
    accelerator.wait_for_everyone()
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    state_dict = {"model": _fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only, sd_options=sd_options)}
    reader = storage_options.reader(_part(location, f"{FSDP_MODEL_NAME}_{model_index}"))
    dcp.load(state_dict, storage_reader=reader)
    result = _fsdp_utils._set_model_state_dict(
        model, state_dict["model"], adapter_only=adapter_only, sd_options=sd_options
    )
    accelerator.wait_for_everyone()
    return result


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    output_dir: Any,
    optimizer_index: int = 0,
    use_dcp: bool = True,
    *,
    options: StorageOptions | Mapping[str, Any] | None = None,
    local_dirs: LocalDirsArg = None,
) -> None:
    """Accelerate's ``save_fsdp_optimizer``; an ``s3://`` (or mapped local) ``output_dir`` saves through dcp_s3."""
    storage_options = StorageOptions.of(options)
    dirs = _local_dirs(local_dirs, storage_options)
    location = _routed(fsdp_plugin, output_dir, use_dcp, "save_fsdp_optimizer", dirs)
    if location is None:
        _ORIGINAL["save_fsdp_optimizer"](
            fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index, use_dcp=use_dcp
        )
        return
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    optim_state = get_optimizer_state_dict(model, optimizer, options=sd_options)
    writer = storage_options.writer(f"{location}/{OPTIMIZER_NAME}_{optimizer_index}")
    dcp.save({"optimizer": optim_state}, storage_writer=writer)
    if s3_location(output_dir) is None:
        dirs.record_save(os.path.join(output_dir, f"{OPTIMIZER_NAME}_{optimizer_index}"))


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    input_dir: Any,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    options: StorageOptions | Mapping[str, Any] | None = None,
    local_dirs: LocalDirsArg = None,
) -> None:
    """Accelerate's ``load_fsdp_optimizer``; an ``s3://`` (or mapped local) ``input_dir`` loads through dcp_s3."""
    storage_options = StorageOptions.of(options)
    location = _routed(fsdp_plugin, input_dir, use_dcp, "load_fsdp_optimizer", _local_dirs(local_dirs, storage_options))
    if location is None:
        _ORIGINAL["load_fsdp_optimizer"](
            fsdp_plugin,
            accelerator,
            optimizer,
            model,
            input_dir,
            optimizer_index,
            adapter_only=adapter_only,
            use_dcp=use_dcp,
        )
        return
    accelerator.wait_for_everyone()
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    optim_state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=sd_options)}
    reader = storage_options.reader(_part(location, f"{OPTIMIZER_NAME}_{optimizer_index}"))
    dcp.load(optim_state, storage_reader=reader)
    set_optimizer_state_dict(model, optimizer, optim_state["optimizer"], options=sd_options)
    accelerator.wait_for_everyone()


_MINE: dict[str, Callable[..., Any]] = {
    "save_fsdp_model": save_fsdp_model,
    "load_fsdp_model": load_fsdp_model,
    "save_fsdp_optimizer": save_fsdp_optimizer,
    "load_fsdp_optimizer": load_fsdp_optimizer,
}


def _bound(name: str) -> Handler:
    """Accelerate's ``name`` inside a block: this module's function with the block's options and directories."""
    mine = _MINE[name]

    def routed(scope: tuple[StorageOptions, LocalDirs], original: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("options", scope[0])
        kwargs.setdefault("local_dirs", scope[1])
        return mine(*args, **kwargs)

    return routed


def _mirrored_rotation(
    scope: tuple[StorageOptions, LocalDirs], original: Any, output_dir: Any, *args: Any, **kwargs: Any
) -> Any:
    """transformers' ``rotate_checkpoints``, then, when it returns, the same deletions in S3 (of the
    checkpoints this process saved in the block; on the process that rotates: the Trainer's saving one)."""
    local_dirs = scope[1]
    if not local_dirs:
        return original(output_dir, *args, **kwargs)
    before = local_dirs.present()
    result = original(output_dir, *args, **kwargs)
    _mirror(local_dirs, {path for path in before if not os.path.lexists(path)})
    return result


def _sites() -> list[Site]:
    """Every loaded accelerate/transformers module holding one of Accelerate's four functions (or transformers'
    ``rotate_checkpoints``) by its name."""
    handlers: dict[str, tuple[Any, Handler]] = {name: (_ORIGINAL[name], _bound(name)) for name in _NAMES}
    trainer_utils = sys.modules.get("transformers.trainer_utils")
    if trainer_utils is not None:
        handlers["rotate_checkpoints"] = (trainer_utils.rotate_checkpoints, _mirrored_rotation)
    holders = [
        m for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in ("accelerate", "transformers")
    ]
    return [
        Site(module, name, handler)
        for module in holders
        for name, (original, handler) in handlers.items()
        if module.__dict__.get(name) is original
    ]


_patch: ContextPatch[tuple[StorageOptions, LocalDirs]] = ContextPatch("Accelerate FSDP checkpoints", _sites)


@contextlib.contextmanager
def route_fsdp_checkpoints(
    options: StorageOptions | Mapping[str, Any] | None = None,
    *,
    local_dirs: Mapping[Any, str] | None = None,
) -> Iterator[StorageOptions]:
    """Within the block, Accelerate's four FSDP checkpoint functions — wherever Accelerate, the
    transformers ``Trainer`` or your code call them by name — send ``s3://`` directories, and
    directories under a key of ``local_dirs`` (a local directory such as the Trainer's
    ``output_dir`` -> the ``s3://`` root it stands for), through dcp_s3 with ``options``
    (``SHARDED_STATE_DICT``, FSDP2); with ``local_dirs``, transformers' checkpoint rotation deletes
    in S3 too the rotated checkpoints saved in the block (nothing else is ever deleted). Yields the options.
    The block belongs to its context (thread or asyncio task): calls elsewhere run Accelerate's own functions,
    or another block's settings; Accelerate's names are its own again when the last block closes. Enter it
    after importing transformers."""
    storage_options = StorageOptions.of(options)
    with _patch.scope((storage_options, LocalDirs(local_dirs, storage_options))):
        yield storage_options
