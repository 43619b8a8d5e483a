"""Loggers by module (``logging.getLogger(__name__)``), all below the ``dcp_s3`` logger a user configures."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import dcp_s3

PACKAGE = Path(dcp_s3.__file__).parent
#: Where the package's own root logger is named: its NullHandler, the command line's error report.
ROOT_LOGGER_USERS = {"__init__.py", "_cli/commands.py"}


def logger_problems(path: Path, rel: str) -> Iterator[str]:
    """``path:line: why`` for each logger ``path`` makes other than ``getLogger(__name__)`` at module level:
    a module-level logger of another name, or the package's own logger (or a made-up child of it) named
    outside ``ROOT_LOGGER_USERS``. Reads the code (``ast``): ``logging.getLogger``, ``getLogger`` imported from
    ``logging`` under any name, ``logging`` imported under any name."""
    tree = ast.parse(path.read_text(), str(path))
    logging_names, get_logger_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            logging_names.update(a.asname or a.name for a in node.names if a.name == "logging")
        elif isinstance(node, ast.ImportFrom) and node.module == "logging":
            get_logger_names.update(a.asname or a.name for a in node.names if a.name == "getLogger")

    def is_get_logger(call: ast.expr) -> bool:
        if not isinstance(call, ast.Call):
            return False
        f = call.func
        if isinstance(f, ast.Name):
            return f.id in get_logger_names
        return (
            isinstance(f, ast.Attribute)
            and f.attr == "getLogger"
            and isinstance(f.value, ast.Name)
            and f.value.id in logging_names
        )

    for stmt in tree.body:  # module-level loggers: by __name__
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and is_get_logger(stmt.value):
            args = stmt.value.args  # type: ignore[attr-defined]
            if not (len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id == "__name__"):
                yield f"{rel}:{stmt.lineno}: {ast.unparse(stmt)}"
    for node in ast.walk(tree):  # the package's own loggers, named by hand
        if is_get_logger(node) and rel not in ROOT_LOGGER_USERS:
            args = node.args  # type: ignore[attr-defined]
            if _names_the_package(args[0] if args else None):
                yield f"{rel}:{node.lineno}: {ast.unparse(node)}"


def _names_the_package(name: ast.expr | None) -> bool:
    """Whether ``name`` is a literal ``"dcp_s3"``/``"dcp_s3.<...>"``, or an f-string that starts so."""
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return name.value.split(".")[0] == "dcp_s3"
    return isinstance(name, ast.JoinedStr) and ast.unparse(name).startswith(("f'dcp_s3", 'f"dcp_s3'))


def test_every_module_logs_under_its_own_name() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        offenders += logger_problems(path, path.relative_to(PACKAGE).as_posix())
    assert offenders == []


def test_the_check_sees_every_spelling(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import logging\n"
        "import logging as lg\n"
        "from logging import getLogger as gl\n"
        "log = logging.getLogger(__name__)\n"  # the rule
        "a = logging.getLogger('dcp_s3')\n"
        "b: logging.Logger = lg.getLogger('other')\n"
        "c = gl(__package__)\n"
        "def f(name):\n"
        "    logging.getLogger(name)\n"  # a logger by a caller's name (redaction filters): allowed
        "    gl('dcp_s3.made.up').info('x')\n"
        "    return lg.getLogger(f'dcp_s3.{name}')\n"
    )
    assert sorted(int(p.split(":")[1]) for p in logger_problems(probe, "probe.py")) == [5, 5, 6, 7, 10, 11]
