"""A save in a child process that stops at a chosen phase, for the commit-protocol tests.

    python tests/commit_child.py HELD RELEASE PHASE save URI SEED OVERWRITE [big]
    python tests/commit_child.py HELD RELEASE PHASE step ROOT MODE
    python tests/commit_child.py HELD RELEASE PHASE local DIR SEED

At ``PHASE`` the child creates the file ``HELD`` and waits until ``RELEASE`` exists (or until
the test kills it). Phases are real botocore events on the real client, matched by request:

- ``upload``: before part 2 of a multipart upload (data half uploaded);
- ``commit``: before the PUT of ``.metadata`` (all data uploaded, nothing committed);
- ``cleanup``: before the DeleteObjects that removes the replaced checkpoint's objects;
- ``commit:<regex>``: before the PUT of the object whose key matches ``<regex>`` (``re.search``);
- ``none``: run through.

For ``local`` (``S3StorageWriter`` on a directory: the local object store), the phases are the same
points on disk: ``upload`` the planner's second item, ``commit`` the ``os.replace`` of ``.metadata``,
``cleanup`` the first deletion of a replaced data file.

``big``: a 24 MiB state saved with one upload thread, so that its parts, sent straight from tensor
memory, grow past ``part_size`` (to half the object); the child prints each part's size as it goes up.

Exit status: 0 committed, 3 ``CheckpointExistsError``, 1 anything else.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_s3 import Checkpointer, CheckpointExistsError, S3StorageWriter

MiB = 1 << 20


def state(seed: int, big: bool = False) -> dict[str, Any]:
    """6 MiB (two 5 MiB parts; ``big``: 24 MiB) of tensors determined by ``seed``, plus a byte item."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(6 * MiB if big else 3 * MiB // 2, generator=g),
        "b": torch.randn(1000, generator=g),
        "meta": {"seed": seed},
    }


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # momentum: the optimizer has state


def train_a_bit(m: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """What happens between the resume and the re-save in the test: new weights, new momentum."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    optim.zero_grad()
    m(torch.ones(2, 16)).sum().backward()
    optim.step()


def hold(phase: str, held: str, release: str) -> Any:
    """A ``before-parameter-build`` handler that waits at ``phase``."""

    def matches(op: str, params: dict[str, Any]) -> bool:
        if phase == "upload":
            return op == "UploadPart" and params.get("PartNumber") == 2
        if phase == "commit":
            return op == "PutObject" and str(params.get("Key", "")).endswith("/.metadata")
        if phase == "cleanup":
            return op == "DeleteObjects"
        if phase.startswith("commit:"):
            return op == "PutObject" and re.search(phase.split(":", 1)[1], str(params.get("Key", ""))) is not None
        return False

    def handler(params: dict[str, Any], model: Any, **_: Any) -> None:
        if not matches(model.name, params):
            return
        with open(held, "w"):
            pass
        deadline = time.monotonic() + 300  # a hang guard: the test releases or kills long before
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)

    return handler


def main(argv: list[str]) -> int:
    held, release, phase, kind, *args = argv
    if kind == "save":
        uri, seed, overwrite, *geometry = args
        big = geometry == ["big"]
        writer = S3StorageWriter(uri, overwrite=overwrite == "1", part_size=5 * MiB, max_concurrency=1 if big else 8)
        events = writer._session.object_store.client.meta.events
        if big:
            events.register("before-parameter-build.s3.UploadPart", _print_part_size)
        events.register("before-parameter-build.s3", hold(phase, held, release))
        try:
            dcp.save(state(int(seed), big), storage_writer=writer, no_dist=True)
        except BaseException as exc:  # DCP wraps errors; the cause's type decides the exit status
            text = f"{type(exc).__name__}: {exc}"
            print(text, flush=True)
            return 3 if isinstance(exc, CheckpointExistsError) or "Checkpoint already exists" in text else 1
        return 0
    if kind == "step":
        root, mode = args
        m = model(0)
        optim = sgd(m)
        ckpt = Checkpointer(root, keep_last=1)
        # The Checkpointer's writers share the first client (one per settings and process); its
        # markers go through its store's.
        for client in (S3StorageWriter(root + "/x")._session.object_store.client, ckpt.store.object_store.client):
            client.meta.events.register("before-parameter-build.s3", hold(phase, held, release))
        if mode == "first":
            m(torch.ones(2, 16)).sum().backward()
            optim.step()
            ckpt.save({"m": m}, {"m": optim}, iteration=1000)
            return 0
        start = ckpt.load(
            {"m": m}, {"m": optim}
        )  # the Getting started loop (docs/getting-started.md): resume, then save at that step again
        assert start == 1000, start
        train_a_bit(m, optim)
        ckpt.save({"m": m}, {"m": optim}, iteration=start)
        return 0
    if kind == "local":
        directory, seed, *fmt = args  # optional: the writer's metadata_format
        wait = hold(phase, held, release)
        _hold_locally(phase, lambda: wait({"PartNumber": 2, "Key": "/.metadata"}, _Op(phase)))
        planner = _HoldingPlanner(lambda: wait({"PartNumber": 2}, _Op("upload")))
        writer = S3StorageWriter(directory, metadata_format=fmt[0] if fmt else "auto")
        dcp.save(state(int(seed)), storage_writer=writer, planner=planner, no_dist=True)
        return 0
    raise SystemExit(f"unknown kind {kind!r}")


def _print_part_size(params: dict[str, Any], **_: Any) -> None:
    body = params["Body"]
    size = body.seek(0, os.SEEK_END)
    body.seek(0)
    print(f"part {params['PartNumber']}: {size} bytes", flush=True)


class _Op:
    """Stands in for botocore's operation model: which request ``hold`` is looking at."""

    def __init__(self, phase: str) -> None:
        self.name = {"upload": "UploadPart", "commit": "PutObject", "cleanup": "DeleteObjects"}.get(phase, "")


class _HoldingPlanner(DefaultSavePlanner):
    """Calls ``at_second_item`` when the writer asks for its second item (data half written)."""

    def __init__(self, at_second_item: Any) -> None:
        super().__init__()
        self._at, self._n = at_second_item, 0

    def resolve_data(self, write_item: Any) -> Any:
        self._n += 1
        if self._n == 2:
            self._at()
        return super().resolve_data(write_item)


def _hold_locally(phase: str, wait: Any) -> None:
    """Make the commit (``os.replace`` of .metadata) or the first cleanup unlink wait first."""
    if phase == "commit":
        replace = os.replace

        def held_replace(src: Any, dst: Any, **kwargs: Any) -> None:  # dir_fd= keywords: the local store's
            if str(dst).endswith(".metadata"):
                wait()
            replace(src, dst, **kwargs)

        os.replace = held_replace  # type: ignore[assignment]
    elif phase == "cleanup":
        unlink = os.unlink

        def held_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).endswith(".distcp"):
                wait()
            unlink(path, *args, **kwargs)

        os.unlink = held_unlink


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
