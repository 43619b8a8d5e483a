"""Private names of Python and of the frameworks, fenced like torch's (``tests/test_private_torch_names.py``).

CPython's private interfaces can change in any release; each is used in exactly one module, named here, whose
docstring says why, so a new Python has one place to check per name:

- ``sys._current_frames``: ``objstore/deadline.py`` finds the socket a stuck request thread waits on;
- ``sys._getframe``: ``planners/sharing.py`` finds the torch ``_DistWrapper`` that runs a plan;
- ``pickle._Unpickler``/``pickle._Stop``: ``untrusted/metadata_pickle.py`` decodes ``.metadata`` opcodes with
  the pure-Python unpickler under its own allow-list.

Walking the interpreter's frames (``frame.f_back``, ``frame.f_locals``, ``inspect.currentframe()``,
``inspect.stack()``...) is fenced the same way: only the two modules above that do it, for the reasons they give.

A framework's private names (Accelerate's ``_fsdp_utils``, Megatron's and NeMo's helpers) appear only in that
framework's module under ``dcp_s3/integrations/``. The guard reads the code (``ast``): attributes of an imported
module, ``from module import _name`` and ``getattr(module, "_name")`` (also ``hasattr``/``setattr``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import dcp_s3

PACKAGE = Path(dcp_s3.__file__).parent

#: (module, private name) -> the one file (relative to the package) that may use it.
ALLOWED = {
    ("sys", "_current_frames"): "_objstore/deadline.py",
    ("sys", "_getframe"): "_planners/sharing.py",
    ("pickle", "_Unpickler"): "_untrusted/metadata_pickle.py",
    ("pickle", "_Stop"): "_untrusted/metadata_pickle.py",
}


#: Frame walking: what reaches another frame than one's own, and the modules that may do it.
FRAME_ATTRIBUTES = {"f_back", "f_locals", "f_globals"}
FRAME_FUNCTIONS = {("inspect", "currentframe"), ("inspect", "stack"), ("inspect", "getouterframes")}
FRAME_FUNCTIONS |= {("traceback", "walk_stack"), ("sys", "_getframe"), ("sys", "_current_frames")}
FRAME_WALKERS = {"_objstore/deadline.py", "_planners/sharing.py"}
_ATTR_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("dcp_s3", "torch")  # torch's privates: tests/test_private_torch_names.py


def private_uses(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, module, private name) of every private name of another package that ``path`` uses."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.split(".")[0]] = (
                    alias.asname and alias.name or alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and not _ours(node.module):
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, node.module, alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules and not _ours(modules[base.id]):
                yield node.lineno, modules[base.id], node.attr
        elif (  # getattr(sys, "_getframe"): the same use, spelled so that no attribute shows
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in modules
            and not _ours(modules[node.args[0].id])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            yield node.lineno, modules[node.args[0].id], node.args[1].value


def frame_walks(path: Path) -> Iterator[tuple[int, str]]:
    """(line, what) of every step ``path`` takes through the interpreter's frames."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}
    functions: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (node.module, alias.name) in FRAME_FUNCTIONS:
                    functions[alias.asname or alias.name] = (node.module, alias.name)
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in FRAME_ATTRIBUTES:
                yield node.lineno, f".{node.attr}"
            elif isinstance(node.value, ast.Name) and (modules.get(node.value.id), node.attr) in FRAME_FUNCTIONS:
                yield node.lineno, f"{modules[node.value.id]}.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in functions and isinstance(node.ctx, ast.Load):
            yield node.lineno, ".".join(functions[node.id])


def test_python_private_names_only_in_their_one_module() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, module, name in private_uses(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names:
                if ALLOWED.get((top, name)) != rel:
                    found.append(f"{rel}:{line}: {module}.{name}")
            elif not rel.startswith("integrations/"):
                found.append(f"{rel}:{line}: {module}.{name} (a framework's private name outside integrations/)")
    assert found == []


def test_frames_are_walked_only_in_their_two_modules() -> None:
    found = []
    walkers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, what in frame_walks(path):
            if rel in FRAME_WALKERS:
                walkers.add(rel)
            else:
                found.append(f"{rel}:{line}: {what}")
    assert found == []
    assert walkers == FRAME_WALKERS  # each still walks frames (no stale entry)


def test_the_guard_sees_what_it_guards(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nimport pickle as p\nfrom threading import _shutdown\nsys._getframe(0)\np._Unpickler\n"
        "getattr(sys, '_current_frames')()\nhasattr(p, '_Stop')\ngetattr(sys, 'path')\n"
    )
    assert sorted(private_uses(probe)) == [
        (3, "threading", "_shutdown"),
        (4, "sys", "_getframe"),
        (5, "pickle", "_Unpickler"),
        (6, "sys", "_current_frames"),
        (7, "pickle", "_Stop"),
    ]
    walker = tmp_path / "walker.py"
    walker.write_text(
        "import inspect as i\nimport sys\nfrom inspect import stack as s\nf = i.currentframe()\nf.f_back\n"
        "f.f_locals\ns()\nsys._getframe(1)\nsys.path\n"
    )
    assert sorted(frame_walks(walker)) == [
        (3, "from inspect import stack"),
        (4, "inspect.currentframe"),
        (5, ".f_back"),
        (6, ".f_locals"),
        (7, "inspect.stack"),
        (8, "sys._getframe"),
    ]
    for (module, name), rel in ALLOWED.items():  # each allowed use is still there (no stale entry)
        assert (module, name) in {(m, n) for _, m, n in private_uses(PACKAGE / rel)}, (module, name, rel)
