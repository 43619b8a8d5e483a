"""One commit primitive: no module of dcp_s3 but :mod:`dcp_s3._commit` writes an object only if it is absent.

A conditional write ("create, never replace") is how a marker is published; each copy of it was a place where a
save's commit could break (issue 51). The scan reads the source (``ast``) of every module of the package and
finds each call that asks for one: ``if_none_match=`` anything but ``False`` (``ObjectStore.put``/``put_views``),
or ``overwrite=`` anything but ``True`` on a ``.write(...)`` (``Store.write``). The exceptions are the mechanism
itself, each named with its reason below; anything else must call :func:`dcp_s3._commit.publish`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dcp_s3"
COMMIT_MODULE = "_commit.py"

#: (module path under dcp_s3/, enclosing function): why it may ask for a conditional write.
ALLOWED = {
    ("_objstore/s3.py", "S3ObjectStore.put"): "the S3 put itself: forwards its caller's if_none_match to put_views",
    ("_objstore/s3.py", "S3ObjectStore.conditional_writes_supported"): (
        "the capability probe: a throwaway object under PROBE_PREFIX, never a marker, deleted at once"
    ),
    ("_dcp/store.py", "Store.write"): "Store.write itself: forwards its caller's overwrite as if_none_match",
    ("admin/_convert.py", "_to_one_file"): (
        "dcp-s3 convert's one output file (.safetensors/.pt, no marker) honours the user's --force; no commit"
    ),
    ("testing/_objstore_conformance.py", "ObjectStoreConformance.test_conditional_put_refuses_an_existing_key"): (
        "the conformance suite tests the mechanism on each backend"
    ),
}


def _is_const(node: ast.expr, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []  # (enclosing function, line, call)

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for kw in node.keywords:
            conditional = (kw.arg == "if_none_match" and not _is_const(kw.value, False)) or (
                kw.arg == "overwrite" and name == "write" and not _is_const(kw.value, True)
            )
            if conditional:
                self.found.append((".".join(self.scope), node.lineno, ast.unparse(node)[:100]))
        self.generic_visit(node)


def conditional_writes(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """Every call asking for a conditional write in ``package``, by (module path, enclosing function)."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        finder = _Finder()
        finder.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for scope, line, call in finder.found:
            out.setdefault((rel, scope), []).append(f"{rel}:{line}: {call}")
    return out


def test_only_the_commit_module_writes_only_if_absent() -> None:
    found = conditional_writes()
    outside = {k: v for k, v in found.items() if k[0] != COMMIT_MODULE and k not in ALLOWED}
    assert not outside, "conditional writes outside dcp_s3/_commit.py (use dcp_s3._commit.publish):\n" + "\n".join(
        line for calls in outside.values() for line in calls
    )


def test_the_commit_module_does_publish_and_each_exception_still_exists() -> None:
    found = conditional_writes()
    assert any(k[0] == COMMIT_MODULE for k in found), "the scan no longer sees dcp_s3._commit.publish's write"
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"listed exceptions that no longer write conditionally (remove them): {stale}"


def test_the_scan_sees_each_way_of_asking(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "def a(s):\n    s.write('x', b'', overwrite=False)\n"
        "def b(o, flag):\n    o.put('k', b'', if_none_match=flag)\n"
        "def c(s, over):\n    s.write('x', b'', overwrite=over)\n"
        "def fine(s, o):\n    s.write('x', b'')\n    s.write('x', b'', overwrite=True)\n"
        "    o.put('k', b'', if_none_match=False)\n    s.writer('x', overwrite=False)\n"
    )
    assert sorted(scope for _, scope in conditional_writes(tmp_path)) == ["a", "b", "c"]
