"""NeMo AutoModel's recipes (``BaseRecipe`` subclasses, the ``automodel`` command) saving to and resuming from
``s3://`` through dcp_s3, chosen by the YAML's ``recipe:`` key (tested with nemo-automodel 0.7.0)::

    recipe: dcp_s3.integrations.nemo_recipe.S3TrainFinetuneRecipeForNextTokenPrediction   # was: TrainFinetune...
    checkpoint:
      checkpoint_dir: s3://bucket/run1        # endpoint_url: / storage_options: may be added here too

``S3<Name>`` is NeMo's recipe ``<Name>`` (any name NeMo's ``automodel`` command knows) with :class:`S3Recipe` mixed
in; in Python, ``s3_recipe(TrainFinetuneRecipeForNextTokenPrediction)(cfg)``. Nothing else of the recipe changes.

Why it holds. NeMo's recipes build their checkpointer from ``self.cfg.checkpoint`` (``RecipeConfig.checkpoint``, a
``CheckpointingConfig`` made from the YAML ``checkpoint:`` block) and wrap ``cfg`` in a ``RecipeConfig`` only when it
is not one already; :class:`S3Recipe` hands them an :class:`S3RecipeConfig`, whose ``checkpoint`` is the same block as
an :class:`~dcp_s3.integrations.nemo_automodel.S3CheckpointingConfig`: the recipe's own ``.build(...)`` then makes an
``S3Checkpointer``, with its commit protocol, retention by ownership and checks of untrusted input. The recipe's
``save_checkpoint``/``load_checkpoint`` are NeMo's own and call that checkpointer; what they write or read
themselves (``losses.json``, ``config.yaml`` with ``open``; ``<key>.pt`` of other tracked state with ``torch.save``
and ``load_torch_ckpt``; finding checkpoints by listing a directory) goes, for ``s3://`` paths, to the checkpointer:

- the tracked state NeMo would ``torch.save`` is written by :meth:`S3Checkpointer.save_state` into each save right
  after ``reserve`` (:attr:`S3CheckpointLifecycle.with_each_save`; NeMo's loop skips it while the save runs);
- while a save or load runs, the module-level functions NeMo's ``base_recipe`` calls by name — ``save_losses``,
  ``save_config``, ``load_torch_ckpt``, ``find_latest_checkpoint``, ``resolve_restore_from_to_checkpoint_dir``
  and ``_is_checkpoint_model_config_compatible`` — answer ``s3://`` paths through the checkpointer (a commit's
  files only, the newest committed checkpoint as the latest) and every other path with NeMo's own function. The
  routing belongs to the context (thread or asyncio task) running the save or load: two recipes saving and loading
  in two threads each use their own checkpointer, and a call in a context with no save or load of its own runs
  NeMo's function (re-entrant; NeMo's functions back in place when the last one returns: :func:`_routed`).

Limits: the recipe must build its checkpointer from ``self.cfg.checkpoint`` (NeMo's LLM/VLM fine-tune and
sequence-classification recipes do; one that constructs ``Checkpointer(...)`` itself gets a ``ConfigError`` at its
first save or load on ``s3://``). NeMo's launcher starts more than one local process by running the recipe's module
file, which for ``S3<Name>`` is not NeMo's: start those with ``torchrun ... -m nemo_automodel.cli.app config.yaml``
(each worker then runs the recipe in-process) or one process per node from a scheduler.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import tempfile
from collections.abc import Callable
from functools import cached_property
from typing import Any, TypeVar

from nemo_automodel.cli.utils import resolve_recipe_name
from nemo_automodel.components.config.loader import ConfigNode
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.recipes import base_recipe
from nemo_automodel.recipes._typed_config import RecipeConfig, _model_name_from_cfg
from nemo_automodel.recipes.base_recipe import (
    BaseRecipe,
    is_dataloader,
    is_distributed_stateful,
    is_lr_scheduler,
    is_model,
    is_optimizer,
    is_tokenizer,
)

from dcp_s3.errors import ConfigError, DcpS3Error
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations._patching import ContextPatch, Handler, Site
from dcp_s3.integrations.nemo_automodel import S3Checkpointer, S3CheckpointingConfig

__all__ = ["S3Recipe", "S3RecipeConfig", "s3_recipe"]

R = TypeVar("R", bound=type)

logger = logging.getLogger(__name__)


class S3RecipeConfig(RecipeConfig):
    """NeMo's ``RecipeConfig`` whose ``checkpoint`` is an ``S3CheckpointingConfig`` made as NeMo makes its
    ``CheckpointingConfig``: the YAML ``checkpoint:`` block (less ``restore_from``) with the model-derived
    ``model_repo_id``, ``model_cache_dir`` and ``is_peft``."""

    @classmethod
    def of(cls, cfg: Any) -> S3RecipeConfig:
        """``cfg`` (a ``ConfigNode`` or a ``RecipeConfig``) as an ``S3RecipeConfig``."""
        if isinstance(cfg, cls):
            return cfg
        return cls(cfg._raw if isinstance(cfg, RecipeConfig) else cfg)

    @cached_property
    def checkpoint(self) -> S3CheckpointingConfig:  # type: ignore[override]
        node = self.get("checkpoint", None)
        kwargs = node.to_dict() if node is not None else {}
        kwargs.pop("restore_from", None)  # NeMo: read separately at load time, not a config field
        model = self.get("model", None)
        kwargs |= {
            "model_repo_id": _model_name_from_cfg(model) if model is not None else None,
            "model_cache_dir": self.get("model.cache_dir", None),
            "is_peft": bool(self.get("peft", None)),
        }
        return S3CheckpointingConfig(**kwargs)


def _written_by_recipe(obj: Any) -> bool:
    """Whether NeMo's ``save_checkpoint`` writes tracked ``obj`` itself as ``<key>.pt`` (its loop's last branch)."""
    return not (
        is_model(obj)
        or is_optimizer(obj)
        or isinstance(obj, (ConfigNode, RecipeConfig))
        or is_lr_scheduler(obj)
        or is_tokenizer(obj)
        or isinstance(obj, StatefulRNG)
        or is_dataloader(obj)
        or is_distributed_stateful(obj)
    )


class S3Recipe:
    """Mixed into a NeMo recipe (before it in the bases; :func:`s3_recipe`): its checkpoints on ``s3://`` go
    through dcp_s3 (the module docstring says how). A local ``checkpoint_dir`` keeps NeMo's behaviour."""

    checkpointer: Any

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(S3RecipeConfig.of(cfg), *args, **kwargs)  # type: ignore[call-arg]

    def _s3_checkpointer(self) -> S3Checkpointer | None:
        """The recipe's checkpointer when its ``checkpoint_dir`` is on S3 (None otherwise)."""
        checkpointer = self.checkpointer
        location = s3_location(checkpointer.config.checkpoint_dir)
        if location is None or not checkpointer.config.enabled:
            return None
        if not isinstance(checkpointer, S3Checkpointer):
            raise ConfigError(
                f"checkpoint_dir={location}: {type(self).__name__} built a {type(checkpointer).__name__}, not one "
                "from self.cfg.checkpoint; only recipes that build their checkpointer from their config can save to "
                "s3:// (see dcp_s3.integrations.nemo_recipe)"
            )
        return checkpointer

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        # docstring inherited
        checkpointer = self._s3_checkpointer()
        if checkpointer is None:
            return super().save_checkpoint(*args, **kwargs)  # type: ignore[misc, no-any-return]
        tracked = self.__dict__["__state_tracked"]  # NeMo's set of tracked attribute names
        own = {key: getattr(self, key) for key in sorted(tracked) if _written_by_recipe(getattr(self, key))}

        def write(path: str) -> None:
            for key, state in own.items():
                checkpointer.save_state(state, key, path)

        self.untrack_state(*own)  # type: ignore[attr-defined]
        checkpointer.lifecycle.with_each_save.append(write)
        try:
            with _routed(checkpointer):
                return super().save_checkpoint(*args, **kwargs)  # type: ignore[misc, no-any-return]
        finally:
            checkpointer.lifecycle.with_each_save.remove(write)
            for key, state in own.items():
                setattr(self, key, state)  # tracked again (NeMo's __setattr__)

    def load_checkpoint(self, restore_from: str | None = None) -> Any:
        # docstring inherited
        checkpointer = self._s3_checkpointer()
        if checkpointer is None:
            return super().load_checkpoint(restore_from)  # type: ignore[misc]
        with _routed(checkpointer):
            return super().load_checkpoint(restore_from)  # type: ignore[misc]


