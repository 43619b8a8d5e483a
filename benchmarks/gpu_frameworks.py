"""The device check's framework parts (project issue 40): what the CPU tests of Megatron-core, NeMo AutoModel and
torch-checkpointing through dcp_s3 cannot run, on one GPU, within a time budget of its own.

``python -m benchmarks.gpu_frameworks`` (on the GPU machine: ``benchmarks/gpu_check.sh run`` runs it after
``benchmarks.gpu_check``, or ``gpu_check.sh frameworks`` alone) writes ``benchmarks/results/gpu_frameworks.md``
(and ``.json``). Each part runs in a child process of its own, killed at its deadline; one part failing, hanging or
missing its framework is recorded and the others still run:

* ``megatron`` (:mod:`benchmarks.gpu_fw_megatron`): CUDA ShardedTensors through ``dcp_s3.integrations.megatron``
  on a 1-rank NCCL group, sync and async with Megatron's unpatched ``AsyncCallsQueue`` and its persistent worker;
* ``nemo_automodel`` (:mod:`benchmarks.gpu_fw_nemo`): ``is_async`` — accepted on ``s3://``, NeMo's async route
  driven by hand with the integration's writer and commit, and the supported path through ``S3Checkpointer`` with
  NeMo's default CUDA staging — and the sync path with CUDA DTensors (these need an S3 server: moto's, when it
  travelled);
* ``torch_checkpointing`` (:mod:`benchmarks.gpu_fw_torchckpt`): the resharding load (2 -> 1 and 1 -> 2 ranks)
  through ``S3StorageConfig``, on the local directory and on moto's server.

Checkpoints go to a local directory (``--dir``; default under ``/dev/shm`` when it has room), dcp_s3's local store,
as in ``benchmarks.gpu_check``. ``--cpu-smoke`` runs every part it can on CPU and gloo, tiny (the test suite runs it:
``tests/storage/test_gpu_frameworks.py``); what needs CUDA is recorded as skipped, with why.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_fw_common import MOTO_PATH_ENV, Record

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
#: Each part's module and its longest run on a GPU (seconds); a part gets less when the budget runs short, never
#: less than FLOOR_S while later parts still wait.
PARTS = {
    "megatron": ("benchmarks.gpu_fw_megatron", 90),
    "nemo_automodel": ("benchmarks.gpu_fw_nemo", 90),
    "torch_checkpointing": ("benchmarks.gpu_fw_torchckpt", 90),
}
FLOOR_S = 40
#: A smoke run's deadline per part (a shared CPU machine; the budget is the GPU's).
SMOKE_LIMIT_S = 300
DISTS = ("megatron-core", "nemo-automodel", "torch-checkpointing", "transformers", "moto")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_frameworks", description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=180.0, help="the whole run's time budget (seconds)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--megatron-mib", type=float, default=256.0, help="size of Megatron's CUDA state (MiB)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: /dev/shm if it has room, else /tmp)")
    p.add_argument("--out", default=str(RESULTS / "gpu_frameworks.md"))
    p.add_argument("--cpu-smoke", action="store_true", help="every part that runs on CPU and gloo, tiny")
    p.add_argument("--part", help=argparse.SUPPRESS)  # a child process: run this part only
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    return args


def environment(cuda: bool) -> dict[str, Any]:
    """The machine and the versions installed (read from package metadata: nothing is imported here)."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist_name in DISTS:
        try:
            env[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            env[dist_name] = None
    if os.environ.get(MOTO_PATH_ENV):
        env["moto"] = f"carried in ({os.environ[MOTO_PATH_ENV]})"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name}, {props.total_memory / (1 << 30):.0f} GiB"
    return env


# ------------------------------------------------------------------------------------------------------- a part


def part_main(args: argparse.Namespace) -> int:
    """In the child process: run part ``args.part``, recording every check in ``args.part_out``."""
    cuda = not args.cpu_smoke
    rec = Record(Path(args.part_out), args.part, cuda)
    module_name, _ = PARTS[args.part]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # the framework (or a module it imports) did not travel, or will not import here
        rec.add("import", "error", None, f"{type(exc).__name__}: {exc} (missing: {getattr(exc, 'name', None)})")
        return 0  # recorded: the run reports it as a failed check
    root = Path(args.dir)
    module.run(rec, root, cuda, args.megatron_mib if cuda else 2.0)
    return 0


