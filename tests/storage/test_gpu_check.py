"""The device check's CPU-only parts (``python -m benchmarks.gpu_check --cpu-smoke``): the same save,
load, async-save and collective code it runs on a GPU, tiny, on CPU and a 1-rank gloo group, so the
script is known to run before a GPU machine spends its minutes on it. The CUDA parts run only there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_run_writes_the_report_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--cpu-smoke",
            "--quick",
            "--dir",
            str(tmp_path / "ck"),
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert "## Errors" not in report
    for row in ("load (pinned)", "load (pinned, replica_group)", "load (pageable)", "load (async)"):
        line = next(ln for ln in report.splitlines() if ln.startswith(f"| {row} |"))
        assert line.rstrip().endswith("| True |"), line
    assert "- broadcast_bytes: True" in report and "- broadcast_error: raised on every rank" in report
    assert "- share_metadata + replica_group load: True" in report
    assert "dcp_s3_d2h" in report and "dcp_s3_h2d" in report
    assert out.with_suffix(".json").exists()


def test_without_cuda_the_device_check_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_check.run(gpu_check.parse_args([]))