@functools.cache
def s3_recipe(recipe: R) -> R:
    """NeMo's recipe class ``recipe`` with :class:`S3Recipe` mixed in, named ``S3<its name>``."""
    if not (isinstance(recipe, type) and issubclass(recipe, BaseRecipe)):
        raise ConfigError(f"s3_recipe takes a NeMo recipe class (a BaseRecipe subclass), not {recipe!r}")
    if issubclass(recipe, S3Recipe):
        return recipe
    name = f"S3{recipe.__name__}"
    doc = f"NeMo's {recipe.__module__}.{recipe.__qualname__} saving to and resuming from s3:// through dcp_s3."
    return type(name, (S3Recipe, recipe), {"__module__": __name__, "__qualname__": name, "__doc__": doc})  # type: ignore[return-value]


def __getattr__(name: str) -> Any:
    """``S3<Name>``: :func:`s3_recipe` of the recipe NeMo's ``automodel`` command calls ``<Name>`` (its module is
    imported on this first use, as NeMo's launcher would)."""
    if not name.startswith("S3") or not name[2:3].isupper():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        target = resolve_recipe_name(name[2:])
    except ValueError:
        raise AttributeError(f"{__name__}.{name}: NeMo has no recipe named {name[2:]!r}") from None
    module, _, cls = target.rpartition(".")
    return s3_recipe(getattr(importlib.import_module(module), cls))