def run_part(name: str, args: argparse.Namespace, root: Path, limit_s: float) -> dict[str, Any]:
    """Part ``name`` in a child process (its own session, so that its workers and servers end with it), killed after
    ``limit_s``; its record, with how it ended."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    record, log = scratch / "record.json", scratch / "output.log"
    cmd = [sys.executable, "-m", "benchmarks.gpu_frameworks", "--part", name, "--part-out", str(record)]
    cmd += ["--dir", str(scratch), "--megatron-mib", str(args.megatron_mib)] + (
        ["--cpu-smoke"] if args.cpu_smoke else []
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=limit_s)
            ended = "exited" if proc.returncode == 0 else f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"killed at its deadline ({limit_s:.0f} s)"
        with contextlib.suppress(ProcessLookupError):  # the part's session: its workers, ranks and server too
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    doc: dict[str, Any] = {"rows": [], "facts": {}, "running": None}
    if record.exists():
        doc = json.loads(record.read_text())
    if doc.get("running"):
        doc["rows"].append(
            {"check": doc["running"], "status": "error", "seconds": None, "note": f"unfinished: {ended}"}
        )
    elif not doc["rows"] or proc.returncode:
        tail = log.read_text(errors="replace")[-1500:]
        doc["rows"].append({"check": "part process", "status": "error", "seconds": None, "note": f"{ended}: {tail}"})
    doc.update(
        seconds=time.perf_counter() - t0,
        ended=ended,
        limit_s=limit_s,
        pid=proc.pid,
        log_tail=log.read_text(errors="replace")[-4000:],
    )
    return doc


def pick_dir(arg: str | None) -> Path:
    if arg:
        Path(arg).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="dcp_s3-gpu-fw-", dir=arg))
    for base in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(base) and shutil.disk_usage(base).free > 8 << 30:
            return Path(tempfile.mkdtemp(prefix="dcp_s3-gpu-fw-", dir=base))
    return Path(tempfile.mkdtemp(prefix="dcp_s3-gpu-fw-"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke for the parts that run on CPU")
    t_start = time.perf_counter()
    root = pick_dir(args.dir)
    names = args.parts.split(",")
    results: dict[str, Any] = {
        "environment": environment(cuda),
        "dir": str(root),
        "budget_s": args.budget_s,
        "parts": {},
    }
    for i, name in enumerate(names):
        left = args.budget_s - (time.perf_counter() - t_start)
        limit = min(PARTS[name][1], left - FLOOR_S * (len(names) - i - 1)) if cuda else SMOKE_LIMIT_S
        if limit < 10:
            row = {"check": "part", "status": "skipped", "seconds": None, "note": f"budget spent ({left:.0f} s left)"}
            results["parts"][name] = {"rows": [row], "facts": {}, "ended": "not started"}
            continue
        results["parts"][name] = run_part(name, args, root, limit)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    results["seconds"] = time.perf_counter() - t_start
    return results


def failed(results: dict[str, Any]) -> list[str]:
    return [
        f"{name}: {row['check']}"
        for name, part in results["parts"].items()
        for row in part["rows"]
        if row["status"] in ("fail", "error")
    ]


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    versions = ", ".join(f"{k} {env.get(k) or 'not installed'}" for k in DISTS)
    lines = [
        "# Device check: frameworks (issue 40)",
        "",
        f"Generated by `python -m benchmarks.gpu_frameworks` in {results['seconds']:.0f} s (budget "
        f"{results['budget_s']:.0f} s) on {env.get('gpu', 'CPU only (smoke run)')}, Python {env['python']}, torch "
        f"{env['torch']} (CUDA {env['cuda']}); {versions}. Checkpoints in `{results['dir']}` (dcp_s3's local store), "
        "and on moto's server where a check says so.",
        "",
        "| part | check | result | s | note |",
        "|---|---|---|---:|---|",
    ]
    for name, part in results["parts"].items():
        for row in part["rows"]:
            secs = f"{row['seconds']:.1f}" if isinstance(row.get("seconds"), (int, float)) else ""
            note = str(row.get("note", "")).replace("|", "/").replace("\n", " ")
            lines.append(f"| {name} | {row['check']} | {row['status']} | {secs} | {note} |")
    lines += ["", "## Parts", ""]
    for name, part in results["parts"].items():
        facts = ", ".join(f"{k}: {v}" for k, v in part.get("facts", {}).items())
        took = f", {part['seconds']:.0f} s of {part['limit_s']:.0f} s" if "seconds" in part else ""
        lines.append(f"- {name}: {part.get('ended', '')}{took}{'; ' + facts if facts else ''}")
    bad = failed(results)
    if bad:
        lines += ["", "## Failed", ""] + [f"- {b}" for b in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part:
        return part_main(args)
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(results))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    print(out.read_text())
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
