"""The README's demo command works end to end (it starts its own server)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_demo_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_s3", "demo"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every tensor matches" in proc.stdout and "demo OK" in proc.stdout
    assert "__0_0.distcp" in proc.stdout and "__1_0.distcp" in proc.stdout