# -- NeMo's base_recipe functions, answered through the checkpointer for s3:// paths -----------------------------
# Each is ``handler(checkpointer, nemo's function, *its arguments)``: called in place of NeMo's function while a save
# or load of this context runs (:data:`_patch`), with that save's or load's checkpointer.


def _save_losses(checkpointer: S3Checkpointer, nemo: Callable[..., Any], losses: dict[str, Any], path: str) -> None:
    if s3_location(path) is None:
        return nemo(losses, path)  # type: ignore[no-any-return]
    try:  # as NeMo's: a rank-0-only write must not leave the other ranks waiting in the next collective
        checkpointer.save_losses(losses, path)
    except (DcpS3Error, OSError, TypeError, ValueError) as exc:
        logger.warning("Failed to write checkpoint loss metadata to %s: %s", path, exc)
    return None


def _save_config(checkpointer: S3Checkpointer, nemo: Callable[..., Any], config: dict[str, Any], path: str) -> None:
    if s3_location(path) is None:
        return nemo(config, path)  # type: ignore[no-any-return]
    checkpointer.save_config(config, path)
    return None


def _load_torch_ckpt(checkpointer: S3Checkpointer, nemo: Callable[..., Any], f: Any, *args: Any, **kwargs: Any) -> Any:
    location = s3_location(f)
    if location is None:
        return nemo(f, *args, **kwargs)
    ckpt, _, rel = location.rpartition("/")
    return checkpointer.load_pt(ckpt, rel)  # weights_only unless the config trusts it, as NeMo passes it


def _find_latest_checkpoint(checkpointer: S3Checkpointer, nemo: Callable[..., Any], checkpoint_dir: Any) -> Any:
    if s3_location(checkpoint_dir) is None:
        return nemo(checkpoint_dir)
    return checkpointer.latest_checkpoint()


def _resolve_restore_from_to_checkpoint_dir(
    checkpointer: S3Checkpointer, nemo: Callable[..., Any], checkpoint_dir: Any, restore_from: str
) -> str | None:
    root = s3_location(checkpoint_dir)
    if root is None:
        return nemo(checkpoint_dir, restore_from)  # type: ignore[no-any-return]
    if restore_from.upper() == "LATEST":  # no pointer objects on S3: the newest committed checkpoint
        return checkpointer.latest_checkpoint()
    if os.path.sep not in restore_from and not os.path.isabs(restore_from):
        return f"{root}/{restore_from}"  # a name under checkpoint_dir, as NeMo resolves it
    return s3_location(restore_from) or restore_from


def _is_checkpoint_model_config_compatible(
    checkpointer: S3Checkpointer, nemo: Callable[..., Any], current_cfg: Any, ckpt_dir: Any
) -> tuple[bool, str]:
    location = s3_location(ckpt_dir)
    if location is None:
        return nemo(current_cfg, ckpt_dir)  # type: ignore[no-any-return]
    data = checkpointer.checkpoint_file(location, "config.yaml")  # the committed save's, checked against its size
    with tempfile.TemporaryDirectory() as local:
        if data is not None:
            with open(os.path.join(local, "config.yaml"), "wb") as f:
                f.write(data)
        return nemo(current_cfg, local)  # type: ignore[no-any-return]


_HANDLERS: dict[str, Handler] = {
    "save_losses": _save_losses,
    "save_config": _save_config,
    "load_torch_ckpt": _load_torch_ckpt,
    "find_latest_checkpoint": _find_latest_checkpoint,
    "resolve_restore_from_to_checkpoint_dir": _resolve_restore_from_to_checkpoint_dir,
    "_is_checkpoint_model_config_compatible": _is_checkpoint_model_config_compatible,
}

#: NeMo's six ``base_recipe`` functions, replaced while any recipe's save or load runs; each call acts with the
#: checkpointer of the save or load running in its own context (thread or task), NeMo's function elsewhere.
_patch: ContextPatch[S3Checkpointer] = ContextPatch(
    "NeMo base_recipe functions", lambda: [Site(base_recipe, name, fn) for name, fn in _HANDLERS.items()]
)


def _routed(checkpointer: S3Checkpointer) -> contextlib.AbstractContextManager[S3Checkpointer]:
    """While it is open, NeMo's ``base_recipe`` functions called in this context (thread or asyncio task) answer
    ``s3://`` paths through ``checkpointer`` (the innermost open one of this context); calls in other contexts are
    not touched. Re-entrant; NeMo's functions are back in place when the last one in the process closes."""
    return _patch.scope(checkpointer)
