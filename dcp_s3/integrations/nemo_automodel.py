"""NeMo AutoModel's ``Checkpointer`` saving to and resuming from ``s3://`` through dcp_s3.

Chosen by its config (tested with nemo-automodel 0.7.0)::

    from dcp_s3.integrations.nemo_automodel import S3CheckpointingConfig

    checkpointer = S3CheckpointingConfig(
        checkpoint_dir="s3://bucket/run1", max_recent_checkpoints=3,
        endpoint_url="http://127.0.0.1:8333", storage_options={"part_size": 32 << 20},
    ).build(dp_rank=dp_rank, tp_rank=0, pp_rank=0)

NeMo's recipes (the ``automodel`` command) choose it with one YAML key instead: :mod:`dcp_s3.integrations.nemo_recipe`.

It builds an :class:`S3Checkpointer`: NeMo's own ``Checkpointer`` (its ``ModelState``/``OptimizerState``, HF key
adaptation, planners, loads) whose storage, on an ``s3://`` ``checkpoint_dir``, is dcp_s3. A local
``checkpoint_dir`` keeps NeMo's behaviour unchanged.

What one save holds, and its commit. A NeMo checkpoint ``<checkpoint_dir>/<name>/`` is two DCP checkpoints
(``model/``, ``optim/``), perhaps more (``save_distributed_state``), and small files: the RNG state of every
rank (``save_on_global_ranks``), the data loader state of every data-parallel rank (``save_on_dp_ranks``),
and what NeMo's recipes write themselves with ``open``/``torch.save`` — ``losses.json``, ``config.yaml``,
``<key>.pt`` — here :meth:`S3Checkpointer.save_losses`, :meth:`~S3Checkpointer.save_config`,
:meth:`~S3Checkpointer.save_state` (:mod:`dcp_s3.integrations.nemo_files`). On S3 (:mod:`dcp_s3.integrations.nemo_commit`):

- ``lifecycle.reserve(path)`` (every rank, before anything is written, as NeMo's recipes call it) draws one
  *save token* on rank 0 and shares it; a checkpoint already committed at ``path`` is a ``FileExistsError``,
  NeMo's own rule for published checkpoints;
- every object of the save goes below ``<name>/save.<token>/``, in NeMo's layout: no object of another save
  is ever touched, so an interrupted save is replaced by writing a new one, never by deleting;
- ``lifecycle.publish(path, ...)`` (every rank) gathers what each rank wrote, and rank 0 writes the commit
  ``<name>/dcp_s3_commit.json`` (:data:`COMMIT`) with a PUT that never replaces another. Until then ``<name>``
  is no checkpoint.

One save per load: the first load call for a checkpoint reads its commit once (rank 0, shared); every part
and file is then read below the one ``save.<token>/`` it names, and a file it does not list (or of another
size) is refused. The commit is checked field by field before use; ``.pt`` files are loaded with dcp_s3's
checks of untrusted archives (:func:`dcp_s3._untrusted.torch_files.torch_load`), ``weights_only`` unless the
config's ``allow_legacy_pickle_restore`` says the checkpoint is trusted. Retention (``max_recent_checkpoints``)
deletes by ownership: committed ``epoch_<E>_step_<S>`` checkpoints under the configured ``checkpoint_dir``
only, the newest ``max_recent_checkpoints`` by step kept; a name without a commit is neither counted nor deleted.

``is_async`` on S3: each DCP part is saved as NeMo saves it (``dcp.async_save`` with a ``DefaultStager`` and a gloo
group per part, the upload in torch's checkpoint process), with dcp_s3's writer; the upload's future is recorded
with the save, and the commit (``lifecycle.publish``, or ``lifecycle.complete_pending`` after NeMo's recipes'
``defer_publication``) waits for it on every rank, at most ``async_upload_timeout_s``, before rank 0 writes it. A
failed upload fails ``async_wait`` and the commit on every rank, nothing committed. Each upload itself fails at
``async_upload_timeout_s`` (:mod:`dcp_s3.integrations._bounded_upload`): NeMo holds a lock while one runs and the
next ``async_save`` waits for it in the training thread. On a host without an
accelerator the stagers are built with ``StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)``
(NeMo's ``DefaultStager()`` asserts there); with one, with NeMo's default options.

Not supported on ``s3://`` (a ``ConfigError`` when the config is made): ``model_save_format="safetensors"`` and
consolidated HF exports (NeMo writes them through its own file-system writer and consolidation), PEFT adapters
(rank 0 writes them with ``safetensors`` to a file). The ``LATEST``/``LOWEST_VAL`` pointers are not
kept: the latest checkpoint is the newest committed one (:meth:`S3Checkpointer.latest_checkpoint`). The job's
checkpoint process group must span every rank.

NeMo's ``Checkpointer.save_model``/``save_optimizer``/``load_model`` create local directories and check that
the model path exists unless NeMo's ``is_cloud_path`` says the path is remote (true for ``msc://`` only); while
one of those runs on an ``s3://`` path, that function also answers true for ``s3://`` in the thread (or task) running it
(:data:`_remote_paths`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from nemo_automodel.components.checkpoint import checkpointing as nemo_checkpointing
from nemo_automodel.components.checkpoint._backports.filesystem import SerializationFormat
from nemo_automodel.components.checkpoint.checkpointing import (
    Checkpointer,
    _is_model_checkpoint_path,
    _ModelSavePlanner,
    _new_gloo_process_group,
    _OptimizerSavePlanner,
)
from nemo_automodel.components.checkpoint.config import CheckpointingConfig, SaveConsolidatedMode
from nemo_automodel.components.checkpoint.lifecycle import CheckpointLifecycle
from nemo_automodel.components.checkpoint.utils import find_latest_checkpoint
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_s3._checkpointer.ranks import world_size
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._torch_compat import default_stager
from dcp_s3.errors import CheckpointNotFoundError, ConfigError, S3TransferError
from dcp_s3.integrations._bounded_upload import bounded
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations._patching import ContextPatch, Site
from dcp_s3.integrations.nemo_commit import COMMIT, Saves, split_part
from dcp_s3.integrations.nemo_files import RecipeFiles

__all__ = ["S3CheckpointingConfig", "S3Checkpointer", "S3CheckpointLifecycle", "COMMIT"]

logger = logging.getLogger(__name__)


def _cloud_or_s3(_: bool, nemo: Callable[[Any], bool], path: Any) -> bool:
    return nemo(path) or s3_location(path) is not None


#: NeMo's ``checkpointing.is_cloud_path``, answering true for ``s3://`` paths too in the context (thread or task) that
#: runs one of ``S3Checkpointer``'s ``save_model``/``save_optimizer``/``load_model`` on an ``s3://`` path, so that
#: NeMo's own code neither creates local directories for them nor requires them to exist on disk; NeMo's answer
#: elsewhere, and NeMo's function back in place when the last one returns.
_remote_paths: ContextPatch[bool] = ContextPatch(
    "NeMo is_cloud_path", lambda: [Site(nemo_checkpointing, "is_cloud_path", _cloud_or_s3)]
)


def _remote_if_s3(path: str) -> contextlib.AbstractContextManager[Any]:
    """:data:`_remote_paths` for an ``s3://`` path; nothing for a local one."""
    return _remote_paths.scope(True) if s3_location(path) else contextlib.nullcontext()


