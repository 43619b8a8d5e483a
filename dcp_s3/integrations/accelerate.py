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
every other call goes to Accelerate's function unchanged. On exit the names are Accelerate's again.
The four functions are public here too, with an ``options`` keyword, for code that calls them itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import accelerate.accelerator  # noqa: F401  (binds the four names Accelerator.save_state/load_state call)
import accelerate.utils  # noqa: F401  (binds them for `from accelerate.utils import ...`, as transformers does)
import accelerate.utils.fsdp_utils as _fsdp_utils
import torch.distributed.checkpoint as dcp
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import StateDictType

from dcp_s3.errors import ConfigError
from dcp_s3.integrations.lightning_io import s3_location
from dcp_s3.store.storage_options import StorageOptions

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


def _routed(fsdp_plugin: Any, directory: Any, use_dcp: bool, what: str) -> str | None:
    """The S3 location when this call is dcp_s3's, None when it is Accelerate's; ``ConfigError``
    for an ``s3://`` directory with a state-dict type or FSDP version that is not supported there."""
    location = s3_location(directory)
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


def _part(location: str, name: str) -> str:
    """Accelerate's rule: the directory itself when it is already named ``name``, else ``name`` in it."""
    return location if location.rsplit("/", 1)[-1] == name else f"{location}/{name}"


def save_fsdp_model(
    fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: Any, model_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True, *, options: StorageOptions | Mapping[str, Any] | None = None,
) -> None:
    """Accelerate's ``save_fsdp_model``; an ``s3://`` ``output_dir`` saves through dcp_s3."""
    location = _routed(fsdp_plugin, output_dir, use_dcp, "save_fsdp_model")
    if location is None:
        return _ORIGINAL["save_fsdp_model"](
            fsdp_plugin, accelerator, model, output_dir, model_index, adapter_only=adapter_only, use_dcp=use_dcp
        )
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    state_dict = _fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only, sd_options=sd_options)
    writer = StorageOptions.of(options).writer(f"{location}/{FSDP_MODEL_NAME}_{model_index}")
    dcp.save({"model": state_dict}, storage_writer=writer)


def load_fsdp_model(
    fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: Any, model_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True, *, options: StorageOptions | Mapping[str, Any] | None = None,
) -> Any:
    """Accelerate's ``load_fsdp_model``; an ``s3://`` ``input_dir`` loads through dcp_s3."""
    location = _routed(fsdp_plugin, input_dir, use_dcp, "load_fsdp_model")
    if location is None:
        return _ORIGINAL["load_fsdp_model"](
            fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only=adapter_only, use_dcp=use_dcp
        )
    accelerator.wait_for_everyone()
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    state_dict = {"model": _fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only, sd_options=sd_options)}
    reader = StorageOptions.of(options).reader(_part(location, f"{FSDP_MODEL_NAME}_{model_index}"))
    dcp.load(state_dict, storage_reader=reader)
    result = _fsdp_utils._set_model_state_dict(model, state_dict["model"], adapter_only=adapter_only, sd_options=sd_options)
    accelerator.wait_for_everyone()
    return result


def save_fsdp_optimizer(
    fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, output_dir: Any, optimizer_index: int = 0,
    use_dcp: bool = True, *, options: StorageOptions | Mapping[str, Any] | None = None,
) -> None:
    """Accelerate's ``save_fsdp_optimizer``; an ``s3://`` ``output_dir`` saves through dcp_s3."""
    location = _routed(fsdp_plugin, output_dir, use_dcp, "save_fsdp_optimizer")
    if location is None:
        return _ORIGINAL["save_fsdp_optimizer"](
            fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index, use_dcp=use_dcp
        )
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    optim_state = get_optimizer_state_dict(model, optimizer, options=sd_options)
    writer = StorageOptions.of(options).writer(f"{location}/{OPTIMIZER_NAME}_{optimizer_index}")
    dcp.save({"optimizer": optim_state}, storage_writer=writer)


def load_fsdp_optimizer(
    fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, input_dir: Any, optimizer_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True, *, options: StorageOptions | Mapping[str, Any] | None = None,
) -> None:
    """Accelerate's ``load_fsdp_optimizer``; an ``s3://`` ``input_dir`` loads through dcp_s3."""
    location = _routed(fsdp_plugin, input_dir, use_dcp, "load_fsdp_optimizer")
    if location is None:
        return _ORIGINAL["load_fsdp_optimizer"](
            fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index,
            adapter_only=adapter_only, use_dcp=use_dcp,
        )
    accelerator.wait_for_everyone()
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    optim_state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=sd_options)}
    reader = StorageOptions.of(options).reader(_part(location, f"{OPTIMIZER_NAME}_{optimizer_index}"))
    dcp.load(optim_state, storage_reader=reader)
    set_optimizer_state_dict(model, optimizer, optim_state["optimizer"], options=sd_options)
    accelerator.wait_for_everyone()


_MINE: dict[str, Callable[..., Any]] = {
    "save_fsdp_model": save_fsdp_model,
    "load_fsdp_model": load_fsdp_model,
    "save_fsdp_optimizer": save_fsdp_optimizer,
    "load_fsdp_optimizer": load_fsdp_optimizer,
}


def _bind(name: str, options: StorageOptions) -> Any:
    mine = _MINE[name]

    def routed(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("options", options)
        return mine(*args, **kwargs)

    routed.__name__ = routed.__qualname__ = name
    routed.__doc__ = mine.__doc__
    routed.__wrapped__ = _ORIGINAL[name]  # type: ignore[attr-defined]
    return routed


def _holders() -> list[Any]:
    """Every loaded accelerate/transformers module, and the three that call the functions."""
    return [m for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in ("accelerate", "transformers")]


@contextlib.contextmanager
def route_fsdp_checkpoints(options: StorageOptions | Mapping[str, Any] | None = None) -> Iterator[StorageOptions]:
    """Within the block, Accelerate's four FSDP checkpoint functions — wherever Accelerate, the
    transformers ``Trainer`` or your code call them by name — send ``s3://`` directories
    (``SHARDED_STATE_DICT``, FSDP2) through dcp_s3 with ``options``; yields the options. Not reentrant
    across threads: enter it once, around training, in each process."""
    storage_options = StorageOptions.of(options)
    routed = {name: _bind(name, storage_options) for name in _NAMES}
    replaced: list[tuple[Any, str]] = []
    for module in _holders():
        for name in _NAMES:
            if module.__dict__.get(name) is _ORIGINAL[name]:
                setattr(module, name, routed[name])
                replaced.append((module, name))
    try:
        yield storage_options
    finally:
        for module, name in replaced:
            if module.__dict__.get(name) is routed[name]:
                setattr(module, name, _ORIGINAL[name])
