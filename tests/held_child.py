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
        )

    def wait_held(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.held.exists():
            if self.proc.poll() is not None:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise AssertionError(f"child exited ({self.proc.returncode}) before its phase:\n{out}")
            assert time.monotonic() < deadline, "child never reached its phase"
            time.sleep(0.05)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=60)

    def release(self) -> tuple[int, str]:
        """Let it go on; its exit code and output."""
        self.release_file.touch()
        out, _ = self.proc.communicate(timeout=240)
        return self.proc.returncode, out
