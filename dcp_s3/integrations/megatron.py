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
  refuses unless weights-only loading would accept them (``dcp_s3.untrusted``), as Megatron-core's own
  ``torch.load`` of ``common.pt`` (weights-only by default) does; classes registered with
  ``torch.serialization.add_safe_globals`` are accepted, ``allow_unsafe_byte_items=True`` accepts anything.

Async (``async_sharded_save=True``) returns Megatron's ``AsyncRequest``, scheduled by the caller as Megatron's
own (``AsyncCallsQueue.schedule_async_request``): planning runs on every rank at once, the tensors are copied
to host memory by its ``preload_fn``, the worker process writes this rank's objects, and the finalize step
(every rank) gathers the results and commits ``.metadata`` on rank 0 — or raises on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import multiprocessing
import os
from collections.abc import Callable, Mapping
from queue import Empty, SimpleQueue
from typing import Any, cast

import torch
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
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from dcp_s3.errors import CheckpointFormatError, ConfigError, DcpS3Error
from dcp_s3.storage.writer import S3StorageWriter
from dcp_s3.store.storage_options import StorageOptions
from dcp_s3.untrusted.torch_files import torch_save_bytes

__all__ = ["COMMON_KEY", "CONFIG_KEY", "save", "load", "load_common_state_dict"]

logger = logging.getLogger("dcp_s3")

#: The DCP key of what Megatron writes to ``common.pt`` (rank 0's common state dict, ``torch.save``d).
COMMON_KEY = "megatron.common.pt"
#: The DCP key of what Megatron writes to ``metadata.json``: its ``CheckpointingConfig`` as a dict (``torch.save``d:
#: a byte item must be a torch archive for the reader's checks).
CONFIG_KEY = "megatron.metadata.json"
_RESERVED = (COMMON_KEY, CONFIG_KEY)
#: The format this module saves and loads (Megatron's ``torch_dist`` backend, version 1; common state ``torch`` 1).
CONFIG = CheckpointingConfig("torch_dist", 1, "torch", 1)
#: How long the finalize step waits for this rank's write results once the worker has ended (they are sent before
#: it ends: a longer wait only means the worker was killed).
RESULT_WAIT_S = 10.0

Options = StorageOptions | Mapping[str, Any] | None


def _location(checkpoint_dir: str | os.PathLike[str]) -> str:
    text = os.fspath(checkpoint_dir)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"checkpoint_dir {checkpoint_dir!r}: expected s3://bucket/key or a local directory")
    return text.rstrip("/")


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
    write = _RankWrite(StorageOptions.of(options).writer(location))
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
    results = _results_queue() if async_sharded_save else SimpleQueue()
    finalize = functools.partial(_finalize, write, metadata, results)
    if not async_sharded_save:
        AsyncRequest(_write_rank, (write, resolved, results), [finalize]).execute_sync()
        return None
    preload = functools.partial(_to_host, resolved)
    return AsyncRequest(_write_rank, (write, resolved, results), [finalize], preload_fn=preload)


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


