"""``dcp-s3 server``: one command that gives a new user a local S3 server to try the quick start on."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_s3._checkpointer import Checkpointer


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_server_serves_a_checkpointer_until_stopped(
    stop: signal.Signals, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Started as a background job of a non-interactive shell is: with SIGINT ignored (CI runs so), which Python
    # then leaves ignored; the server must still stop on it.
    command = f"trap '' INT; exec {shlex.quote(sys.executable)} -m dcp_s3 server --kind moto --bucket trial"
    proc = subprocess.Popen(
        ["bash", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        env = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("#"):
                break
            name, _, value = line.strip().removeprefix("export ").partition("=")
            env[name] = value
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        for name, value in env.items():  # what a user does with the printed lines
            monkeypatch.setenv(name, value)
        model = torch.nn.Linear(3, 2)
        Checkpointer("s3://trial/run1").save({"model": model}, iteration=3)
        fresh = torch.nn.Linear(3, 2)
        assert Checkpointer("s3://trial/run1").load({"model": fresh}) == 3
        torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
        proc.send_signal(stop)
        assert proc.wait(timeout=60) == 0
        assert "server stopped" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_demo_refuses_s3_options_it_would_ignore() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "dcp_s3", "demo", "--endpoint-url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "unrecognized arguments: --endpoint-url" in run.stderr


def test_inspect_of_a_short_step_number_suggests_the_step_name(tmp_path: Path) -> None:
    root = tmp_path / "run1"
    Checkpointer(str(root)).save({"model": torch.nn.Linear(2, 2)}, iteration=3000)
    run = subprocess.run(
        [sys.executable, "-m", "dcp_s3", "inspect", str(root / "3000")], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1
    assert f"did you mean {root}/0003000" in run.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "dcp_s3", "ls", str(root)], capture_output=True, text=True, timeout=120
    )
    assert "1 checkpoint (1 complete, 0 incomplete)" in listed.stdout
