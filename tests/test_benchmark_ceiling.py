"""``benchmarks.ceiling``: GIL-held seconds sampled by py-spy over a child's timed region only, and the command's
table on a tiny run (issue 53)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import ceiling, common

pytestmark = pytest.mark.skipif(
    ceiling.py_spy_usable() is not None, reason=f"py-spy cannot sample a child here: {ceiling.py_spy_usable()}"
)

# A child that spins (holding the GIL) outside its region and does ``inside`` within it, with the worker's handshake.
CHILD = """
import sys, time
from benchmarks.worker import _perf
def spin(s):
    t = time.perf_counter()
    while time.perf_counter() - t < s:
        sum(range(1000))
spin(0.6)
_perf("enable")
{inside}
_perf("disable")
spin(0.6)
"""


def _sampled(inside: str) -> dict:
    with tempfile.TemporaryDirectory() as work:
        sampler = ceiling.GilSampler(work, rate=200)
        env = dict(os.environ, **sampler.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.REPO_ROOT), env.get("PYTHONPATH")]))
        child = subprocess.Popen([sys.executable, "-c", CHILD.format(inside=inside)], env=env, cwd=common.REPO_ROOT)
        sampler.on_start(child.pid)
        try:
            assert child.wait(timeout=120) == 0
        finally:
            child.kill()
            sampler.close()
        return sampler.result()


def test_the_sampler_counts_the_gil_held_in_the_region_and_nothing_outside_it() -> None:
    """A region that spins holds the GIL most of its wall time; a region that sleeps holds none of it, though the
    child spins for 1.2 s around it (a sampler running outside the region would count those)."""
    busy = _sampled("spin(1.0)")
    idle = _sampled("time.sleep(1.0)")
    assert "gil_error" not in busy and "gil_error" not in idle, (busy, idle)
    assert busy["gil_share"] > 0.4, busy  # a shared machine may preempt the spinner; py-spy still sees it hold
    assert busy["gil_held_s"] <= busy["sampled_wall_s"] * 1.1 + 0.05, busy
    assert idle["gil_held_s"] < 0.15, idle


def test_the_command_prints_and_writes_a_ceiling_per_row(tmp_path: Path) -> None:
    """4 MiB through dcp_s3 over HTTP, cold: a save row and a load row, each with GIL-held s/GB and its ceiling."""
    out = tmp_path / "ceiling.json"
    argv = ["--size-mib", "4", "--contestants", "dcp_s3", "--schemes", "http", "--modes", "cold", "--out", str(out)]
    assert ceiling.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["failed"] == {}
    row = payload["summary"]["dcp_s3 http cold"]
    for op in ("save", "load"):
        assert row[op]["gil_s_per_gb"] > 0, row
        assert row[op]["ceiling_gbps"] == pytest.approx(1 / row[op]["gil_s_per_gb"])
        assert 0 < row[op]["gil_share"] <= 1.2, row
    assert "| dcp_s3 | http | cold |" in out.with_suffix(".md").read_text()
