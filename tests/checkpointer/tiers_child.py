"""A two-tier Checkpointer (one process) held at a phase of a local save or of a promotion.

    python tests/checkpointer/tiers_child.py HELD RELEASE PHASE first ROOT LOCAL
    python tests/checkpointer/tiers_child.py HELD RELEASE PHASE second ROOT LOCAL
    python tests/checkpointer/tiers_child.py HELD RELEASE PHASE load ROOT LOCAL OUT

``first`` saves iteration 10 to both tiers (promoted, waited for); ``second`` resumes, trains a bit and
saves iteration 20 to both tiers; ``load`` resumes into fresh objects and writes the snapshot and the
load's source to ``OUT``. Phases (of ``second``, in this process; see ``resave_child.hold_at``):

- ``local-model``: the local save of the model part asks for its second item;
- ``local-marker``: just before the local marker is written (every local part committed);
- ``upload``: the promotion thread starts its second object upload to S3;
- ``report``: just before the upload report of the rank (its objects are on S3);
- ``part-commit``: just before the first merged ``.metadata`` is written to S3;
- ``s3-marker``: just before the S3 marker is written (every S3 part committed);
- ``none``: run through.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from dcp_s3 import _commit as commit
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer import save_parts as checkpointer  # where the save builds its planners
from dcp_s3._dcp import store

sys.path.insert(0, os.path.dirname(__file__))
from resave_child import build, first_state, snapshot, train_a_bit  # noqa: E402


def hold_at(phase: str, held: str, release: str) -> None:
    def wait() -> None:
        with open(held, "w"):
            pass
        deadline = time.monotonic() + 300  # a hang guard: the test kills or releases long before
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)

    if phase == "local-model":
        base = checkpointer.TrainableOnlySavePlanner

        class Holding(base):  # type: ignore[misc, valid-type]
            calls = 0

            def resolve_data(self, write_item: Any) -> Any:
                Holding.calls += 1
                if Holding.calls == 2:
                    wait()
                return super().resolve_data(write_item)

        checkpointer.TrainableOnlySavePlanner = Holding  # type: ignore[misc]
        return
    write, stream_to, publish = store.Store.write, store.Store.stream_to, commit.publish
    calls = {"write": 0, "stream": 0}

    def hold(s3: bool, name: str) -> None:
        if phase == "local-marker" and not s3 and name.endswith(".pth"):
            wait()
        if phase == "report" and s3 and "__rankmeta_" in name:
            wait()
        if phase == "part-commit" and s3 and name.endswith("/.metadata"):
            wait()
        if phase == "s3-marker" and s3 and name.endswith(".pth"):
            wait()

    def held_write(self: Any, name: str, data: bytes, **kwargs: Any) -> None:
        hold(self.root.startswith("s3://"), name)
        write(self, name, data, **kwargs)

    def held_publish(objects: Any, key: str, body: bytes, **kwargs: Any) -> Any:  # a first save's marker
        if key.endswith(".pth"):
            hold(objects.url(key).startswith("s3://"), key)
        return publish(objects, key, body, **kwargs)

    def held_stream(self: Any, *args: Any) -> None:
        calls["stream"] += 1
        if phase == "upload" and calls["stream"] == 2:
            wait()
        stream_to(self, *args)

    store.Store.write = held_write  # type: ignore[method-assign]
    store.Store.stream_to = held_stream  # type: ignore[method-assign]
    commit.publish = held_publish


def main(argv: list[str]) -> int:
    held, release, phase, mode, root, local, *rest = argv
    if mode == "first":
        model, optim, sched = first_state()
        with Checkpointer(root, local_root=local) as ckpt:
            ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=10, tier="s3")
        return 0
    model, optim, sched = build(5)
    ckpt = Checkpointer(root, local_root=local)
    it = ckpt.load({"m": model}, {"m": optim}, {"m": sched})
    if mode == "load":
        torch.save({"state": snapshot(model, optim, sched, it), "source": ckpt.last_load["source"]}, rest[0])
        return 0
    if mode == "second":
        assert it == 10, it
        train_a_bit(model, optim, sched, seed=2)
        hold_at(phase, held, release)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=20, tier="s3")
        ckpt.close()
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
