"""The Lightning ``Trainer``'s ``ModelParallelStrategy`` and ``ModelCheckpoint`` with ``s3://`` checkpoints through dcp_s3.

    trainer = Trainer(
        strategy=S3TrainerStrategy(options={"endpoint_url": ...}),
        callbacks=[S3ModelCheckpoint("s3://bucket/run", save_top_k=2, monitor="step", mode="max")],
    )
    trainer.fit(model, ckpt_path="s3://bucket/run/epoch=0-step=100.ckpt")   # resume

Each checkpoint is one DCP checkpoint: model and optimizer shards and the rest of Lightning's
checkpoint (loops, callbacks, schedulers, hyper-parameters: its ``meta.pt``) inside it
(:mod:`~dcp_s3.integrations.lightning_io`), committed at once and read from the bucket by every
rank. ``S3ModelCheckpoint`` is ``ModelCheckpoint`` that finds, and through the strategy deletes,
checkpoints in the bucket (Lightning's asks fsspec/s3fs and deletes only local directories).
Paths that are not ``s3://`` go to Lightning's own code unchanged.

Rotation deletes by ownership (:mod:`dcp_s3._checkpointer.ownership`): only committed checkpoints under
the callback's own ``dirpath`` whose names its ``filename``/``last`` templates make. Lightning restores
``best_model_path`` from a checkpoint even when ``dirpath`` changed, and guards "outside dirpath" for
local paths only: a fine-tune resumed from another run's checkpoint, or a crafted stored path, would
otherwise have that path deleted. The strategy deletes nothing that no ``S3ModelCheckpoint`` of its
trainer owns, nor the checkpoint the trainer resumed from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from dcp_s3._checkpointer.ownership import Ownership, refuse
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3.errors import CheckpointFormatError, ConfigError
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations.lightning_io import (
    checkpoint_exists,
    delete_checkpoint,
    list_checkpoints,
    load_sharded,
    save_sharded,
)

__all__ = ["S3TrainerStrategy", "S3ModelCheckpoint"]


class S3TrainerStrategy(ModelParallelStrategy):
    """``lightning.pytorch.strategies.ModelParallelStrategy`` whose ``s3://`` checkpoints go through dcp_s3.

    ``options``: a :class:`dcp_s3.StorageOptions` or a mapping of its keywords, used for every save,
    load, listing and removal; the other arguments are ``ModelParallelStrategy``'s.
    ``save_distributed_checkpoint=False`` is refused for ``s3://`` paths.
    """

    def __init__(self, *args: Any, options: StorageOptions | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_options = StorageOptions.of(options)
        #: What this strategy may delete: the rotations of its trainer's S3ModelCheckpoints (set up by them).
        self.ownerships: list[Ownership] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        filepath = self.broadcast(filepath)  # rank 0's path, before Lightning makes a Path of it
        location = s3_location(filepath)
        if location is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise ConfigError(
                f"save_checkpoint(..., {location}, storage_options=...): give the storage options to "
                f"{type(self).__name__}(options=...)"
            )
        if not self._save_distributed_checkpoint:
            raise ConfigError(
                f"{type(self).__name__}(save_distributed_checkpoint=False) writes one torch.save file; "
                f"{location} takes sharded checkpoints only"
            )
        checkpoint = dict(checkpoint)
        tensors: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{idx}"] = optim_state
        save_sharded(tensors, checkpoint, location, self.storage_options, rank=self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint_path = self.broadcast(checkpoint_path)
        location = s3_location(checkpoint_path)
        if location is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        optimizers = {f"optimizer_{idx}": optimizer for idx, optimizer in enumerate(self.optimizers)}
        metadata = load_sharded(
            location,
            "state_dict",
            self.model,
            optimizers,
            self.storage_options,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )
        if metadata is None:
            raise CheckpointFormatError(
                f"{location} holds no Lightning metadata (loops, callbacks): it was not saved by a Trainer with "
                f"{type(self).__name__}"
            )
        return metadata

    def remove_checkpoint(self, filepath: Any) -> None:
        location = s3_location(filepath)
        if location is None:
            super().remove_checkpoint(filepath)
            return
        if not self.is_global_zero:
            return
        owner = next((o for o in self.ownerships if o.name_of(location) is not None), None)
        if owner is None:
            refuse(
                type(self).__name__, location, "no S3ModelCheckpoint of this trainer made that name under its dirpath"
            )
            return
        store = self.storage_options.store(owner.root)
        try:
            if owner.deletable(store, location) is not None:
                delete_checkpoint(location, self.storage_options)
        finally:
            store.close()

    def checkpoint_exists(self, filepath: Any) -> bool:
        """Whether a committed checkpoint is at ``filepath`` (an ``s3://`` location)."""
        return checkpoint_exists(_required_location(filepath), self.storage_options)

    def list_checkpoints(self, dirpath: Any) -> list[str]:
        """The committed checkpoints directly under ``dirpath`` (an ``s3://`` location), sorted."""
        return list_checkpoints(_required_location(dirpath), self.storage_options)


def _required_location(path: Any) -> str:
    location = s3_location(path)
    if location is None:
        raise ConfigError(f"{path!r} is not an s3:// location")
    return location


class S3ModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` saving to ``dirpath`` (an ``s3://`` location) with :class:`S3TrainerStrategy`.

    Every ``ModelCheckpoint`` argument works as there (``save_top_k``, ``every_n_train_steps``,
    ``save_last``, ``filename``...), except ``save_last="link"`` (links are local only). Existence
    checks and the search for ``last`` checkpoints list the bucket (committed checkpoints only), and
    rotation deletes the rotated checkpoint from the bucket, through the trainer's strategy.
    """

    def __init__(self, dirpath: Any, **kwargs: Any) -> None:
        location = s3_location(dirpath)
        if location is None:
            raise ConfigError(
                f"S3ModelCheckpoint(dirpath={dirpath!r}): expected an s3:// location (for a local directory use "
                "lightning's ModelCheckpoint)"
            )
        if kwargs.get("save_last") == "link":
            raise ConfigError(f"S3ModelCheckpoint({location}, save_last='link'): links are for local directories only")
        super().__init__(dirpath=None, **kwargs)  # Lightning's would open an fsspec filesystem (s3fs) for it
        self.dirpath = location
        self._storage_options: StorageOptions | None = None  # the strategy's, from setup on

    def _strategy(self, trainer: Any) -> S3TrainerStrategy:
        strategy = trainer.strategy
        if not isinstance(strategy, S3TrainerStrategy):
            raise ConfigError(
                f"S3ModelCheckpoint({self.dirpath}) needs Trainer(strategy=S3TrainerStrategy(...)); "
                f"the trainer's strategy is {type(strategy).__name__}"
            )
        return strategy

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = self._strategy(trainer)
        self.dirpath = _required_location(strategy.broadcast(self.dirpath))
        self._storage_options = strategy.storage_options
        ownership = self.ownership()
        if ownership not in strategy.ownerships:
            strategy.ownerships.append(ownership)
        if (
            trainer.is_global_zero
            and stage == "fit"
            and self.save_top_k != 0
            and strategy.list_checkpoints(self.dirpath)
        ):
            rank_zero_warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        strategy = self._strategy(trainer)
        local_decision = strategy.checkpoint_exists(filepath) if trainer.is_global_zero else False
        return trainer.strategy.reduce_boolean_decision(local_decision, all=False)

    def ownership(self) -> Ownership:
        """What this callback's rotation may delete: names its templates make directly under ``dirpath``
        (``<filename>[-v<N>].ckpt``, ``<last>[-v<N>].ckpt``; see :mod:`dcp_s3._checkpointer.ownership`)."""
        assert self.dirpath is not None
        templates = [self.filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}", self.CHECKPOINT_NAME_LAST]
        names = "|".join(
            _template_pattern(t, self.auto_insert_metric_name, self.CHECKPOINT_EQUALS_CHAR) for t in templates
        )
        version = re.escape(self.CHECKPOINT_JOIN_CHAR) + r"v[0-9]+"
        scheme = re.compile(rf"(?:{names})(?:{version})?{re.escape(self.FILE_EXTENSION)}")
        return Ownership(f"S3ModelCheckpoint({self.dirpath})", str(self.dirpath), scheme)

    def _should_remove_checkpoint(self, trainer: Any, previous: str, current: str) -> bool:
        """Lightning's rule (never the one just written, never the checkpoint resumed from), then ownership:
        a checkpoint of another run or directory — a restored or crafted ``best_model_path`` — stays."""
        if previous == current:
            return False
        ownership, location = self.ownership(), s3_location(previous)
        if location is None or ownership.name_of(location) is None:
            refuse(ownership.owner, previous, f"not a checkpoint this callback names under {self.dirpath}")
            return False
        return location != s3_location(trainer.ckpt_path)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-([0-9]+))?{re.escape(self.FILE_EXTENSION)}$")
        assert self.dirpath is not None
        found = self._strategy(trainer).list_checkpoints(self.dirpath)
        return {path for path in found if pattern.match(path.rsplit("/", 1)[-1])}

    def to_yaml(self, filepath: Any | None = None) -> None:
        assert self.dirpath is not None
        target = _required_location(filepath if filepath is not None else f"{self.dirpath}/best_k_models.yaml")
        parent, name = target.rsplit("/", 1)
        text = yaml.dump({k: v.item() for k, v in self.best_k_models.items()})
        if self._storage_options is None:
            raise ConfigError(f"S3ModelCheckpoint({self.dirpath}).to_yaml: call it once the trainer has set it up")
        self._storage_options.store(parent).write(name, text.encode())


def _template_pattern(template: str, auto_insert: bool, equals: str) -> str:
    """A regex of the names Lightning's ``_format_checkpoint_name`` makes of ``template``: each ``{name}`` or
    ``{name:format}`` field becomes ``name=<value>`` (``<value>`` with ``auto_insert_metric_name=False``)."""
    out = []
    for i, piece in enumerate(re.split(r"(\{[^{}]*\})", template)):
        if i % 2 == 0:
            out.append(re.escape(piece))
            continue
        name = piece[1:-1].split(":", 1)[0]
        out.append((re.escape(name + equals) if auto_insert else "") + r"[^/]+")
    return "".join(out)