@dataclass
class S3CheckpointingConfig(CheckpointingConfig):
    """NeMo's ``CheckpointingConfig`` whose ``build()`` makes an :class:`S3Checkpointer` (module docstring).

    Its defaults differ from NeMo's where ``s3://`` needs it: ``model_save_format="torch_save"`` (DCP) and
    ``save_consolidated="false"``."""

    model_save_format: str = "torch_save"
    save_consolidated: bool | str | SaveConsolidatedMode = "false"
    endpoint_url: str | None = None
    """S3 endpoint (None: boto3's own chain, e.g. AWS_ENDPOINT_URL, or AWS itself)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """dcp_s3.StorageOptions keywords for every save, load, listing and deletion (``endpoint_url`` above wins)."""
    async_upload_timeout_s: float = 1800.0
    """With ``is_async``: how long ``async_wait`` and the commit wait, on each rank, for a save's upload."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.options()  # ConfigError now, naming the option, not at the first save
        if not self.async_upload_timeout_s > 0:
            raise ConfigError(f"async_upload_timeout_s={self.async_upload_timeout_s!r}: must be a positive number")
        location = s3_location(self.checkpoint_dir)
        if location is None:
            return
        self.checkpoint_dir = location
        refused = {
            "model_save_format": self.model_save_format != SerializationFormat.TORCH_SAVE,
            "save_consolidated": self.save_consolidated != SaveConsolidatedMode.FALSE,
            "is_peft": self.is_peft,
        }
        bad = [name for name, is_bad in refused.items() if is_bad]
        if bad:
            raise ConfigError(
                f"checkpoint_dir={location}: {', '.join(bad)} not supported on s3:// (use model_save_format="
                "'torch_save', save_consolidated=false, is_peft=False; see "
                "dcp_s3.integrations.nemo_automodel)"
            )

    def options(self) -> StorageOptions:
        """The storage options: ``storage_options`` with ``endpoint_url``."""
        options = StorageOptions.of(self.storage_options)
        return options.replace(endpoint_url=self.endpoint_url) if self.endpoint_url else options

    def build(self, dp_rank: int, tp_rank: int, pp_rank: int, **kwargs: Any) -> S3Checkpointer:
        # docstring inherited (kwargs: NeMo's moe_mesh, process_group, pp_group)
        return S3Checkpointer(self, dp_rank, tp_rank, pp_rank, **kwargs)


