"""The README's demo command works end to end (it starts its own server)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_demo_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "dcp_s3", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every tensor matches" in proc.stdout and "demo OK" in proc.stdout
    assert re.search(r"__0_0\.[0-9a-f]{16}\.distcp", proc.stdout) and re.search(
        r"__1_0\.[0-9a-f]{16}\.distcp", proc.stdout
    )
