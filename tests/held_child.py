"""A child process held at a phase of its work until released or SIGKILLed (the crash tests' driver).

The child script (``commit_child.py``, ``resave_child.py``) gets the paths of a *held* file, which it
creates when it reaches ``phase``, and of a *release* file, which it waits for before going on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).parent.parent)


class HeldChild:
    """``script`` in another process, held at ``phase`` until released or killed."""

    def __init__(self, script: str, tmp: Path, phase: str, *args: str, env: dict[str, str] | None = None) -> None:
        n = time.monotonic_ns()
        self.held, self.release_file = tmp / f"held-{n}", tmp / f"go-{n}"
        self.proc = subprocess.Popen(
            [sys.executable, script, str(self.held), str(self.release_file), phase, *args],
            env=dict(os.environ, **(env or {}), PYTHONPATH=ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: ``kill`` reaches the processes it started too
        )

    def wait_held(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.held.exists():
            if self.proc.poll() is not None:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise AssertionError(f"child exited ({self.proc.returncode}) before its phase:\n{out}")
            assert time.monotonic() < deadline, "child never reached its phase"
            time.sleep(0.05)

    def kill(self) -> str:
        """SIGKILL the child and every process it started (torch's upload process of an async save, spawned
        ranks): the whole process group, at once, as a node failure would. Returns what it printed."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        out, _ = self.proc.communicate(timeout=60)  # every holder of its output pipe is gone
        return str(out)

    def group_alive(self) -> bool:
        """Whether any process of the child's group still runs (a zombie, dead but not yet reaped, does not)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgrp, state
                return True
        return False

    def release(self) -> tuple[int, str]:
        """Let it go on; its exit code and output."""
        self.release_file.touch()
        out, _ = self.proc.communicate(timeout=240)
        return self.proc.returncode, out
