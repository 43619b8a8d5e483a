"""One location parser for the integrations: no module of ``dcp_s3/integrations`` but the kit's
``_locations.py`` reads a path's scheme itself (issue 51: "is this an ``s3://`` location" was parsed in nine
files, the ``pathlib`` fold ``s3:/`` repaired twice; each copy was a place where a look-alike went to local disk).

The scan reads the source (``ast``) and finds every string method call or comparison whose text operand starts
with ``s3:`` or ``S3:`` (``startswith("s3:/")``, ``removeprefix("s3://")``, ``== "s3://"``, ``"s3:" in path``...),
and every call of the core's parsers (``s3_location``, ``parse_s3_uri``) imported from elsewhere than the kit.
Anything else asks :func:`dcp_s3.integrations._locations.s3_location`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

INTEGRATIONS = Path(__file__).resolve().parents[2] / "dcp_s3" / "integrations"
KIT = "_locations.py"
_TEXT_METHODS = {"startswith", "endswith", "removeprefix", "partition", "split", "find", "index", "replace"}
#: The core's module of S3 URIs (``dcp_s3._objstore.uri``, ``dcp_s3._objstore.uri`` once internals are ``_``-named):
#: imported by the kit only.
_CORE_PARSERS = re.compile(r"dcp_s3\._?objstore\.uri")


def _scheme_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower().startswith("s3:")


def scheme_parsing(source: str) -> list[tuple[int, str]]:
    """(line, code) of every place ``source`` parses an ``s3:`` scheme or imports the core's URI parsers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _TEXT_METHODS:
            hit = any(_scheme_text(a) for a in node.args) or any(
                isinstance(a, ast.Tuple) and any(_scheme_text(e) for e in a.elts) for a in node.args
            )
        elif isinstance(node, ast.Compare):
            hit = any(_scheme_text(x) for x in (node.left, *node.comparators))
        elif isinstance(node, ast.ImportFrom):
            hit = _CORE_PARSERS.fullmatch(node.module or "") is not None
        if hit:
            found.append((node.lineno, ast.unparse(node)[:100]))
    return found


def test_only_the_kit_parses_s3_locations() -> None:
    offenders = {
        str(path.relative_to(INTEGRATIONS)): found
        for path in sorted(INTEGRATIONS.rglob("*.py"))
        if path.name != KIT and (found := scheme_parsing(path.read_text()))
    }
    assert offenders == {}, f"parse locations with dcp_s3.integrations._locations: {offenders}"


def test_the_scan_sees_each_spelling() -> None:
    """The scan finds what it guards (a guard that cannot fail is worse than none)."""
    spellings = [
        'p.startswith("s3:/")',
        "p.startswith(('s3://', 'S3://'))",
        'p.removeprefix("s3://")',
        'p == "s3://"',
        '"s3:" in p',
        "from dcp_s3._objstore.uri import parse_s3_uri",
        "from dcp_s3._objstore.uri import s3_location",
    ]
    for code in spellings:
        assert scheme_parsing(code), code
    assert scheme_parsing('raise ValueError(f"expected s3://bucket/key, got {p}")\nx = "s3://b/k"') == []
    assert scheme_parsing((INTEGRATIONS / KIT).read_text())  # the kit itself is what the scan would find
