"""A small NeMo AutoModel recipe (a ``BaseRecipe`` subclass, as users write their own) and the crash tests' driver.

``TinyRecipe`` builds what NeMo's LLM fine-tune recipe builds, small and on CPU: an FSDP2 model on gloo ranks
(``initialize_distributed``), AdamW, NeMo's ``StatefulRNG`` and ``StepScheduler``, torchdata's ``StatefulDataLoader``,
and its checkpointer from ``self.cfg.checkpoint.build(...)``; it resumes with NeMo's ``load_checkpoint`` and saves
with NeMo's ``save_checkpoint`` (both ``BaseRecipe``'s, unchanged). ``S3TinyRecipe = s3_recipe(TinyRecipe)`` is the
one line a user with a recipe of their own writes; the YAML's ``recipe:`` names it.

Run as a script, one process per rank (the crash tests start them, with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set)::

    python tests/integrations/nemo_recipe_child.py HELD RELEASE PHASE VICTIM CONFIG.yaml

it runs the recipe of ``CONFIG.yaml`` through NeMo's launcher (as ``torchrun -m nemo_automodel.cli.app`` workers do)
and, on rank ``VICTIM``, holds at ``PHASE`` of the save of step 4: it creates ``HELD`` and waits for ``RELEASE`` (the
test SIGKILLs it there). What the loop saw (:meth:`TinyRecipe.run_train_validation_loop`) goes to ``<out>.<rank>``,
``out`` from the YAML. Phases (all inside
the save of step 4; step 2 is committed before):

- ``reserved``: right after ``lifecycle.reserve`` (the save token drawn, nothing of the save written);
- ``model-data``: the model part's writer asks for its second item (this rank's model data half written);
- ``before-config``: the DCP parts written and committed, before ``config.yaml`` and the commit;
- ``before-commit``: in ``publish``, before the commit (on rank 0: just before its PUT);
- ``none``: run through.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nemo_automodel.cli.utils import resolve_recipe_name
from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
from nemo_automodel.components.distributed.init_utils import initialize_distributed
from nemo_automodel.components.launcher.interactive import InteractiveLauncher
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.components.training.step_scheduler import StepScheduler
from nemo_automodel.recipes._typed_config import RecipeConfig
from nemo_automodel.recipes.base_recipe import BaseRecipe
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

from dcp_s3 import _commit as dcp_commit
from dcp_s3.integrations import nemo_automodel, nemo_commit
from dcp_s3.integrations.nemo_recipe import s3_recipe
from tests.dist_utils import full


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


class TinyRecipe(BaseRecipe):
    """A recipe of a user's own: NeMo's ``BaseRecipe`` for checkpoints, a small model and loop."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg if isinstance(cfg, RecipeConfig) else RecipeConfig(cfg)  # as NeMo's recipes do

    def setup(self) -> None:
        initialize_distributed("gloo", timeout_minutes=self.cfg.get("dist_env.timeout_minutes", 1))
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sampler = torch.utils.data.DistributedSampler(Numbers(), num_replicas=world, rank=rank, shuffle=True, seed=1)
        self.dataloader = StatefulDataLoader(Numbers(), batch_size=4, sampler=sampler)
        self.rng = StatefulRNG(seed=7, ranked=True)
        self.restored: dict[str, Any] = {}
        load_rng = self.rng.load_state_dict

        def recorded_load(state: Any) -> None:  # the torch RNG as NeMo's load restores it (later steps draw from it)
            load_rng(state)
            self.restored["torch_rng"] = torch.get_rng_state()

        self.rng.load_state_dict = recorded_load  # type: ignore[method-assign]
        self.step_scheduler = StepScheduler(
            global_batch_size=4 * world,
            local_batch_size=4,
            dp_size=world,
            dataloader=self.dataloader,
            max_steps=int(self.cfg.get("train.max_steps")),
            preemption_signal=None,
        )
        self.peft_config = None
        self.checkpointer = self.cfg.checkpoint.build(dp_rank=rank, tp_rank=0, pp_rank=0)  # as NeMo's recipes do
        self.load_checkpoint(self.cfg.get("checkpoint.restore_from", None))

    def snapshot(self, step: dict[str, int], torch_rng: torch.Tensor | None) -> dict[str, Any]:
        return {
            "model": full(self.model.state_dict()),
            "optim": full(self.optimizer.state_dict()),
            "loader": self.dataloader.state_dict(),
            "step": step,
            "torch_rng": torch_rng,
        }

    def run_train_validation_loop(self) -> dict[str, Any]:
        sched = self.step_scheduler
        loaded = {"step": sched.step, "epoch": sched.epoch}  # as loaded (state_dict() says the step after it)
        out: dict[str, Any] = {"start": sched.step, "resumed": self.snapshot(loaded, self.restored.get("torch_rng"))}
        out["saves"] = {}
        batches = iter(self.dataloader)
        every = int(self.cfg.get("train.ckpt_every_steps"))
        while self.step_scheduler.step < self.step_scheduler.max_steps:
            x, y = next(batches)
            self.optimizer.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            out.setdefault("losses", []).append(float(loss.item()))
            self.step_scheduler.step += 1
            step = self.step_scheduler.step
            if step % every == 0:
                self.step_scheduler.step -= 1  # NeMo saves inside its step loop, before the step counter moves
                out["saves"][step] = self.snapshot(self.step_scheduler.state_dict(), torch.get_rng_state())
                self.dump(out)  # what a save killed from here on would have stored
                self.save_checkpoint(epoch=0, step=step, train_loss=float(loss.item()))
                self.step_scheduler.step += 1
        out["latest"] = self.checkpointer.latest_checkpoint()
        self.checkpointer.close()
        self.dump(out)
        return out

    def dump(self, out: dict[str, Any]) -> None:
        if (path := self.cfg.get("out", None)) is not None:
            torch.save(out, f"{path}.{dist.get_rank()}")


