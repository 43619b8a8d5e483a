"""torchtitan's ``CheckpointManager`` with every save, load, step discovery and purge through dcp_s3.

Chosen in a torchtitan config (tested with torchtitan 0.3.0)::

    from dcp_s3.integrations.torchtitan import S3CheckpointManager

    checkpoint=S3CheckpointManager.Config(
        enable=True, folder="s3://bucket/run1", interval=500, keep_latest_k=3, async_mode="async",
        endpoint_url="http://127.0.0.1:8333", storage_options={"part_size": 32 << 20},
    )

torchtitan's own manager sends a ``folder="s3://..."`` to torch's fsspec writer and lists, probes
and deletes steps through s3fs (whose listing cache silently stops ``keep_latest_k`` purges). Here:

- saves and async saves (``async_mode="async"``: the upload runs while training goes on) write with
  ``S3StorageWriter`` (dcp_s3's commit protocol: a step exists once its ``.metadata`` does);
- loads read with ``S3StorageReader``; the latest step is the newest ``step-N`` whose ``.metadata``
  exists (a save that never committed is not a step), found by rank 0 alone with one delimiter listing
  of the folder and one HEAD per step tried, newest first, and shared with the other ranks (one
  broadcast per load); ``initial_load_path`` may be an ``s3://`` checkpoint;
- the ``keep_latest_k`` purge counts and deletes committed steps only (:mod:`dcp_s3._checkpointer.ownership`):
  a ``step-N`` without ``.metadata`` — an async upload still running, or what a crash left — is neither
  counted nor deleted, so the purge never leaves the folder without a step to resume from. It runs after
  each save and again once an async save has committed; it deletes a step's objects through the same
  store, ``.metadata`` first (a half-deleted step is never taken for a checkpoint);
- ``endpoint_url`` and ``storage_options`` (``dcp_s3.StorageOptions`` keywords) are given once, for
  all of it. A local ``folder`` works the same way (dcp_s3's writer on disk).

``async_mode="async_with_pinned_mem"``: torchtitan's own ``DefaultStager`` (pinned shared memory,
staging in the background) and torch's upload process, with ``S3StorageWriter`` sent to that process;
the step commits in it, and the purge counts it once ``upload_completion`` is done. Final saves in
Hugging Face initial loads (``initial_load_in_hf``) from an ``s3://`` ``initial_load_path`` read the export with
``dcp_s3.S3HuggingFaceStorageReader`` (each rank only the byte ranges of its shards; an export without its
``model.safetensors.index.json`` or ``model.safetensors`` is refused as incomplete), through the model's
``sd_adapter`` as torchtitan does (torchtitan itself refuses a remote one); from a local path they keep torchtitan's
own code, as do final saves in Hugging Face format (``last_save_in_hf``: local folders only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import MODEL, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.tools.utils import GarbageCollection

from dcp_s3._checkpointer.ownership import Ownership
from dcp_s3._checkpointer.ranks import Ranks
from dcp_s3._dcp.hf_reader import INDEX_NAME, SINGLE_NAME, S3HuggingFaceStorageReader
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._dcp.store import Store
from dcp_s3._layout import METADATA_KEY
from dcp_s3.errors import CheckpointNotFoundError, ConfigError
from dcp_s3.integrations._locations import s3_location

if TYPE_CHECKING:  # torch >= 2.9 (torchtitan 0.3.0's own torch); this module is imported on older ones too
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

__all__ = ["S3CheckpointManager"]

logger = logging.getLogger(__name__)

#: torchtitan's step directories: ``step-<N>`` (``CheckpointManager._create_checkpoint_id``).
_STEP_DIR = re.compile(r"step-([0-9]+)")  # ASCII digits: dcp_s3._checkpointer.names


class S3CheckpointManager(CheckpointManager):
    """``CheckpointManager`` whose storage is dcp_s3 (see the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        endpoint_url: str | None = None
        """S3 endpoint (None: boto3's own chain, e.g. AWS_ENDPOINT_URL, or AWS itself)."""

        storage_options: dict[str, int | float | bool | str | None] = field(default_factory=dict)
        """dcp_s3.StorageOptions keywords for every save, load, listing and purge (part_size, compression,
        max_concurrency, region, profile, ...); endpoint_url above wins over one given here."""

        def __post_init__(self) -> None:
            # torchtitan refuses an HF initial load from a remote path (fsspec reads whole files, if at all); dcp_s3
            # reads an s3:// one itself: torchtitan's other checks run with the flag, that one without it.
            hf_on_s3 = self.initial_load_in_hf and s3_location(self.initial_load_path) is not None
            if hf_on_s3 and self.initial_load_in_hf_quantized:
                raise ConfigError(
                    f"checkpoint.initial_load_in_hf_quantized: a quantized export is read by the model's own "
                    f"sd_adapter reader, from a local path, not from {self.initial_load_path}"
                )
            if hf_on_s3 and not self.initial_load_model_only:
                raise ConfigError("checkpoint.initial_load_in_hf requires checkpoint.initial_load_model_only")
            self.initial_load_in_hf = not hf_on_s3 and self.initial_load_in_hf
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.initial_load_in_hf = hf_on_s3 or self.initial_load_in_hf
            self.options()  # ConfigError now, naming the option, not at the first save

        def options(self) -> StorageOptions:
            """The storage options: ``storage_options`` with ``endpoint_url``."""
            options = StorageOptions.of(self.storage_options)
            return options.replace(endpoint_url=self.endpoint_url) if self.endpoint_url else options

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.storage_options = config.options()
        self._folder_store: Store | None = None
        self._store_lock = threading.Lock()  # the purge thread and the training thread share the store
        self._ranks = Ranks()  # rank 0 finds what to load and tells the others
        super().__init__(config, **kwargs)
        if not self.enable or self.purge_thread is None:  # type: ignore[has-type]  # torchtitan's, untyped
            return
        # torchtitan's purge thread deletes with fsspec (bound when it starts): replaced by one that
        # deletes through the store, reading the same queue with torchtitan's own loop.
        self.purge_queue.put(None)
        self.purge_thread.join()  # type: ignore[has-type]
        self.purge_thread = threading.Thread(
            target=purge_thread, args=(self.purge_queue, self._remove_checkpoint), daemon=True, name="dcp_s3-purge"
        )
        self.purge_thread.start()

    # -- where things are ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _at(self, location: str) -> Iterator[tuple[Store, str]]:
        """(store, name prefix) of ``location``: the checkpoint folder's store for what lies in it
        (one client for the run), else a store of its own for the call."""
        folder = self.folder.rstrip("/")
        if location.rstrip("/") == folder or location.startswith(folder + "/"):
            with self._store_lock:
                if self._folder_store is None:
                    self._folder_store = self.storage_options.store(folder)
            rest = location.rstrip("/")[len(folder) + 1 :]
            yield self._folder_store, rest + "/" if rest else ""
            return
        store = self.storage_options.store(location)
        try:
            yield store, ""
        finally:
            store.close()

    def _steps(self, folder: str) -> list[int]:
        """The N of every ``step-N/`` directly in ``folder``, committed or not, ascending (one listing)."""
        with self._at(folder) as (store, prefix):
            _, subdirs = store.list_dir(prefix)
        names = (sub[len(prefix) :].rstrip("/") for sub in subdirs)
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.fullmatch, names) if m)

    def _committed(self, checkpoint_id: str) -> bool:
        """Whether a DCP checkpoint is committed at ``checkpoint_id`` (its ``.metadata`` exists)."""
        with self._at(checkpoint_id) as (store, prefix):
            return store.size(prefix + METADATA_KEY) is not None

    # -- torchtitan's hooks ----------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step whose ``.metadata`` exists in ``folder`` (default: the checkpoint folder), or -1."""
        folder = folder or self.folder
        for step in reversed(self._steps(folder)):
            if self._committed(self._create_checkpoint_id(step, folder)):
                return step
        return -1

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        if to_hf:  # torchtitan's HF writer, local folders only (its Config refuses a remote one)
            return CheckpointManager.dcp_save(
                self, state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        # No checkpoint_id beside the writer: DCP would reset the writer to it (and on a path, to disk).
        writer = self.storage_options.writer(checkpoint_id)
        result: Future[Any] | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torchtitan's stager (pinned shared memory) stages in the background; torch's upload process
            # gets a pickled copy of the writer (no pinned pool travels: Stagings starts empty there).
            result = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        elif async_mode == AsyncMode.ASYNC:
            # S3StorageWriter stages (copies the state to CPU) before this returns; the upload then runs
            # in torch's thread. torch >= 2.9 returns the upload's future itself for such a stager.
            response: Any = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
            result = getattr(response, "upload_completion", response)
        else:
            dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf and s3_location(checkpoint_id) is None:  # torchtitan's HF reader (local paths)
            return CheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        if from_hf:  # torchtitan's own steps, with dcp_s3's reader of the export
            if self.sd_adapter is None:
                raise ConfigError("checkpoint.initial_load_in_hf needs the model's sd_adapter (its HF names)")
            hf_state_dict = self.sd_adapter.to_hf(state_dict)
            reader = self.storage_options.reader(checkpoint_id, S3HuggingFaceStorageReader)
            dcp.load(hf_state_dict, storage_reader=reader)
            state_dict = self.sd_adapter.from_hf(hf_state_dict)
            self.states[MODEL].load_state_dict(state_dict)
            return None
        dcp.load(state_dict, storage_reader=self.storage_options.reader(checkpoint_id))
        if MODEL in self.states:  # as torchtitan does: the model's keys are flattened into state_dict
            self.states[MODEL].load_state_dict(state_dict)
        return None

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """torchtitan's load, with step discovery and every existence check through the store, made on
        rank 0 alone and shared (errors included): one listing and its HEADs per load, not one per rank,
        and every rank loads the same step."""
        plan = self._ranks.run_on_rank0(lambda: self._plan_load(step))
        if plan is None:
            logger.info("No checkpoint in %s: a fresh start.", self.folder)
            return False
        checkpoint_id, model_only, from_hf, from_quantized = plan
        logger.info("Loading the checkpoint from %s.", checkpoint_id)
        self.dcp_load(
            self._states_to_load(model_only),
            checkpoint_id=checkpoint_id,
            from_hf=from_hf,
            from_quantized=from_quantized,
        )
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _plan_load(self, step: int) -> tuple[str, bool, bool, bool] | None:
        """Rank 0: (checkpoint id, model only, from HF, quantized) of what to load, or None for a fresh start."""
        load_step = self._find_load_step() if step == -1 else step
        if step != -1 and not self._committed(self._create_checkpoint_id(step)):
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: no committed checkpoint at {self._create_checkpoint_id(step)}"
            )
        if load_step != -1:  # step 0 is torchtitan's seed checkpoint: the model only
            return self._create_checkpoint_id(load_step), load_step == 0, False, False
        from_hf, from_quantized = self.initial_load_in_hf, self.initial_load_in_hf_quantized
        if self.initial_load_path:
            checkpoint_id = self.initial_load_path
            if from_hf and s3_location(checkpoint_id) is not None:
                if not self._hf_export(checkpoint_id):
                    raise CheckpointNotFoundError(
                        f"checkpoint.initial_load_path {checkpoint_id}: no Hugging Face export there (neither "
                        f"{INDEX_NAME} nor {SINGLE_NAME}; shards without their index are an incomplete export)"
                    )
            elif from_hf:
                if not os.path.isdir(checkpoint_id):
                    raise CheckpointNotFoundError(f"checkpoint.initial_load_path {checkpoint_id}: no such directory")
            elif not self._committed(checkpoint_id):
                raise CheckpointNotFoundError(
                    f"checkpoint.initial_load_path {checkpoint_id}: no committed checkpoint there (no .metadata)"
                )
        elif from_hf:
            assert self.sd_adapter and self.sd_adapter.hf_assets_path, "from_hf needs sd_adapter.hf_assets_path"
            checkpoint_id = self.sd_adapter.hf_assets_path
        else:
            return None
        return checkpoint_id, self.initial_load_model_only, from_hf, from_quantized

    def _hf_export(self, location: str) -> bool:
        """Whether ``location`` holds a Hugging Face export's index or single file (a 404 each: no; an error
        raises)."""
        with self._at(location) as (store, prefix):
            return any(store.size(prefix + name) is not None for name in (INDEX_NAME, SINGLE_NAME))

    def _should_purge(self) -> bool:
        return self.keep_latest_k > 0 and dist.get_rank() == 0

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        self._purge_stale_checkpoints()  # the async save has committed: now it counts

    def _ownership(self) -> Ownership:
        """What the purge may delete: ``step-N`` (as torchtitan names them) directly in the folder."""
        return Ownership(f"S3CheckpointManager(folder={self.folder}) keep_latest_k", self.folder.rstrip("/"), _STEP_DIR)

    def _purge_stale_checkpoints(self) -> None:
        """Queue every committed step but the newest ``keep_latest_k`` for the purge thread. A step without
        ``.metadata`` (an async upload in progress, a crashed save) is neither counted nor purged."""
        if not self._should_purge():
            return
        ownership = self._ownership()
        committed = [
            step
            for step in self._steps(self.folder)
            if ownership.owns(f"step-{step}") and self._committed(self._create_checkpoint_id(step))
        ]
        for step in committed[: -self.keep_latest_k]:
            self.purge_queue.put(self._create_checkpoint_id(step))

    def _remove_checkpoint(self, checkpoint_id: str) -> None:
        """Delete a committed step this manager names: its ``.metadata`` first (the step is then no
        checkpoint), then the rest; anything else (not committed, not ``step-N`` in the folder) stays."""
        with self._at(checkpoint_id) as (store, prefix):
            if self._ownership().deletable(store, checkpoint_id) is None:
                return
            store.delete([prefix + METADATA_KEY])
            store.delete([entry.name for entry in store.list_objects(prefix)])

    def _close(self) -> None:
        super()._close()  # joins the purge thread: every queued purge is done
        store, self._folder_store = self._folder_store, None
        if store is not None:
            store.close()
