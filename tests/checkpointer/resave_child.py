"""The Getting started loop (docs/getting-started.md)'s re-save of its resume step in a child process, held at a chosen phase.

    python tests/resave_child.py HELD RELEASE PHASE first ROOT
    python tests/resave_child.py HELD RELEASE PHASE resave ROOT [ASYNC]
    python tests/resave_child.py HELD RELEASE PHASE load ROOT OUT
    python tests/resave_child.py HELD RELEASE PHASE race ROOT SEED [LOCAL]

``first`` trains one step and saves it at iteration 1000; ``resave`` resumes (1000), trains a bit
(:func:`train_a_bit`) and saves at 1000 again (``ASYNC`` = ``1``: with ``async_save=True``);
``load`` resumes into fresh objects and writes :func:`snapshot` to ``OUT`` with ``torch.save``;
``race`` saves :func:`race_state` of ``SEED`` at iteration 1000 (with ``LOCAL``: to that local tier only),
held at ``PHASE``: the first save of a step that another process may be saving too.

At ``PHASE`` the child creates ``HELD`` and waits until ``RELEASE`` exists (or until the test
kills it). The phases are points of the real save, in this process, on any store:

- ``model``: the model part's writer asks for its second item (its data half written);
- ``optim``: the same in the optimizer part (the model part is committed);
- ``marker``: just before the marker ``<step>.pth`` is written (every part committed);
- ``marker-written``: just after the marker is written (nothing deleted yet);
- ``cleanup``: between the deletion of the old parts' ``.metadata`` and of their other objects;
- ``none``: run through.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from torch import nn

from dcp_s3 import _commit as commit
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer import save_parts as checkpointer  # where the save builds its planners
from dcp_s3._dcp import store


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return model, optim, sched


def train_a_bit(model: nn.Module, optim: torch.optim.Optimizer, sched: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(4, 16, generator=g)).square().sum().backward()
    optim.step()
    sched.step()


def first_state() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """What ``first`` saves at iteration 1000."""
    model, optim, sched = build(0)
    train_a_bit(model, optim, sched, seed=1)
    return model, optim, sched


def race_state(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """What ``race`` with ``seed`` saves."""
    model, optim, sched = build(seed)
    train_a_bit(model, optim, sched, seed=seed)
    return model, optim, sched


def snapshot(model: nn.Module, optim: torch.optim.Optimizer, sched: Any, iteration: int) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": optim.state_dict()["state"],
        "sched": sched.state_dict(),
        "iteration": iteration,
    }


def hold_at(phase: str, held: str, release: str) -> None:
    """Install the hook of ``phase`` (see the module docstring)."""

    def wait() -> None:
        with open(held, "w"):
            pass
        deadline = time.monotonic() + 300  # a hang guard: the test kills or releases long before
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)

    def holding(base: type) -> type:
        class Holding(base):  # type: ignore[misc, valid-type]
            calls = 0

            def resolve_data(self, write_item: Any) -> Any:
                Holding.calls += 1
                if Holding.calls == 2:
                    wait()
                return super().resolve_data(write_item)

        return Holding

    if phase == "model":
        checkpointer.TrainableOnlySavePlanner = holding(checkpointer.TrainableOnlySavePlanner)  # type: ignore[misc]
    elif phase == "optim":
        checkpointer.DefaultSavePlanner = holding(checkpointer.DefaultSavePlanner)  # type: ignore[misc]
    elif phase in ("marker", "marker-written"):
        write, publish = store.Store.write, commit.publish

        def held_write(self: Any, name: str, data: bytes, **kwargs: Any) -> None:
            if name.endswith(".pth") and phase == "marker":
                wait()
            write(self, name, data, **kwargs)
            if name.endswith(".pth") and phase == "marker-written":
                wait()

        def held_publish(objects: Any, key: str, body: bytes, **kwargs: Any) -> Any:  # a first save's marker
            if key.endswith(".pth") and phase == "marker":
                wait()
            taken = publish(objects, key, body, **kwargs)
            if key.endswith(".pth") and phase == "marker-written":
                wait()
            return taken

        store.Store.write = held_write  # type: ignore[method-assign]
        commit.publish = held_publish
    elif phase == "cleanup":
        retire, calls = commit.retire, [0]

        def held_retire(objects: Any, markers: Any, rest: Any = (), **kwargs: Any) -> int:
            calls[0] += 1
            if calls[0] > 1:
                return retire(objects, markers, rest, **kwargs)
            retire(objects, markers)  # the replaced parts' .metadata are gone, the rest not yet
            wait()
            return retire(objects, [], rest, **kwargs)

        commit.retire = held_retire
    elif phase != "none":
        raise SystemExit(f"unknown phase {phase!r}")


def main(argv: list[str]) -> int:
    held, release, phase, mode, root, *rest = argv
    if mode == "first":
        model, optim, sched = first_state()
        Checkpointer(root).save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000)
        return 0
    if mode == "race":
        model, optim, sched = race_state(int(rest[0]))
        hold_at(phase, held, release)
        local = rest[1] if len(rest) > 1 else None
        with Checkpointer(root, local_root=local) as ckpt:
            ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000, tier="local" if local else None)
        return 0
    model, optim, sched = build(5)
    if mode == "load":
        it = Checkpointer(root).load({"m": model}, {"m": optim}, {"m": sched})
        torch.save(snapshot(model, optim, sched, it), rest[0])
        return 0
    if mode == "resave":
        ckpt = Checkpointer(root, async_save=bool(rest and rest[0] == "1"))
        start = ckpt.load({"m": model}, {"m": optim}, {"m": sched})
        assert start == 1000, start
        train_a_bit(model, optim, sched, seed=2)
        hold_at(phase, held, release)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=start)
        ckpt.close()
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