class _RankWrite:
    """What ``save_state_dict_async_plan`` needs of a storage writer, over an ``S3StorageWriter``.

    Planning calls ``set_up_storage_writer`` / ``prepare_local_plan`` / ``prepare_global_plan`` (the writer's own,
    collectively: rank 0 checks the bucket and names every rank's objects), then ``prepare_write_data``, which
    resolves this rank's items to their tensors and bytes (in the training process, as Megatron's own writer
    does) so that the worker writes them without the planner or the process group."""

    def __init__(self, writer: S3StorageWriter) -> None:
        self.writer = writer
        self.plan: SavePlan | None = None
        self.resolved: dict[MetadataIndex, Any] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.writer.set_up_storage_writer(is_coordinator, *args, rank=dist.get_rank(), **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.writer.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.writer.prepare_global_plan(plans)

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        # The worker may be a process of its own: it must not count itself in the process group's store (the
        # connection is the training process's), so its plan carries no JobCount (rate hand-off only).
        storage = plan.storage_data
        if dataclasses.is_dataclass(storage) and hasattr(storage, "count"):
            plan = dataclasses.replace(plan, storage_data=dataclasses.replace(storage, count=None))
        self.plan = plan
        self.resolved = {item.index: _resolved(item, planner) for item in plan.items}


def _resolved(item: WriteItem, planner: SavePlanner) -> Any:
    data = planner.resolve_data(item)
    return data.detach() if isinstance(data, torch.Tensor) else data


def _to_host(resolved: dict[MetadataIndex, Any]) -> dict[MetadataIndex, Any]:
    """Megatron's ``preload_fn`` for an async save: host copies of the tensors, so that training may go on
    changing its own (and the worker, a process of its own, never touches an accelerator)."""
    return {k: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in resolved.items()}


class _Resolved:
    """The one planner call the writer makes (``resolve_data``), answered from the resolved items."""

    def __init__(self, resolved: dict[MetadataIndex, Any]) -> None:
        self.resolved = resolved

    def resolve_data(self, item: WriteItem) -> Any:
        return self.resolved[item.index]


def _write_rank(write: _RankWrite, resolved: dict[MetadataIndex, Any], results: Any) -> None:
    """The ``async_fn`` (in the worker process for an async save): write this rank's objects, report the results."""
    try:
        assert write.plan is not None, "prepare_write_data ran before the write"
        written = write.writer.write_data(write.plan, cast(SavePlanner, _Resolved(resolved))).wait()
        results.put(("ok", written))
    except BaseException as exc:  # reported, and raised on every rank by the finalize step
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@functools.cache
def _manager() -> Any:
    return multiprocessing.get_context("spawn").Manager()


def _results_queue() -> Any:
    """A queue the worker of an async save can reach however it was started (forked, or Megatron's persistent
    worker, which receives the request pickled): a manager's, as Megatron's own writer uses (one manager per
    process), and one queue per save, so that saves in flight at once never take each other's results."""
    return _manager().Queue()


def _finalize(write: _RankWrite, metadata: Metadata | None, results: Any) -> None:
    """Every rank: gather the write results on rank 0, which commits ``.metadata`` unless a rank failed; a failure
    is raised on every rank (and the checkpoint that was at the path is still the one there)."""
    location = write.writer.checkpoint_id
    try:
        outcome = results.get(timeout=RESULT_WAIT_S)
    except Empty:
        outcome = ("error", f"the writer ended without reporting within {RESULT_WAIT_S} s (was it killed?)")
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(outcome, gathered, dst=0)
    verdict: list[str | None] = [None]
    if gathered is not None:
        failed = {r: detail for r, (kind, detail) in enumerate(gathered) if kind != "ok"}
        if failed:
            verdict[0] = "; ".join(f"rank {r}: {d}" for r, d in sorted(failed.items()))
        else:
            try:
                assert metadata is not None, "rank 0 plans the checkpoint's metadata"
                write.writer.finish(metadata, [written for _, written in gathered])
            except Exception as exc:
                verdict[0] = f"commit on rank 0: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise DcpS3Error(f"Megatron save to {location} failed, nothing committed ({verdict[0]})")
    logger.debug("Megatron checkpoint %s committed", location)


# --------------------------------------------------------------------------------------------------- loading


class _LoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner, which first checks that the checkpoint is one this module saved (its config
    item is there and the common state is) and, when the caller read the checkpoint's metadata first, that
    this load reads the same save (its ``save_id``)."""

    def __init__(self, location: str, save_id: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.location, self.save_id = location, save_id

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
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


def _checkpoint_metadata(location: str, options: StorageOptions) -> tuple[dict[str, Any], str | None]:
    """What Megatron's ``load_sharded_metadata`` returns (ShardedTensors and ShardedObjects without data), read
    from the checkpoint's ``.metadata``, and the save it belongs to."""
    metadata = options.reader(location).read_metadata()
    _check_saved_here(metadata, location)
    sharded: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) and key not in _RESERVED:
            obj = ShardedObject.empty_from_unique_key(key)
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
