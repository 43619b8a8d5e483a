"""The device check's framework parts (``python -m benchmarks.gpu_frameworks --cpu-smoke``): Megatron-core, NeMo
AutoModel and torch-checkpointing through dcp_s3, the same code the GPU machine runs, tiny, on CPU and gloo (moto's
server for what needs S3), so the script is known to run before a GPU machine spends its minutes on it. What needs
CUDA is reported as skipped, with why; it runs only there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_frameworks

REPO_ROOT = Path(__file__).resolve().parents[2]

#: What the smoke run must report as passed, by part: a check's name starts with one of these.
PASSED = {
    "megatron": ["sync save + load, bit-exact", "async: AsyncCallsQueue() (forked worker)"],
    "nemo_automodel": [
        "is_async on s3://: accepted",
        "sync save + resume through S3Checkpointer, bit-exact",
        "is_async as NeMo's _do_save makes it",
        "is_async=True through S3Checkpointer as NeMo's recipes call it",
    ],
    "torch_checkpointing": [
        "save + load, no resharder: 2 gloo ranks -> the same 2, moto",
        "save + load, no resharder: 1 rank, async saver -> 1, moto",
        "save + load, no resharder: 1 rank -> 1, local directory",
    ],
}
#: What needs CUDA, reported as skipped.
SKIPPED = {
    "megatron": ["async: AsyncCallsQueue(persistent=True)"],
    "torch_checkpointing": ["resharding load (DefaultResharder)"],
}
#: Checks known to fail, with the cause their note must give (none today: S3StorageConfig on a local directory
#: could not commit until this check found it).
BROKEN: dict[tuple[str, str], str] = {}


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


@pytest.mark.multiproc
def test_cpu_smoke_run_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "gpu_frameworks.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_frameworks",
            "--cpu-smoke",
            "--dir",
            str(tmp_path / "ck"),
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.with_suffix(".json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    rows = {(part, row["check"]): row for part, doc in results["parts"].items() for row in doc["rows"]}
    report = out.read_text()

    def find(part: str, prefix: str) -> dict[str, str]:
        found = [row for (p, check), row in rows.items() if p == part and check.startswith(prefix)]
        assert len(found) == 1, (part, prefix, sorted(rows), report)
        return found[0]

    for part, prefixes in PASSED.items():
        for prefix in prefixes:
            row = find(part, prefix)
            assert row["status"] == "ok", (part, row)
    for part, prefixes in SKIPPED.items():
        for prefix in prefixes:
            row = find(part, prefix)
            assert row["status"] == "skipped" and "needs CUDA" in row["note"], (part, row)
    for (part, check), cause in BROKEN.items():
        row = find(part, check)
        assert row["status"] == "error" and cause in row["note"], f"{part}: {check} changed (fixed? move it): {row}"
    listed = {(p, c) for p, c in rows if not any(c.startswith(x) for x in PASSED.get(p, []) + SKIPPED.get(p, []))}
    assert listed == set(BROKEN), f"checks this test does not know: {listed - set(BROKEN)}"
    assert proc.returncode == (1 if BROKEN else 0), proc.stdout[-2000:]
    assert "| megatron | sync save + load, bit-exact | ok |" in report


def test_a_part_past_its_deadline_is_killed_and_named(tmp_path: Path) -> None:
    """A hung part ends at its deadline (its whole session: workers and servers too), and the record names it."""
    args = gpu_frameworks.parse_args(["--cpu-smoke"])
    doc = gpu_frameworks.run_part("megatron", args, tmp_path, limit_s=1.0)
    assert doc["ended"] == "killed at its deadline (1 s)"
    assert doc["rows"] and doc["rows"][-1]["status"] == "error", doc["rows"]
    assert "killed at its deadline" in doc["rows"][-1]["note"]
    with pytest.raises(ProcessLookupError):  # nothing of the part's session is left
        os.killpg(doc["pid"], 0)


def test_without_cuda_the_framework_check_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_frameworks.run(gpu_frameworks.parse_args([]))


def test_unknown_part_is_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_frameworks.parse_args(["--parts", "megatron,deepspeed"])
