"""``python -m benchmarks.hf`` (issue 52) on a tiny model: every load and export row runs with 2 real gloo ranks
on SeaweedFS, the counters it reports are the ones the docs quote, and the results files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import hf

REPO = Path(__file__).resolve().parent.parent


def test_the_model_is_sharded_as_save_pretrained_shards() -> None:
    shapes, desc = hf.model_shapes(1024)
    total = sum(hf._numel(s) for _, s in shapes) * 2
    assert 1 << 30 <= total < 1.1 * (1 << 30), desc
    mapping = hf.shard_map(shapes, -(-total // 4))
    assert sorted(set(mapping.values())) == list(range(1, max(mapping.values()) + 1))
    assert 4 <= max(mapping.values()) <= 5
    assert all(len(s) == 2 for n, s in shapes if n.endswith("proj.weight"))


def test_the_command_runs_every_row_and_writes_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env["DCP_S3_BENCH_LOCAL_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hf", "--size-mib", "16", "--shards", "2", "--reps", "1"]
        + ["--server", "seaweedfs", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard: ~3 min on the shared 2-core machine
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = {(r["op"], r["method"]): r for r in payload["rows"]}
    assert set(rows) == {("load", "dcp_s3"), ("load", "download_then_load")} | {("export", m) for m in hf.EXPORTS}
    assert all(r["ok"] and len(r["ranks"]) == 2 for r in rows.values())
    for rank in rows[("load", "dcp_s3")]["ranks"]:  # its own shards' bytes, plus the index and headers on rank 0
        assert rank["needed_bytes"] > 0
        assert rank["needed_bytes"] <= rank["read_bytes"] <= 1.1 * rank["needed_bytes"] + (256 << 10)
        assert rank["disk_bytes"] == 0
    download = rows[("load", "download_then_load")]["ranks"]
    assert download[0]["read_bytes"] >= payload["tensor_bytes"] and download[1]["read_bytes"] == 0
    assert download[0]["disk_bytes"] >= payload["tensor_bytes"]
    export = rows[("export", "dcp_s3")]["ranks"]
    assert all(r["disk_bytes"] == 0 for r in export)
    assert {"write_data", "compose", "finish"} <= set(export[0]["phases"])
    assert rows[("export", "consolidate_then_upload")]["ranks"][0]["disk_bytes"] >= payload["tensor_bytes"]
    md = out.with_suffix(".md").read_text()
    assert "## LOAD" in md and "## EXPORT" in md and "torch_s3fs | not possible" in md