class S3Checkpointer(RecipeFiles, Checkpointer):
    """NeMo's ``Checkpointer`` whose ``s3://`` checkpoints go through dcp_s3 (see the module's docstring).

    Besides NeMo's methods, it has the ones for what NeMo's recipes write with ``open``/``torch.save``
    themselves: :meth:`save_losses`, :meth:`save_config`, :meth:`save_state` (rank 0's files) and their loads, and
    :meth:`latest_checkpoint` (on a local ``checkpoint_dir`` too: files there, NeMo's ``find_latest_checkpoint``).
    Every save method needs ``lifecycle.reserve(path)`` first and ``lifecycle.publish(path, ...)`` after (the
    commit), on every rank, as NeMo's recipes call them."""

    def __init__(
        self,
        config: S3CheckpointingConfig,
        dp_rank: int,
        tp_rank: int,
        pp_rank: int,
        moe_mesh: Any = None,
        process_group: Any = None,
        pp_group: Any = None,
    ) -> None:
        if not isinstance(config, S3CheckpointingConfig):
            raise ConfigError(f"S3Checkpointer takes an S3CheckpointingConfig, not a {type(config).__name__}")
        root = s3_location(config.checkpoint_dir)
        s3_async = root is not None and config.is_async
        nemo_config = config
        if s3_async:  # NeMo's __init__ would build DefaultStager(), which asserts without an accelerator
            nemo_config = copy.copy(config)
            nemo_config.is_async = False
        super().__init__(
            nemo_config, dp_rank, tp_rank, pp_rank, moe_mesh=moe_mesh, process_group=process_group, pp_group=pp_group
        )
        self.config = config
        if s3_async:
            for ctx in (self._model_ctx, self._optim_ctx):  # as NeMo's __init__, in its order (group creation)
                ctx.stager = default_stager()
                ctx.process_group = _new_gloo_process_group(process_group) if dist.is_initialized() else None
        owner = f"S3Checkpointer(checkpoint_dir={config.checkpoint_dir}) max_recent_checkpoints"
        self._s3 = Saves(config.options(), root, owner, config.async_upload_timeout_s)
        if (
            self._s3.root is not None
            and process_group is not None
            and dist.get_world_size(process_group) != world_size()
        ):
            raise ConfigError(f"checkpoint_dir={self._s3.root}: the checkpoint process group must span every rank")
        self.lifecycle = S3CheckpointLifecycle(config, process_group, self._s3)

    # -- DCP parts ------------------------------------------------------------------------------------------

    def save_model(self, model: Any, weights_path: str, *args: Any, **kwargs: Any) -> None:
        # docstring inherited
        with _remote_if_s3(weights_path):
            super().save_model(model, weights_path, *args, **kwargs)

    def save_optimizer(self, optimizer: Any, model: Any, weights_path: str, *args: Any, **kwargs: Any) -> None:
        # docstring inherited
        with _remote_if_s3(weights_path):
            super().save_optimizer(optimizer, model, weights_path, *args, **kwargs)

    def load_model(self, model: Any, model_path: str, *args: Any, **kwargs: Any) -> None:
        # docstring inherited
        with _remote_if_s3(model_path):
            super().load_model(model, model_path, *args, **kwargs)

    def _get_storage_reader(self, model_path: str, *args: Any, **kwargs: Any) -> Any:
        location = s3_location(model_path)
        if location is None:
            return super()._get_storage_reader(model_path, *args, **kwargs)
        return self._s3.part_reader(*split_part(location))

    def _pg_kwargs(self) -> dict[str, Any]:
        return {"process_group": self.process_group} if self.process_group is not None else {}

    def _do_save(self, state_dict: dict[str, Any], path: str, storage_writer: Any = None) -> Any:
        location = s3_location(path)
        if location is None:
            return super()._do_save(state_dict, path, storage_writer)
        # No checkpoint_id beside the writer: DCP would reset the writer to it (NeMo's path, not the save's).
        is_model = _is_model_checkpoint_path(location)
        planner_cls = _ModelSavePlanner if is_model else _OptimizerSavePlanner  # NeMo's (plans cached per namespace)
        planner = planner_cls(self._planner_cache_namespace)
        ckpt, part = split_part(location)
        writer = self._s3.part_writer(ckpt, part)
        if not self.config.is_async:
            dcp.save(state_dict, storage_writer=writer, planner=planner, **self._pg_kwargs())
            return None
        # NeMo's async save (Checkpointer._do_save), its upload recorded with the save: the commit waits for it.
        ctx = self._model_ctx if is_model else self._optim_ctx
        if ctx.stager is None:  # async_wait closed the last one
            ctx.stager = default_stager()
        response = dcp.async_save(
            state_dict,
            storage_writer=bounded(writer, self.config.async_upload_timeout_s),  # NeMo's next save waits for it
            planner=planner,
            process_group=ctx.process_group,
            async_stager=ctx.stager,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        ctx.staging_active = True
        self._s3.add_upload(ckpt, response.upload_completion)
        return response

    def async_wait(self) -> None:
        """NeMo's ``async_wait``; on S3 each upload is waited for at most ``async_upload_timeout_s``, and a failed or
        late one is an ``S3TransferError`` (the save is then not committed: its commit fails on every rank)."""
        failed = None
        if self._s3.root is not None:
            for ctx in (self._model_ctx, self._optim_ctx):
                if ctx.future is None:
                    continue
                why = self._s3.wait_upload(ctx.future.upload_completion)
                if why:
                    ctx.future, ctx.staging_active = None, False
                    self._release_async_stager(ctx)
                    failed = failed or why
        super().async_wait()
        if failed:
            raise S3TransferError(f"checkpoint_dir={self._s3.root}: async save not committed: {failed}")

    def _do_load(
        self, state_dict: dict[str, Any], path: str, storage_reader: Any = None, is_init_step: bool = False
    ) -> dict[str, Any]:
        location = s3_location(path)
        if location is None:
            return super()._do_load(state_dict, path, storage_reader, is_init_step)
        reader = self._s3.part_reader(*split_part(location))  # a fresh one: a reader serves one load
        dcp.load(state_dict, storage_reader=reader, **self._pg_kwargs())
        return state_dict

    def save_distributed_state(self, state: Any, state_name: str, path: str) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().save_distributed_state(state, state_name, path)
        dcp.save(
            state.state_dict(),
            storage_writer=self._s3.part_writer(location, state_name),
            planner=dcp.DefaultSavePlanner(),
            **self._pg_kwargs(),
        )
        return None

    def load_distributed_state(self, state: Any, state_name: str, path: str) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().load_distributed_state(state, state_name, path)
        state_dict = state.state_dict()
        dcp.load(state_dict, storage_reader=self._s3.part_reader(location, state_name), **self._pg_kwargs())
        state.load_state_dict(state_dict)
        return None

    def latest_checkpoint(self) -> str | None:
        """Every rank: the newest committed ``epoch_<E>_step_<S>`` under ``checkpoint_dir`` (by step), or None;
        found by rank 0 and shared. A newer name whose commit does not read or whose parts are missing is skipped,
        with a warning."""
        if self._s3.root is None:
            latest = find_latest_checkpoint(self.config.checkpoint_dir)
            return None if latest is None else os.fspath(latest)
        return self._s3.ranks.run_on_rank0(self._s3.latest)

    def close(self) -> None:
        # docstring inherited
        try:
            super().close()
        finally:
            self._s3.close()


class S3CheckpointLifecycle(CheckpointLifecycle):
    """NeMo's ``CheckpointLifecycle`` with, for ``s3://`` checkpoints, the commit of :class:`S3Checkpointer`:
    ``reserve`` draws the save token, ``publish`` writes the commit and applies ``max_recent_checkpoints``."""

    def __init__(self, config: S3CheckpointingConfig, process_group: Any, saves: Saves) -> None:
        super().__init__(config, process_group)
        self._s3 = saves
        self._warned_pointers = False
        self._deferred: list[tuple[str, float | None, str | None]] = []  # s3:// saves deferred by NeMo's async path
        self.with_each_save: list[Callable[[str], None]] = []
        """Called on every rank right after ``reserve`` of an ``s3://`` save, with its path: what a recipe writes into
        every save beside NeMo's own calls (:mod:`dcp_s3.integrations.nemo_recipe`)."""

    def reserve(self, path: str) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().reserve(path)
        self._s3.begin(location)
        for write in self.with_each_save:
            write(location)
        return None

    def publish(self, path: str, *, best_val_metric: float | None, metric_key: str | None) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().publish(path, best_val_metric=best_val_metric, metric_key=metric_key)
        self._s3.commit(location)
        if best_val_metric is not None and not self._warned_pointers:
            self._warned_pointers = True
            warnings.warn(f"dcp_s3: no LOWEST_VAL pointer is kept under {self._s3.root}", stacklevel=2)
        keep = self.config.max_recent_checkpoints
        if self._s3.root is not None and keep is not None:
            self._s3.ranks.run_on_rank0(lambda: self._s3.prune(keep))
        return None

    def defer_publication(self, path: str, *, best_val_metric: float | None, metric_key: str | None) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().defer_publication(path, best_val_metric=best_val_metric, metric_key=metric_key)
        self._deferred.append((location, best_val_metric, metric_key))
        return None

    def complete_pending(self) -> None:
        """NeMo's ``complete_pending``; an ``s3://`` save it deferred is committed by :meth:`publish`, which waits for
        the save's uploads on every rank first."""
        deferred, self._deferred = self._deferred, []
        for location, best_val_metric, metric_key in deferred:
            self.publish(location, best_val_metric=best_val_metric, metric_key=metric_key)
        super().complete_pending()

    def validate_checkpoint_dir_exists(self, ckpt_dir: str, restore_from: str) -> None:
        # docstring inherited
        location = s3_location(ckpt_dir)
        if location is None:
            return super().validate_checkpoint_dir_exists(ckpt_dir, restore_from)
        try:
            self._s3.committed(location)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"restore_from={restore_from!r}: {exc}") from None
        return None
