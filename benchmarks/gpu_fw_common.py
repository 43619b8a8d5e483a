"""What the framework parts of the device check share (:mod:`benchmarks.gpu_frameworks`): the record of one part's
checks, its process group, the byte comparison, and the S3 server when one travelled.

A part runs in a child process of its own; it writes its record to a JSON file after every check, so that when the
parent kills it at its deadline, every check that finished still counts and the one it was in is named.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MOTO_PATH_ENV", "Record", "Target", "init_group", "same_bytes", "same_state", "s3_target"]

#: Set by ``gpu_check.sh``: where moto and its own dependencies were installed (apart from dcp_s3's wheels, so that
#: nothing of theirs shadows the machine's packages in the check's process; only the server's process sees them).
MOTO_PATH_ENV = "DCP_S3_GPU_MOTO_PATH"
#: The deadline of every collective of a part's process groups (a hung rank ends the check, not the machine's time).
GROUP_TIMEOUT = timedelta(seconds=120)


class Record:
    """The checks of one part, each ``ok``, ``fail`` (ran; the result is wrong), ``error`` (raised), or ``skipped``
    (with why), with its seconds and a note; written to ``path`` after each check, with the check in progress."""

    def __init__(self, path: Path, part: str, cuda: bool) -> None:
        self.path, self.part, self.cuda = path, part, cuda
        self.rows: list[dict[str, Any]] = []
        self.running: str | None = None
        self.facts: dict[str, Any] = {}
        self._flush()

    def _flush(self) -> None:
        doc = {"part": self.part, "cuda": self.cuda, "rows": self.rows, "running": self.running, "facts": self.facts}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.path)

    def add(self, check: str, status: str, seconds: float | None = None, note: str = "") -> None:
        self.rows.append({"check": check, "status": status, "seconds": seconds, "note": note})
        self.running = None
        self._flush()
        print(f"[{self.part}] {check}: {status}{f' ({note})' if note else ''}", flush=True)

    def skip(self, check: str, why: str) -> None:
        self.add(check, "skipped", None, why)

    def fact(self, key: str, value: Any) -> None:
        self.facts[key] = value
        self._flush()

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[dict[str, Any]]:
        """Run the block as check ``name``; the block sets ``out["ok"] = False`` for a wrong result and may set
        ``out["note"]``. An exception (DCP's ``CheckpointException`` is a ``BaseException``) is recorded as an
        error with its root cause, and the part goes on with its next check."""
        self.running = name
        self._flush()
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            yield out
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded; the next check runs
            traceback.print_exc()
            self.add(name, "error", time.perf_counter() - t0, _describe(exc))
            return
        status = "ok" if out.get("ok", True) else "fail"
        self.add(name, status, time.perf_counter() - t0, str(out.get("note", "")))


def _describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` and of its causes (DCP wraps a rank's error in ``CheckpointException``)."""
    parts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 4:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {_clip(str(current))}")
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: exception or traceback}
        if isinstance(failures, dict) and failures:
            parts.append(f"rank failure: {_clip(str(next(iter(failures.values()))))}")
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


def _clip(text: str) -> str:
    """A message's head and tail (a traceback's cause is at its end)."""
    return text if len(text) <= 600 else f"{text[:200]} ... {text[-400:]}"


def init_group(root: Path, cuda: bool, backend: str) -> None:
    """This process as rank 0 of a 1-rank default group of ``backend`` (file rendezvous below ``root``; on a GPU
    bound to ``cuda:0``), with :data:`GROUP_TIMEOUT` on every collective."""
    rendezvous = Path(tempfile.mkdtemp(dir=root)) / "pg"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=0,
        world_size=1,
        timeout=GROUP_TIMEOUT,
        **({"device_id": torch.device("cuda", 0)} if cuda else {}),
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 count), wherever each lies."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().cpu().contiguous().view(-1).view(torch.uint8),
        b.detach().cpu().contiguous().view(-1).view(torch.uint8),
    )


def same_state(a: Any, b: Any) -> bool:
    """Nested dicts/lists of tensors and plain values, equal with tensors compared by :func:`same_bytes`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return same_bytes(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Target:
    """An S3 server's bucket: ``root`` (``s3://bucket``), the storage ``options`` that reach it."""

    def __init__(self, root: str, options: dict[str, Any]) -> None:
        self.root, self.options = root, options


@contextlib.contextmanager
def s3_target() -> Iterator[Target | None]:
    """moto's server on loopback with a fresh bucket, when moto travelled (``MOTO_PATH_ENV``) or is importable here;
    else None. Its credentials go into this process's environment (the standard chain), never into a message."""
    extra = os.environ.get(MOTO_PATH_ENV)
    if not extra and importlib.util.find_spec("moto") is None:
        yield None
        return
    from dcp_s3._local_server import LocalS3Server  # noqa: PLC0415  (imports boto3: only where a server runs)

    saved = os.environ.get("PYTHONPATH")
    if extra:  # the server's process alone sees moto's packages
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (extra, saved) if p)
    try:
        server = LocalS3Server.start("moto", timeout=60)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    with server:
        env = server.env()
        env.pop("AWS_ENDPOINT_URL")  # the options carry the endpoint: nothing reaches it by the environment alone
        os.environ.update(env)
        bucket = server.create_bucket(f"gpu-fw-{uuid.uuid4().hex[:12]}")
        yield Target(f"s3://{bucket}", {"endpoint_url": server.endpoint_url})
