"""Megatron-core ``dist_checkpointing`` (the ``torch_dist`` format) saving to and loading from ``s3://``.

One line for a user (tested with megatron-core 0.16.1)::

    from dcp_s3.integrations.megatron import save, load   # instead of megatron.core.dist_checkpointing's

    save(sharded_state_dict, "s3://bucket/run1/iter_0000100", options={"endpoint_url": "http://..."})
    request = save(sharded_state_dict, "s3://...", async_sharded_save=True)  # Megatron's AsyncRequest
    state = load(sharded_state_dict, "s3://bucket/run1/iter_0000100")

Why not a strategy passed to Megatron's own ``save``/``load``: those do file I/O of their own around the
strategies — rank 0 lists the directory (``Path.iterdir``), ``common.pt`` is a ``torch.save`` to a local
path, ``metadata.json`` is written with ``open`` after the tensors and read with ``os.path.exists`` /
``open`` before a load — and only NVIDIA's multi-storage-client can replace them. So ``save`` and ``load``
here run Megatron's own steps (``save_preprocess`` / ``load_preprocess``, sharding validation, the
``torch_dist`` translation of ShardedTensors and ShardedObjects, ``MCoreSavePlanner`` / ``MCoreLoadPlanner``,
``save_state_dict_async_plan``, ``AsyncRequest``) with dcp_s3's ``S3StorageWriter`` / ``S3StorageReader`` in
place of its file-system writer and readers, and with no file of their own:

- one commit: what Megatron writes to ``common.pt`` (rank 0's common state dict) and to ``metadata.json``
  (the ``CheckpointingConfig``) are two byte items of the same DCP checkpoint (:data:`COMMON_KEY`,
  :data:`CONFIG_KEY`), so the checkpoint's ``.metadata`` commits tensors, objects, common state and config at
  once; a save that fails or is killed before it leaves the checkpoint that was at the path loadable;
- one save per load: everything a load returns comes from one ``dcp.load`` of one ``.metadata`` (and the
  strict modes that first read the checkpoint's metadata check that the load read the same save, by its
  ``save_id``), so the common state never comes from another save than the tensors;
- hostile input: the common state, the config and every ShardedObject are byte items, which the reader
  refuses unless weights-only loading would accept them (``dcp_s3._untrusted``), as Megatron-core's own
  ``torch.load`` of ``common.pt`` (weights-only by default) does; classes registered with
  ``torch.serialization.add_safe_globals`` are accepted, ``allow_unsafe_byte_items=True`` accepts anything.

Async (``async_sharded_save=True``) returns Megatron's ``AsyncRequest``, scheduled by the caller as Megatron's
own (``AsyncCallsQueue.schedule_async_request``): planning runs on every rank at once, the tensors are copied
to host memory by its ``preload_fn``, the worker process writes this rank's objects, and the finalize step
(every rank) gathers the results and commits ``.metadata`` on rank 0 — or raises on every rank
(:mod:`dcp_s3.integrations.megatron_async`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import re
from collections.abc import Callable, Mapping
from queue import SimpleQueue
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base, force_all_tensors_to_non_fp8
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._untrusted.torch_files import torch_save_bytes
from dcp_s3.errors import CheckpointFormatError, ConfigError
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations.megatron_async import RankWrite, finalize, results_queue, to_host, write_rank

__all__ = ["COMMON_KEY", "CONFIG_KEY", "save", "load", "load_common_state_dict"]

logger = logging.getLogger(__name__)

#: The DCP key of what Megatron writes to ``common.pt`` (rank 0's common state dict, ``torch.save``d).
COMMON_KEY = "megatron.common.pt"
#: The DCP key of what Megatron writes to ``metadata.json``: its ``CheckpointingConfig`` as a dict (``torch.save``d:
#: a byte item must be a torch archive for the reader's checks).
CONFIG_KEY = "megatron.metadata.json"
_RESERVED = (COMMON_KEY, CONFIG_KEY)
#: The format this module saves and loads (Megatron's ``torch_dist`` backend, version 1; common state ``torch`` 1).
CONFIG = CheckpointingConfig("torch_dist", 1, "torch", 1)

Options = StorageOptions | Mapping[str, Any] | None


def _location(checkpoint_dir: str | os.PathLike[str]) -> str:
    text = os.fspath(checkpoint_dir)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"checkpoint_dir {checkpoint_dir!r}: expected s3://bucket/key or a local directory")
    return s3_location(checkpoint_dir) or text.rstrip("/")


def _bytes_item(obj: Any) -> io.BytesIO:
    return io.BytesIO(torch_save_bytes(obj))


# --------------------------------------------------------------------------------------------------- saving


def save(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    content_metadata: dict[str, Any] | None = None,
    *,
    options: Options = None,
) -> AsyncRequest | None:
    """``megatron.core.dist_checkpointing.save`` with the ``torch_dist`` format, to any dcp_s3 location.

    Every rank calls it (a collective). Megatron's arguments, in its order, plus ``options`` (a
    :class:`dcp_s3.StorageOptions` or a mapping of its keywords: endpoint, credentials, ``overwrite``,
    ``compression``...). ``sharded_strategy`` may be None, ``("torch_dist", 1)`` or a
    ``TorchDistSaveShardedStrategy`` (its ``keep_only_main_replica`` is honoured); ``common_strategy`` None, as
    Megatron's own requires. Returns None once committed, or with ``async_sharded_save`` the ``AsyncRequest`` to
    schedule (nothing is committed until its finalize step ran).
    """
    location = _location(checkpoint_dir)
    keep_only_main_replica = _save_strategy(sharded_strategy, common_strategy, location)
    if content_metadata is not None:
        sharded_state_dict["content_metadata"] = content_metadata
    sharded_part, common_state_dict = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica)
    clash = sorted(set(flat) & set(_RESERVED))
    if clash:
        raise ConfigError(f"sharded keys {clash} are reserved for Megatron's common state in {location}")
    pyt_state_dict: dict[str, Any] = mcore_to_pyt_state_dict(flat, False)
    if dist.get_rank() == 0:  # rank 0 alone writes common.pt and metadata.json in Megatron's own save
        pyt_state_dict[COMMON_KEY] = _bytes_item(common_state_dict)
        pyt_state_dict[CONFIG_KEY] = _bytes_item(dataclasses.asdict(CONFIG))
    write = RankWrite(StorageOptions.of(options).writer(location))
    (_, metadata, _), *_ = save_state_dict_async_plan(
        pyt_state_dict,
        write,
        None,
        0,
        planner=MCoreSavePlanner(
            dedup_replicated_tensors=not keep_only_main_replica,
            flatten_state_dict=False,
            can_run_decentralized_global_plan=False,
        ),
    )
    resolved, write.resolved = write.resolved, {}  # travels as the request's second argument only
    results = results_queue() if async_sharded_save else SimpleQueue()
    finalize_fn = functools.partial(finalize, write, metadata, results)
    if not async_sharded_save:
        AsyncRequest(write_rank, (write, resolved, results), [finalize_fn]).execute_sync()
        return None
    preload = functools.partial(to_host, resolved)
    return AsyncRequest(write_rank, (write, resolved, results), [finalize_fn], preload_fn=preload)


def _save_strategy(sharded_strategy: Any, common_strategy: Any, location: str) -> bool:
    """``keep_only_main_replica`` of the strategy Megatron's caller passed; ``ConfigError`` for any other format."""
    if common_strategy is not None:
        raise ConfigError(f"save to {location}: common_strategy must be None (the common state is inside the commit)")
    if sharded_strategy is None or sharded_strategy == ("torch_dist", 1):
        return True
    if isinstance(sharded_strategy, TorchDistSaveShardedStrategy):
        return bool(sharded_strategy.keep_only_main_replica)
    raise ConfigError(
        f"save to {location}: sharded_strategy {sharded_strategy!r} is not supported (only torch_dist: None, "
        "('torch_dist', 1) or a TorchDistSaveShardedStrategy)"
    )


