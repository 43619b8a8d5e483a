"""The documentation's Python snippets run: every fenced ```python block of Getting started and the
framework pages, each in a fresh interpreter, against the local SeaweedFS server.

How a page's snippet is made to run here, in the open (the pages say the same in their note):
- the standard ``AWS_*`` variables point at the server (the ``s3_env`` fixture), so snippets that rely on
  the boto3 chain need no change;
- ``s3://bucket/`` becomes ``s3://<a fresh bucket>/`` and ``http://127.0.0.1:8333`` the server's endpoint,
  by plain text replacement (:func:`localize`), and nothing else is changed.
A snippet that cannot run here (it needs an accelerator, a multi-process launcher or a training script's
objects) is marked on its page by the line before its fence, which starts with ``*Not run by the docs
tests:`` and gives the reason; a marker without a reason, or a page with no snippet at all, fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [
    "getting-started.md",
    "frameworks/dcp-route.md",
    "frameworks/torchtitan.md",
    "frameworks/lightning.md",
    "frameworks/accelerate.md",
    "frameworks/nemo-automodel.md",
    "frameworks/torch-checkpointing.md",
    "frameworks/megatron.md",
]
NOT_RUN = "*Not run by the docs tests:"
DOC_ENDPOINT = "http://127.0.0.1:8333"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def snippets(page: str) -> list[tuple[int, str, str | None]]:
    """(line, code, reason it is not run or None) of every ```python block of a page."""
    text = (DOCS / page).read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = before[len(NOT_RUN) :].strip(" *") if before.startswith(NOT_RUN) else None
        found.append((text.count("\n", 0, match.start()) + 1, match.group(1), reason))
    return found


def localize(code: str, bucket: str, endpoint: str) -> str:
    return code.replace("s3://bucket/", f"s3://{bucket}/").replace(DOC_ENDPOINT, endpoint)


CASES = [(page, line, code) for page in PAGES for line, code, reason in snippets(page) if reason is None]


def test_every_page_has_snippets_and_every_skip_says_why() -> None:
    for page in PAGES:
        found = snippets(page)
        assert found, f"{page} has no ```python snippet"
        for line, _code, reason in found:
            assert reason is None or len(reason) > 10, f"{page}:{line}: a 'Not run' marker must say why"
    assert len(CASES) >= 4


@pytest.mark.parametrize(("page", "line", "code"), CASES, ids=[f"{p}:{n}" for p, n, _ in CASES])
def test_snippet_runs(page: str, line: int, code: str, bucket: str, s3_env, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(localize(code, bucket, s3_env.endpoint_url))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page}:{line} failed:\n{done.stdout}\n{done.stderr}"
    # An s3:// path that reached a local-disk writer (torch's FileSystemWriter, a framework's own function)
    # makes a directory named "s3:" in the working directory instead of failing.
    local = sorted(p.name for p in tmp_path.iterdir() if p.name != script.name)
    assert not local, f"{page}:{line} wrote {local} to the local disk: its s3:// path did not go through dcp_s3"
