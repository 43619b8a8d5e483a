"""The documentation's promises that need no server: the README is a front door (short, the set-up commands
CI and users rely on, links that lead somewhere), and the API reference names every public name.

``mkdocs build --strict`` itself (broken links and anchors, missing references, docstrings that do not render)
runs in ``.ci/run`` with the ``docs`` extra, which the test environment does not install.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import dcp_s3
import dcp_s3.integrations

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
API = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
#: The set-up commands, exactly: users copy them, and .ci/run runs the test command's `pytest -q`.
DEMO = 'pip install "torch==2.13.0" -e ".[demo]" && python -m dcp_s3.demo'
TESTS = 'pip install "torch==2.13.0" -e ".[test]" && pip install --no-deps torchtitan==0.3.0 nemo-automodel==0.7.0 torch-checkpointing==0.1.1 && python -m pytest -q -n 2 --dist loadfile'


def test_the_readme_is_a_front_door_with_the_set_up_commands() -> None:
    assert len(README.splitlines()) <= 200
    section = README.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    assert f"```bash\n{DEMO}\n```" in section
    assert f"```bash\n{TESTS}\n```" in section
    assert "python3 -m pytest -q -n 2 --dist loadfile" in (ROOT / ".ci" / "run").read_text()


def test_the_readmes_relative_links_lead_to_files_and_its_anchors_to_headings() -> None:
    headings = {
        re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in re.findall(r"^#+ (.*)$", README, re.M)
    }
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README links to {target}, which does not exist"
        else:
            assert anchor in headings, f"README links to #{anchor}, which no heading makes"


def test_the_api_reference_names_every_public_name() -> None:
    documented = set(re.findall(r"^::: ([\w.]+)", API, re.M))
    expected = {f"dcp_s3.{name}" for name in dcp_s3.__all__}
    for module in ("dcp_s3.admin", "dcp_s3.testing"):
        expected |= {f"{module}.{name}" for name in importlib.import_module(module).__all__}
    expected |= {  # private (_-prefixed) modules are internals, not in the reference
        f"dcp_s3.integrations.{m.name}"
        for m in pkgutil.iter_modules(dcp_s3.integrations.__path__)
        if not m.name.startswith("_")
    }
    missing = sorted(expected - documented)
    assert not missing, f"docs/api/ has no `::: name` for {missing}"
    assert "<!-- dcp-s3 help -->" in (ROOT / "docs" / "cli.md").read_text()  # docs/_hooks.py puts --help there