# --------------------------------------------------------------------------------------------------- loading


class _LoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner, which first checks that the checkpoint is one this module saved (its config
    item is there and the common state is) and, when the caller read the checkpoint's metadata first, that
    this load reads the same save (its ``save_id``)."""

    def __init__(self, location: str, save_id: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.location, self.save_id = location, save_id

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # Empty metadata is the reader's stand-in for one it could not read (a killed save's path has no
        # ``.metadata``): torch sets up the planner before the reader raises its own error, which names the path
        # and the cause; checking the stand-in here would hide that error behind "not a Megatron checkpoint".
        if metadata is not None and metadata.state_dict_metadata:
            _check_saved_here(metadata, self.location)
            found = getattr(metadata.storage_meta, "save_id", None)
            if self.save_id is not None and found != self.save_id:
                raise CheckpointFormatError(
                    f"{self.location} was replaced while loading (save {found}, its metadata was read from save "
                    f"{self.save_id}): load again"
                )
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _check_saved_here(metadata: Metadata, location: str) -> None:
    for key in _RESERVED:
        if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
            raise CheckpointFormatError(
                f"{location} is not a Megatron checkpoint saved by dcp_s3.integrations.megatron (no byte item {key})"
            )


def _check_config(stored: Any, location: str) -> None:
    if not isinstance(stored, dict) or stored != dataclasses.asdict(CONFIG):
        raise CheckpointFormatError(
            f"{location}: Megatron checkpoint config {stored!r}, expected {dataclasses.asdict(CONFIG)}"
        )


#: Megatron's ``ShardedObject.unique_key``: ``<key>/shard_<global offset>_<global shape>``, each a dot-separated
#: list of ASCII decimal numbers (of up to 19 digits: ``int`` refuses longer text in some settings). An offset one
#: longer than the shape is Megatron's older spelling (``empty_from_unique_key`` then appends -1 to the shape).
_OBJECT_KEY = re.compile(
    r"(.+)/shard_((?:[0-9]{1,19}(?:\.[0-9]{1,19})*)?)_((?:[0-9]{1,19}(?:\.[0-9]{1,19})*)?)", re.ASCII | re.S
)


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")) if text else ()


def _sharded_object(key: str, location: str) -> ShardedObject:
    """The data-less ``ShardedObject`` a stored byte item's ``key`` names (Megatron's ``empty_from_unique_key``,
    which unpacks, ``assert``s and ``int()``s unchecked text); ``CheckpointFormatError`` naming the checkpoint and
    the entry for a key Megatron could not have written."""
    match = _OBJECT_KEY.fullmatch(key)
    offset, shape = (_numbers(match.group(2)), _numbers(match.group(3))) if match else ((), ())
    if len(shape) + 1 == len(offset):
        shape += (-1,)
    if match is None or len(offset) != len(shape):
        raise CheckpointFormatError(
            f"{location}: stored byte item {key!r} is not a Megatron ShardedObject key "
            "(<key>/shard_<offset>_<shape>, ASCII digits, as many offsets as shape dimensions)"
        )
    return ShardedObject(match.group(1), None, shape, offset, replica_id=0)


def _checkpoint_metadata(location: str, options: StorageOptions) -> tuple[dict[str, Any], str | None]:
    """What Megatron's ``load_sharded_metadata`` returns (ShardedTensors and ShardedObjects without data), read
    from the checkpoint's ``.metadata``, and the save it belongs to."""
    metadata = options.reader(location).read_metadata()
    _check_saved_here(metadata, location)
    sharded: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) and key not in _RESERVED:
            obj = _sharded_object(key, location)
            sharded[obj.unique_key] = obj
    sharded.update(TorchDistLoadShardedStrategy().load_tensors_metadata(location, metadata))
    return sharded, getattr(metadata.storage_meta, "save_id", None)


