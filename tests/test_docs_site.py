"""The documentation's promises that need no server: the README is a front door (short, the set-up commands
CI and users rely on, links that lead somewhere), and the API reference names every public name.

``mkdocs build --strict`` itself (broken links and anchors, missing references, docstrings that do not render)
runs in ``.ci/run`` with the ``docs`` extra, which the test environment does not install.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import dcp_s3

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
API = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
#: The set-up commands, exactly: users copy them, and .ci/run runs the test command's `pytest -q`.
DEMO = 'pip install "torch==2.13.0" -e ".[demo]" && python -m dcp_s3._demo'
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


def test_the_api_reference_documents_exactly_the_public_face() -> None:
    """The public face is listed once (``dcp_s3._PUBLIC_MODULES``): the reference documents every name of the
    package's, ``admin``'s and ``testing``'s ``__all__`` one by one and each integration's entry module whole, and
    nothing else (no internal module: what it documents, the compatibility policy promises)."""
    documented = set(re.findall(r"^::: ([\w.]+)", API, re.M))
    expected = {"dcp_s3.integrations"}  # the folder's introduction (members: false)
    for module in dcp_s3._PUBLIC_MODULES:
        if module.startswith("dcp_s3.integrations."):
            expected.add(module)
        else:
            expected |= {f"{module}.{name}" for name in importlib.import_module(module).__all__}
    assert sorted(expected - documented) == [], "docs/api/ lacks these public names"
    assert sorted(documented - expected) == [], "docs/api/ documents what is not public (dcp_s3._PUBLIC_MODULES)"


def test_the_public_face_is_small() -> None:
    """A guard on its size (issue 51: 694 public names before it was listed; torch DCP exports 25 names,
    s3torchconnector 17): a new public name is a decision, made here."""
    names = 0
    for module in dcp_s3._PUBLIC_MODULES:
        mod = importlib.import_module(module)
        names += len(mod.__all__)
        assert all(hasattr(mod, n) for n in mod.__all__), module
    assert names <= 100, names
    assert "<!-- dcp-s3 help -->" in (ROOT / "docs" / "cli.md").read_text()  # docs/_hooks.py puts --help there
