"""The lint gates are configured once (pyproject's ``[tool.ruff]``) and run the same way by the pre-commit hook and
by ``.ci/run``: both through ``.ci/ruff``, which runs only the ruff pinned in the dev extra."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_rule_families_and_the_complexity_bound_are_selected() -> None:
    import tomllib  # here, not at the top: Python 3.10 (the torch-range subset's) has none, and collects this file

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert {"C901", "B", "SIM", "RET", "UP"} <= set(lint["select"])
    assert lint["mccabe"]["max-complexity"] == 15
    # Complexity may be waived for test helpers and benchmark drivers, never for the package.
    assert not any(path.startswith("dcp_s3") for path in lint.get("per-file-ignores", {}))


def test_the_hook_and_ci_run_the_same_pinned_ruff() -> None:
    hooks = (ROOT / ".pre-commit-config.yaml").read_text()
    assert "entry: .ci/ruff check\n" in hooks
    assert "entry: .ci/ruff format --check\n" in hooks
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".ci/ruff check ||" in ci
    assert ".ci/ruff format --check ||" in ci
    wrapper = (ROOT / ".ci" / "ruff").read_text()
    assert '"optional-dependencies"]["dev"]' in wrapper  # the version it insists on is the dev extra's pin