def load(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    options: Options = None,
) -> Any:
    """``megatron.core.dist_checkpointing.load`` of a checkpoint :func:`save` wrote; every rank calls it.

    Returns what Megatron's returns: the loaded state dict (the common state merged with the requested
    ShardedTensors and ShardedObjects), or with a ``strict`` mode that returns mismatches, ``(state dict,
    missing keys, unexpected keys)``. The storage ``options`` are the reader's (``allow_unsafe_byte_items``...).
    ``sharded_strategy`` may be None, ``("torch_dist", 1)`` or a ``TorchDistLoadShardedStrategy``; ``common_strategy``
    None or ``("torch", 1)``.
    """
    location = _location(checkpoint_dir)
    _load_strategy(sharded_strategy, common_strategy, location)
    opts = StorageOptions.of(options)
    force_all_tensors_to_non_fp8(sharded_state_dict)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    strict = parse_strict_flag(strict)
    ckpt_metadata, save_id = None, None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata, save_id = _checkpoint_metadata(location, opts)
    local_md, global_md = None, None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_md, global_md = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, missing, unexpected = validate_integrity_and_strict_load(
        sharded_state_dict, strict, validate_access_integrity, local_md, global_md, ckpt_metadata
    )
    common, loaded = _load_one_save(sharded_state_dict, location, opts, save_id)
    merge(common, nonpersistent)
    merge(common, loaded)
    common = apply_factory_merges(common, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common


def _load_strategy(sharded_strategy: Any, common_strategy: Any, location: str) -> None:
    sharded_ok = sharded_strategy in (None, ("torch_dist", 1)) or isinstance(
        sharded_strategy, TorchDistLoadShardedStrategy
    )
    if not sharded_ok or common_strategy not in (None, ("torch", 1)):
        raise ConfigError(
            f"load of {location}: strategies {sharded_strategy!r}, {common_strategy!r} are not supported (only "
            "torch_dist: None, ('torch_dist', 1) or a TorchDistLoadShardedStrategy; common None or ('torch', 1))"
        )


def _load_one_save(
    sharded_state_dict: dict[str, Any], location: str, options: StorageOptions, save_id: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``dcp.load``: the requested tensors and objects (Megatron's ``TorchDistLoadShardedStrategy.load`` steps,
    with dcp_s3's reader) together with the common state and the config, so that all come from one save."""
    tensors = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
    flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
    pyt_state_dict: dict[str, Any] = mcore_to_pyt_state_dict(flat, True)
    pyt_state_dict[COMMON_KEY], pyt_state_dict[CONFIG_KEY] = io.BytesIO(), io.BytesIO()
    planner = _LoadPlanner(
        location,
        save_id,
        shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
        allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
    )
    dcp.load(pyt_state_dict, storage_reader=options.reader(location), planner=planner)
    common, config = pyt_state_dict.pop(COMMON_KEY), pyt_state_dict.pop(CONFIG_KEY)
    _check_config(config, location)
    if not isinstance(common, dict):
        raise CheckpointFormatError(f"{location} ({COMMON_KEY}): expected a dict, found {type(common).__name__}")
    mcore = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
    mcore = _replace_sharded_keys_with_state_dict_keys(mcore, flat_mapping, rename_mapping)
    _restore_dict_types(mcore, sharded_state_dict)
    return common, mcore


def load_common_state_dict(checkpoint_dir: str | os.PathLike[str], *, options: Options = None) -> dict[str, Any]:
    """Megatron's ``load_common_state_dict``: the common state alone (one small read), checked as a byte item.
    Every rank calls it (a collective), or one process without a process group."""
    location = _location(checkpoint_dir)
    state: dict[str, Any] = {COMMON_KEY: io.BytesIO(), CONFIG_KEY: io.BytesIO()}
    opts = StorageOptions.of(options)
    dcp.load(state, storage_reader=opts.reader(location), planner=_LoadPlanner(location, None))
    _check_config(state[CONFIG_KEY], location)
    common = state[COMMON_KEY]
    if not isinstance(common, dict):
        raise CheckpointFormatError(f"{location} ({COMMON_KEY}): expected a dict, found {type(common).__name__}")
    return common
