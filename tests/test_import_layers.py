"""The layers of the package, as import-linter checks them (contracts in pyproject.toml).

``lint-imports`` must pass on the package; a copy of the package with an upward import or a new
import cycle must fail, naming it (so the contracts check what the README says they do); and the
imports inside functions are exactly the listed ones, each with its reason (none dodges a cycle).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dcp_s3"
LINT = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))

#: Every import inside a function body in dcp_s3, by (module path, imported module): why it is there.
FUNCTION_LOCAL_IMPORTS = {
    **{
        ("_cli/handlers.py", "dcp_s3.admin"): "`dcp-s3 --help` and argument errors answer without importing torch",
        ("_cli/handlers.py", "dcp_s3._demo"): "`dcp-s3 demo` only: the demo imports torch and FSDP",
        ("_cli/handlers.py", "dcp_s3._local_server"): "`dcp-s3 server` only: boto3 and the server's start-up",
    },
    ("admin/_convert.py", "safetensors.torch"): "optional dependency, only for `convert --format safetensors`",
    # Private torch names that only one feature needs: a torch without them still imports dcp_s3.
    ("_torch_compat.py", "torch.distributed.checkpoint.utils"): "_DistWrapper, or None where torch lacks it",
    ("_torch_compat.py", "torch.distributed.checkpoint._extension"): "only items written with torch's transforms",
}


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [LINT, str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_package_keeps_every_contract() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout and "Contracts: 6 kept, 0 broken." in out.stdout, out.stdout


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    for tree in ("dcp_s3", "benchmarks"):  # the contracts' root packages
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_an_upward_import_fails_naming_it(package_copy: Path) -> None:
    # The object stores reaching up into the checkpoint manager, hidden inside a function.
    _append(package_copy / "dcp_s3/_objstore/buffers.py", "def _f():\n    import dcp_s3._checkpointer.steps")
    out = _lint(package_copy)
    assert out.returncode != 0
    assert "dcp_s3._objstore.buffers -> dcp_s3._checkpointer.steps" in out.stdout, out.stdout


def test_an_import_cycle_fails_naming_it(package_copy: Path) -> None:
    # codec.format is imported by codec.v1; importing it back (only for type checking) closes a circle.
    _append(
        package_copy / "dcp_s3/_codec/format.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dcp_s3._codec.v1 import encode_frame",
    )
    out = _lint(package_copy)
    assert out.returncode != 0
    assert "No cycles are allowed in dcp_s3._codec" in out.stdout, out.stdout
    assert ".v1 -> .format" in out.stdout or ".format -> .v1" in out.stdout, out.stdout  # the import to remove


def test_torch_below_the_storage_layer_fails(package_copy: Path) -> None:
    _append(package_copy / "dcp_s3/_objstore/redact.py", "import torch")
    out = _lint(package_copy)
    assert out.returncode != 0
    assert "dcp_s3._objstore is not allowed to import torch" in out.stdout, out.stdout


def test_a_framework_outside_the_integrations_fails(package_copy: Path) -> None:
    _append(package_copy / "dcp_s3/_checkpointer/objects.py", "def _f():\n    import torchtitan")
    out = _lint(package_copy)
    assert out.returncode != 0
    assert "dcp_s3._checkpointer.objects -> torchtitan" in out.stdout, out.stdout


def _function_local_imports() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom):
                        found.add((path.relative_to(PACKAGE).as_posix(), inner.module or ""))
                    elif isinstance(inner, ast.Import):
                        found.update((path.relative_to(PACKAGE).as_posix(), a.name) for a in inner.names)
    return found


def test_imports_inside_functions_are_the_listed_ones() -> None:
    """A new import inside a function needs a reason here; dodging a cycle is not one."""
    found = _function_local_imports()
    assert found - set(FUNCTION_LOCAL_IMPORTS) == set(), "unlisted imports inside functions"
    assert set(FUNCTION_LOCAL_IMPORTS) - found == set(), "listed but gone: remove them from the list"
