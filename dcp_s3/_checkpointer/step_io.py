"""The step I/O of the :class:`~dcp_s3._checkpointer.manager.Checkpointer`: where a step lives, the reusable
DCP writers/readers of its parts, which step a load takes (:meth:`StepIO.plan_load`, rank 0) and the
loading of one part (:func:`load_model`, :func:`load_optim`, on every rank, collectively).

The manager decides *what* to save and load (parts, marker, retention, tiers); this module does the
reads and writes of a step's parts on one store. One save per load: rank 0 reads the step's marker once
(:meth:`StepIO.plan_load`) and every rank loads the directories that marker names — each save's own
generation directories (:mod:`dcp_s3._checkpointer.generations`), so a save committing meanwhile cannot
mix in (:mod:`dcp_s3._checkpointer.saves`). A load that reads its parts through another reader
(the local tier's merged copy, :mod:`dcp_s3._checkpointer.tier_reshard`) uses the same two part loaders.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcp_s3._checkpointer.generations import find_complete, plan_parts
from dcp_s3._checkpointer.legacy import is_foreign_step_marker
from dcp_s3._checkpointer.markers import check_marker
from dcp_s3._checkpointer.names import CHECKPOINTER_STEPS
from dcp_s3._checkpointer.ranks import distributed
from dcp_s3._checkpointer.steps import MARKER_FORMAT, MARKER_SUFFIX, scan
from dcp_s3._checkpointer.training_state import on_meta, warn
from dcp_s3._dcp import Store, open_object, open_store
from dcp_s3._planners.optim_match import OptimizerLoadPlanner
from dcp_s3._planners.trainable import TrainableOnlyLoadPlanner
from dcp_s3._untrusted.torch_files import torch_load
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError, ConfigError

__all__ = ["StepIO", "load_model", "load_optim"]


def load_model(reader: Any, model: nn.Module) -> None:
    """Every rank: load ``model``'s trainable state through ``reader`` (a DCP storage reader, already
    pointed at the part). A model entirely on the meta device takes part with an empty plan."""
    if on_meta(model):
        # All collectives, no reads: the planner gives this rank an empty plan.
        dcp.load(
            model.state_dict(),
            storage_reader=reader,
            planner=TrainableOnlyLoadPlanner(model),
            no_dist=not distributed(),
        )
        return
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=reader, planner=TrainableOnlyLoadPlanner(model), no_dist=not distributed())
    set_model_state_dict(model, state)


def load_optim(reader: Any, where: str, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
    """Every rank: load ``optim``'s state through ``reader``; a checkpoint (at ``where``, for the warning)
    that does not match the optimizer is skipped with a warning and the optimizer keeps fresh state."""
    state: dict[str, Any] = {}
    if optim is not None and not on_meta(model):
        state = get_optimizer_state_dict(model, optim)  # initializes fresh state, so DTensor state loads
    # The compatibility check runs inside the load, on the .metadata it reads once and shares
    # (a meta rank, with nothing to load into, plans no reads and never objects).
    planner = OptimizerLoadPlanner(check=bool(state))
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=not distributed())
    if planner.problem is not None:
        warn(
            f"optimizer checkpoint {where} does not match the optimizer ({planner.problem}); "
            "continuing with fresh optimizer state"
        )
        return
    if state and optim is not None:
        set_optimizer_state_dict(model, optim, state)


class StepIO:
    """The stores a Checkpointer touches (its root, and others named by ``path=``) and the writers/readers
    of its parts, reused across steps (``reset`` retargets them): each S3 one owns a client and an I/O
    pool, which are costly to create. One per part, so that the concurrent parts of an async save
    never share one."""

    def __init__(self, store: Store, storage_options: dict[str, Any]) -> None:
        self.root = store
        self.storage_options = storage_options
        self._stores: dict[str, Store] = {store.url(): store}
        self._writers: dict[tuple[str, str, str], Any] = {}
        self._readers: dict[tuple[str, str, str], Any] = {}

    def store(self, root: str) -> Store:
        """The store of ``root`` (opened once)."""
        if root not in self._stores:
            self._stores[root] = open_store(root, **self.storage_options)
        return self._stores[root]

    def object(self, path: str | os.PathLike[str]) -> tuple[Store, str]:
        """(the store holding ``path``, the name of ``path`` in it)."""
        store, name = open_object(path, **self.storage_options)
        return self._stores.setdefault(store.url(), store), name

    def locate(self, path: str | os.PathLike[str] | None, iteration: int) -> tuple[Store, str]:
        """Where a save of ``iteration`` goes: ``<root>/<iteration:07d>``, or the step ``path`` names."""
        if path is None:
            return self.root, f"{int(iteration):07d}"
        store, name = self.object(path)
        if name.endswith(MARKER_SUFFIX):
            name = name[: -len(MARKER_SUFFIX)]
        if not name:
            raise ConfigError(f"path={os.fspath(path)!r} names no step")
        return store, name

    def writer(self, store: Store, name: str, key: str, kind: str) -> tuple[Any, str]:
        """(the reusable writer of part ``key``/``kind``, the location of its directory ``name`` to pass
        as ``checkpoint_id``)."""
        cache = (store.url(), key, kind)
        if cache not in self._writers:
            self._writers[cache] = store.writer(name)
        return self._writers[cache], store.url(name)

    def reader(self, store: Store, name: str, key: str, kind: str) -> Any:
        """The reusable reader of part ``key``/``kind``, pointed at its directory ``name``."""
        cache = (store.url(), key, kind)
        if cache not in self._readers:
            self._readers[cache] = store.reader(name)
        reader = self._readers[cache]
        reader.reset(store.url(name))
        return reader

    def plan_load(
        self, path: str | os.PathLike[str] | None, model_keys: list[str], optim_keys: list[str], allow_missing: bool
    ) -> dict[str, Any] | None:
        """Rank 0: find the step (the newest complete one under the root if ``path`` is None), read its
        marker, check that its parts exist. None: nothing complete under the root."""
        if path is None:
            store: Store = self.root
            unreadable: dict[str, str] = {}
            found = find_complete(store, 1, unreadable, CHECKPOINTER_STEPS)
            for name, why in sorted(unreadable.items()):  # newer than the step found: never resumed from
                warn(f"step {store.url(name)} is not resumed from: its marker cannot be followed: {why}")
            if not found:
                return None
            step = found[-1].name
        else:
            store, step = self.object(path)
            if step.endswith(MARKER_SUFFIX):
                step = step[: -len(MARKER_SUFFIX)]
        marker_name = step + MARKER_SUFFIX
        if path is not None and store.size(marker_name) is None and store.size(step) is not None:
            marker_name = step  # a legacy single file under another name (model.pt)
        if store.size(marker_name) is None:
            partial = [s for s in scan(store.list_objects(f"{step}.")) if s.name == step]
            why = "the save did not complete (no marker)" if partial else "nothing is saved there"
            raise CheckpointNotFoundError(f"no complete checkpoint at {store.url(step)}: {why}")
        marker_data = store.read(marker_name)
        marker = torch_load(marker_data, store.url(marker_name))
        if not isinstance(marker, dict):
            raise CheckpointFormatError(f"{store.url(marker_name)} holds a {type(marker).__name__}, not a checkpoint")
        legacy = marker.get("format") != MARKER_FORMAT and not is_foreign_step_marker(marker)
        if not legacy:
            check_marker(marker, store.url(marker_name))  # its fields by type, before any is used
        plan: dict[str, Any] = {
            "root": store.url(),
            "step": step,
            "marker": marker_name,
            "legacy": legacy,
            "optim": {},
            "marker_data": None if legacy else marker_data,
            "dirs": {},
        }
        if legacy:
            if "model" not in marker:
                raise CheckpointFormatError(
                    f"{store.url(marker_name)} is neither a step marker (dcp_s3's, or one with 'iteration' and "
                    "no model state beside <step>.<key>_model/ checkpoints) nor a single-file checkpoint with "
                    "a 'model' entry"
                )
            return plan
        plan["dirs"], plan["optim"] = plan_parts(
            store, step, marker, marker_name, model_keys, optim_keys, allow_missing
        )
        return plan
