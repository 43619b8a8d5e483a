"""A checkpoint manager for training loops: save, resume, keep the store tidy.

::

    ckpt = Checkpointer("s3://bucket/run1", keep_last=3)
    start = ckpt.load({"model": model}, {"model": optim}, {"model": sched})   # 0 if nothing saved yet
    for it in range(start, steps):
        ...
        if it % 1000 == 0:
            ckpt.save({"model": model}, {"model": optim}, {"model": sched}, iteration=it)

Every rank of the job calls ``save``/``load`` with the same arguments (a single process
without ``torch.distributed`` works too). The layout is described in :mod:`dcp_s3._checkpointer.steps`:
one DCP checkpoint per model and per optimizer, and a small ``<step>.pth`` marker that
rank 0 writes last. Every save writes its parts to its own generation directories, named by the marker:
a re-save of a complete step is all or nothing, and of two jobs racing the first save of a step exactly
one commits (:mod:`dcp_s3._checkpointer.generations`); a load reads the parts one marker names.
Works the same on ``s3://bucket/prefix`` and on a local directory.

This module holds the manager; its parts live beside it: :mod:`~dcp_s3._checkpointer.step_io` (where a step
lives, the parts' writers/readers, which step a load takes, loading one part),
:mod:`~dcp_s3._checkpointer.objects` (single
objects, ``latest_checkpoint``), :mod:`~dcp_s3._checkpointer.ranks` (run on rank 0, share the outcome),
:mod:`~dcp_s3._checkpointer.training_state` (argument checks, scheduler/scaler/callback state),
:mod:`~dcp_s3._planners.optim_match` (optimizer compatibility, checked inside the load),
:mod:`~dcp_s3._checkpointer.legacy` (single-file checkpoints) and :mod:`~dcp_s3._checkpointer.retention` (``keep_last``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from dcp_s3._checkpointer.generations import PART_DIRS, commit_step, generation_name, marker_entry
from dcp_s3._checkpointer.legacy import ALLOW_MISSING_OPTIM_ENV, load_legacy
from dcp_s3._checkpointer.objects import latest_checkpoint, load_object, save_object
from dcp_s3._checkpointer.ranks import Ranks, distributed, rank, world_size
from dcp_s3._checkpointer.retention import retain_last
from dcp_s3._checkpointer.step_io import StepIO, load_model, load_optim
from dcp_s3._checkpointer.steps import MARKER_FORMAT, MARKER_SUFFIX
from dcp_s3._checkpointer.tier_load import tiered_load
from dcp_s3._checkpointer.tiers import Tiers
from dcp_s3._checkpointer.training_state import check_dicts, restore, state_of, warn
from dcp_s3._dcp import Store, open_store
from dcp_s3._layout import new_token
from dcp_s3._planners.trainable import TrainableOnlySavePlanner
from dcp_s3._torch_compat import async_save
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes
from dcp_s3.errors import ConfigError, DcpS3Error

__all__ = ["Checkpointer", "AsyncSave", "latest_checkpoint", "save_object", "load_object"]

log = logging.getLogger(__name__)


# -- the manager ------------------------------------------------------------------------------------
class AsyncSave:
    """Handle of an asynchronous save: ``result()`` waits for it and returns the step location."""

    def __init__(self, path: str, future: Future[str]) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        """Wait until every part is written and (on rank 0) the marker too; re-raise any failure."""
        return self._future.result(timeout)

    wait = result

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSave({self.path!r}, {state})"


#: One part of a save: (model key, "model" or "optim", its state dict, the planner that saves it).
_Part = tuple[str, str, dict[str, Any], Any]


def _parts(
    model_dict: Mapping[str, nn.Module], optimizer_dict: Mapping[str, torch.optim.Optimizer] | None
) -> list[_Part]:
    """The parts of a save: each model's trainable state, then its optimizer's state if it has one."""
    parts: list[_Part] = []
    for key, model in model_dict.items():
        parts.append((key, "model", get_model_state_dict(model), TrainableOnlySavePlanner(model)))
        if optimizer_dict is not None and key in optimizer_dict:
            osd = get_optimizer_state_dict(model, optimizer_dict[key])
            parts.append((key, "optim", osd, DefaultSavePlanner()))
    return parts


class Checkpointer:
    """Save and resume training state under ``save_dir`` (``s3://bucket/prefix`` or a local directory).

    Args:
        save_dir: where steps are written and looked for.
        keep_last: after a step completes, rank 0 deletes older complete steps beyond the
            newest ``keep_last`` (never the one just written); incomplete steps and single-file
            checkpoints are never touched (see ``dcp-s3 gc``).
        async_save: ``save`` stages the state on the CPU, starts ``dcp.async_save`` for every
            part and returns an :class:`AsyncSave` handle; the next ``save``/``load`` first waits
            for it. Each part gets its own gloo process group so parts upload concurrently
            without interleaving collectives.
        local_root: a node-local directory (NVMe, ``/dev/shm``) in front of ``save_dir``: every save
            goes there first (each rank to ``<local_root>/rank<NNNNN>/``), steps are promoted to
            ``save_dir`` in the background and ``load`` prefers a complete local copy; see
            :mod:`dcp_s3._checkpointer.tiers` (not with ``async_save``).
        s3_every: with ``local_root``, promote the saves whose iteration is a multiple of it (None: only
            ``save(..., tier="s3")``).
        keep_last_local: with ``local_root``, local steps kept per rank (never one being promoted).
        promotion_attempts: tries of each promotion request.
        promotion_timeout: how long rank 0 waits for the other ranks' uploads of a step.
        storage_options: storage options (:mod:`dcp_s3._dcp.options`: ``credential_path``,
            ``endpoint_url``, ``region``, ``profile``, ``part_size``, ``max_concurrency``,
            ``key_prefixes``..., or ``options=`` a :class:`dcp_s3.StorageOptions`, the keywords merged over
            it), given to every writer/reader of every part; the S3 ones are rejected for local directories.

    Rank roles: every rank calls ``save``/``load``; rank 0 alone lists, writes the marker and
    deletes, and tells the other ranks what it found (so all agree on the step to load and on
    errors). ``model_dict`` maps names (no ``.`` or ``/``) to modules; ``optimizer_dict``,
    ``scheduler_dict`` map the same names to optimizers and LR schedulers.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        local_root: str | os.PathLike[str] | None = None,
        s3_every: int | None = None,
        keep_last_local: int | None = 2,
        promotion_attempts: int = 3,
        promotion_timeout: float = 600.0,
        **storage_options: Any,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last={keep_last} must be >= 1 (or None to keep every step)")
        if local_root is not None and async_save:
            raise ConfigError("local_root= and async_save=True: a local-tier save is already the fast path; pick one")
        self.storage_options = storage_options
        self.store = open_store(save_dir, **storage_options)
        self.save_dir = self.store.url()
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: AsyncSave | None = None
        self._finisher: ThreadPoolExecutor | None = None
        self._ranks = Ranks()
        self._tiers = (
            None
            if local_root is None
            else Tiers(
                self.store,
                self._ranks,
                local_root,
                s3_every=s3_every,
                keep_last_local=keep_last_local,
                keep_last=keep_last,
                attempts=promotion_attempts,
                promotion_timeout=promotion_timeout,
            )
        )
        self._io = StepIO(self.store, storage_options)  # locations, reusable writers/readers

    def __repr__(self) -> str:
        return f"Checkpointer({self.save_dir!r}, keep_last={self.keep_last}, async_save={self.async_save})"

    # -- save -----------------------------------------------------------------------------------
    def save(
        self,
        model_dict: Mapping[str, nn.Module],
        optimizer_dict: Mapping[str, torch.optim.Optimizer] | None = None,
        scheduler_dict: Mapping[str, Any] | None = None,
        grad_scaler: Any = None,
        callbacks: Any = None,
        path: str | os.PathLike[str] | None = None,
        iteration: int = 0,
        tier: str | None = None,
    ) -> Any:
        """Save one step; returns its location (``<save_dir>/<iteration:07d>`` unless ``path`` is given).

        For each ``k`` in ``model_dict``: the trainable model state as DCP checkpoint
        ``<step>.<k>_model`` and, if ``optimizer_dict`` has ``k``, the optimizer state as
        ``<step>.<k>_optim``, each in this save's generation directory ``<step>.<k>_<kind>.<hex>``. Then
        rank 0 writes ``<step>.pth`` (iteration, scheduler, grad scaler and callback state, the
        directories in ``part_dirs``) and applies ``keep_last``
        (:mod:`dcp_s3._checkpointer.generations`). A first save whose step another job committed
        meanwhile raises ``CheckpointExistsError`` (the step stays the other save, whole); a complete
        step already at that location is replaced all or nothing: the old parts are deleted only
        after the rewritten marker. With ``async_save=True`` returns an :class:`AsyncSave`
        handle instead. With ``local_root``: a save to the local tier (``tier="s3"`` also promotes it,
        ``"local"`` never, None as ``s3_every`` says); returns the local step's location.
        """
        self.wait()
        check_dicts(model_dict, optimizer_dict)
        if self._tiers is not None and path is not None:
            raise ConfigError("path= is not supported with local_root (steps are named by iteration)")
        if self._tiers is None and tier is not None:
            raise ConfigError(f"tier={tier!r} needs local_root")
        store, step = self._io.locate(path, iteration)
        parts = _parts(model_dict, optimizer_dict)
        suffixes = [f"{key}_{kind}" for key, kind, _, _ in parts]
        content: dict[str, Any] = {
            "format": MARKER_FORMAT,
            "iteration": int(iteration),
            "parts": suffixes,
            "scheduler": state_of(scheduler_dict, "scheduler_dict"),
            "grad_scaler": state_of(grad_scaler, "grad_scaler"),
            "callbacks": state_of(callbacks, "callbacks"),
            "world_size": world_size(),
            "saved_at": time.time(),
        }
        if self._tiers is not None:
            return self._tiers.save(parts, content, iteration, tier)
        # Every save writes its own generation (the same token on every rank); no marker there: a first save,
        # whose marker may not replace one (two jobs racing the first save of the step: one commits).
        token, first = self._ranks.run_on_rank0(lambda: (new_token(), store.size(step + MARKER_SUFFIX) is None))
        content[PART_DIRS] = {s: marker_entry(s, token) for s in suffixes}
        marker = torch_save_bytes(content)

        def commit() -> None:
            self._commit(store, step, marker, token, suffixes, first)

        if not self.async_save:
            return self._save_now(store, step, token, parts, commit)
        return self._save_in_background(store, step, token, parts, commit)

    def _save_now(self, store: Store, step: str, token: str, parts: list[_Part], commit: Callable[[], None]) -> str:
        """Save every part in this thread, then commit the step (rank 0); returns its location."""
        location = store.url(step)
        t0 = time.perf_counter()
        for key, kind, state, planner in parts:
            writer, url = self._io.writer(store, generation_name(step, key, kind, token), key, kind)
            dcp.save(state, checkpoint_id=url, storage_writer=writer, planner=planner, no_dist=not distributed())
        self._ranks.run_on_rank0(commit)
        log.info("saved step %s in %.1fs", location, time.perf_counter() - t0)
        return location

    def _save_in_background(
        self, store: Store, step: str, token: str, parts: list[_Part], commit: Callable[[], None]
    ) -> AsyncSave:
        """Start every part's asynchronous save (each on its own process group) and, on the background thread,
        wait for them and commit the step (rank 0); returns the handle of the pending save."""
        location = store.url(step)
        groups = [self._ranks.group_for(f"{key}_{kind}") for key, kind, _, _ in parts]  # before any part starts
        futures = []
        for (key, kind, state, planner), group in zip(parts, groups, strict=True):
            writer, url = self._io.writer(store, generation_name(step, key, kind, token), key, kind)
            futures.append(
                async_save(
                    state,
                    checkpoint_id=url,
                    storage_writer=writer,
                    planner=planner,
                    process_group=group,
                    no_dist=not distributed(),
                )
            )
        rank0 = rank() == 0

        def finish() -> str:
            for fut in futures:
                fut.result()
            if rank0:  # every part's .metadata is committed once the coordinator's futures resolve
                commit()
            return location

        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(1, thread_name_prefix="dcp_s3-checkpointer")
        self._pending = AsyncSave(location, self._finisher.submit(finish))
        return self._pending

    def wait(self) -> str | None:
        """Wait for a pending asynchronous save (re-raising its failure); returns its location."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for a pending save and stop the background thread."""
        try:
            self.wait()
            if self._tiers is not None:
                self._tiers.close()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_promotions(self, timeout: float | None = None) -> None:
        """With ``local_root``: wait for the promotions started so far (a failed one warns, see ``tier_status``)."""
        if self._tiers is not None:
            self._tiers.wait_promotions(timeout)

    def tier_status(self) -> list[dict[str, Any]]:
        """With ``local_root``: per step saved by this process, oldest first, its tiers, promotion state
        (``pending``/``uploading``/``uploaded``/``done``/``failed``), ``lag`` (s), local save time and
        last error, as this rank knows them; ``last_load`` tells where the last load read from and why."""
        return [] if self._tiers is None else self._tiers.status()

    @property
    def last_load(self) -> dict[str, Any]:
        """With ``local_root``: the step the last ``load`` took, its source (``local``, ``mixed``, ``s3``),
        the ranks that read S3 and why (``reasons``: rank -> one line naming the cause), and why each newer
        step was not taken (``skipped``: step -> reason)."""
        return {} if self._tiers is None else dict(self._tiers.last_load)

    def _commit(self, store: Store, step: str, marker: bytes, token: str, suffixes: list[str], first: bool) -> None:
        """Rank 0, after every part committed: write the marker (and delete the parts it replaced; a first
        save: only if no other save committed the step meanwhile), then apply ``keep_last``."""
        commit_step(store, step, marker, token, suffixes, first=first)
        if self.keep_last is None:
            return
        try:
            retain_last(self.store, self.keep_last, keep=store.url(step))
        except (DcpS3Error, OSError) as exc:
            # The step is saved; storage growing unseen is what must not happen.
            warn(f"keep_last={self.keep_last}: could not delete old steps under {self.save_dir}: {exc}")

    # -- load ---------------------------------------------------------------------------------------
    def load(
        self,
        model_dict: Mapping[str, nn.Module],
        optimizer_dict: Mapping[str, torch.optim.Optimizer] | None = None,
        scheduler_dict: Mapping[str, Any] | None = None,
        grad_scaler: Any = None,
        callbacks: Any = None,
        path: str | os.PathLike[str] | None = None,
        allow_missing_optim: bool = False,
    ) -> int:
        """Restore a step; returns its iteration (0, loading nothing, if ``path`` is None and no step is complete).

        ``path=None`` takes the newest complete step under ``save_dir``; ``path`` may name a
        step (``.../0000100``), its marker (``.../0000100.pth``) or a legacy single-file
        checkpoint. Ranks whose model is entirely on the meta device take part with empty
        plans and keep their meta tensors. A missing optimizer checkpoint raises
        ``CheckpointNotFoundError`` unless ``allow_missing_optim`` (or env
        ``DCP_S3_ALLOW_MISSING_OPTIM=1``); an optimizer checkpoint whose entries do not match
        the optimizer is skipped with a warning. Either way the optimizer keeps fresh state.
        """
        self.wait()
        check_dicts(model_dict, optimizer_dict)
        allow_missing_optim = allow_missing_optim or os.environ.get(ALLOW_MISSING_OPTIM_ENV, "") in ("1", "true", "yes")
        optim_keys = sorted(optimizer_dict or {})
        if self._tiers is not None and path is None:
            got = tiered_load(self._tiers, model_dict, optimizer_dict)
            if got is None:
                log.info(
                    "no complete checkpoint in either tier (%s, %s): starting from scratch",
                    self.save_dir,
                    self._tiers.local_root,
                )
                return 0
            if "s3_step" in got:
                path = self.store.url(got["s3_step"])
            else:
                marker = got["marker"]
                restore(scheduler_dict, marker.get("scheduler"), "scheduler_dict")
                restore(grad_scaler, marker.get("grad_scaler"), "grad_scaler")
                restore(callbacks, marker.get("callbacks"), "callbacks")
                return int(marker.get("iteration", 0))
        plan = self._ranks.run_on_rank0(
            lambda: self._io.plan_load(path, list(model_dict), optim_keys, allow_missing_optim)
        )
        if plan is None:
            log.info("no complete checkpoint under %s: starting from scratch", self.save_dir)
            return 0
        store = self._io.store(plan["root"])
        step: str = plan["step"]
        dirs: dict[str, str] = plan["dirs"]
        # The marker rank 0 planned with (a re-save committing meanwhile cannot mix into this load);
        # a single-file checkpoint, maybe large, is read by every rank.
        data = store.read(plan["marker"]) if plan["legacy"] else plan["marker_data"]
        marker = torch_load(data, store.url(plan["marker"]))
        t0 = time.perf_counter()
        if plan["legacy"]:
            iteration = load_legacy(marker, store.url(plan["marker"]), model_dict, optimizer_dict, allow_missing_optim)
        else:
            for key, model in model_dict.items():
                load_model(self._io.reader(store, dirs[f"{key}_model"], key, "model"), model)
            for key, status in plan["optim"].items():
                name = dirs[f"{key}_optim"]
                if status == "missing":
                    warn(f"optimizer checkpoint {store.url(name)} is missing; {key!r} continues with fresh state")
                    continue
                load_optim(
                    self._io.reader(store, name, key, "optim"),
                    store.url(name),
                    model_dict[key],
                    (optimizer_dict or {}).get(key),
                )
            iteration = int(marker.get("iteration", 0))
        restore(scheduler_dict, marker.get("scheduler"), "scheduler_dict")
        restore(grad_scaler, marker.get("grad_scaler"), "grad_scaler")
        restore(callbacks, marker.get("callbacks"), "callbacks")
        log.info("loaded step %s (iteration %d) in %.1fs", store.url(step), iteration, time.perf_counter() - t0)
        return iteration
