"""The benchmark tools: client/server CPU sampled by PID (the main table's "which side was busier" column).

The tests of the retired probes' tools (``stages.classify``, the shaped link ``link.py``) left with them; they are at
commit 679e524 (``benchmarks/README.md``, "Retired probes")."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import common, run


def test_cpu_of_client_and_server_sampled_by_pid_says_which_side_was_busy() -> None:
    """A busy 'server' process and an idle 'client' process: the sampler sees the server near one core, the
    client near zero, and the table's column names the server as the busier side."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        sampler = common.CPUSampler(idle.pid, busy.pid, interval=0.05)
        start = time.time()
        time.sleep(1.5)
        end = time.time()
        sampler.stop()
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    shares = sampler.shares(start, end)
    assert shares["client_cpu_pct"] is not None and shares["server_cpu_pct"] is not None
    # One core spinning against one sleeping, on a shared machine (other jobs take their share of the cores).
    assert shares["client_cpu_pct"] < 5
    assert shares["server_cpu_pct"] > 10
    assert run.saturation({"x": {"save": shares}}, "x", "save").split(": ")[1].startswith("server")
    assert run.saturation({"x": {"save": {}}}, "x", "save") == "—"