S3TinyRecipe = s3_recipe(TinyRecipe)


def hold_at(phase: str, held: str, release: str) -> None:
    """Install the hook of ``phase`` (module docstring), for the save of step 4 only."""

    def wait() -> None:
        Path(held).touch()
        deadline = time.monotonic() + 300  # a hang guard: the test kills or releases long before
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)

    def step4(path: str) -> bool:
        return path.rstrip("/").endswith("_step_4")

    if phase == "reserved":
        reserve = nemo_automodel.S3CheckpointLifecycle.reserve

        def held_reserve(self: Any, path: str) -> None:
            reserve(self, path)
            if step4(path):
                wait()

        nemo_automodel.S3CheckpointLifecycle.reserve = held_reserve  # type: ignore[method-assign]
    elif phase == "model-data":
        planner = nemo_automodel._ModelSavePlanner

        class Holding(planner):  # type: ignore[misc, valid-type]
            saves = 0

            # torch's parameter names: without storage_meta, torch warns and passes is_coordinator as it.
            def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
                Holding.saves += 1
                self.calls = 0
                super().set_up_planner(state_dict, storage_meta, is_coordinator)

            def resolve_data(self, write_item: Any) -> Any:
                self.calls += 1
                if Holding.saves == 2 and self.calls == 2:
                    wait()
                return super().resolve_data(write_item)

        nemo_automodel._ModelSavePlanner = Holding  # type: ignore[misc]
    elif phase == "before-config":
        save_config = nemo_automodel.S3Checkpointer.save_config

        def held_save_config(self: Any, config: Any, path: str) -> None:
            if step4(path):
                wait()
            save_config(self, config, path)

        nemo_automodel.S3Checkpointer.save_config = held_save_config  # type: ignore[method-assign]
    elif phase == "before-commit":
        publish, commit = dcp_commit.publish, nemo_commit.Saves.commit

        def held_commit(self: Any, ckpt: str) -> None:
            if step4(ckpt) and dist.get_rank() != 0:
                wait()
            commit(self, ckpt)

        def held_publish(objects: Any, key: str, body: bytes, **kwargs: Any) -> Any:
            if key.endswith("_step_4/" + nemo_commit.COMMIT) and b'"parts"' in body:
                wait()
            return publish(objects, key, body, **kwargs)

        nemo_commit.Saves.commit = held_commit  # type: ignore[method-assign]
        dcp_commit.publish = held_publish  # the one conditional write of every commit (dcp_s3._commit)
    elif phase != "none":
        raise SystemExit(f"unknown phase {phase!r}")


def main(argv: list[str]) -> int:
    held, release, phase, victim, config = argv
    if os.environ["RANK"] == victim:
        hold_at(phase, held, release)
    cfg = parse_args_and_load_config(config, argv=[])
    # NeMo's launcher inside a torchrun worker runs the recipe in this process (what `torchrun ... -m
    # nemo_automodel.cli.app config.yaml` does on each worker)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "dcp-s3-test")
    InteractiveLauncher().launch(cfg, Path(config), resolve_recipe_name(cfg.get("recipe")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
