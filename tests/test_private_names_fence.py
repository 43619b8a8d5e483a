"""Private names of Python and of the frameworks, fenced like torch's (``tests/test_private_torch_names.py``).

CPython's private interfaces can change in any release; each is used in exactly one module, named here, whose
docstring says why, so a new Python has one place to check per name:

- ``sys._current_frames``: ``objstore/deadline.py`` finds the socket a stuck request thread waits on;
- ``sys._getframe``: ``planners/sharing.py`` finds the torch ``_DistWrapper`` that runs a plan;
- ``pickle._Unpickler``/``pickle._Stop``: ``untrusted/metadata_pickle.py`` decodes ``.metadata`` opcodes with
  the pure-Python unpickler under its own allow-list.

A framework's private names (Accelerate's ``_fsdp_utils``, Megatron's and NeMo's helpers) appear only in that
framework's module under ``dcp_s3/integrations/``. The guard reads the code (``ast``): attributes of an imported
module and ``from module import _name``.
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
    ("sys", "_current_frames"): "objstore/deadline.py",
    ("sys", "_getframe"): "planners/sharing.py",
    ("pickle", "_Unpickler"): "untrusted/metadata_pickle.py",
    ("pickle", "_Stop"): "untrusted/metadata_pickle.py",
}


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


def test_the_guard_sees_what_it_guards(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nimport pickle as p\nfrom threading import _shutdown\nsys._getframe(0)\np._Unpickler\n"
    )
    assert sorted(private_uses(probe)) == [
        (3, "threading", "_shutdown"),
        (4, "sys", "_getframe"),
        (5, "pickle", "_Unpickler"),
    ]
    for (module, name), rel in ALLOWED.items():  # each allowed use is still there (no stale entry)
        assert (module, name) in {(m, n) for _, m, n in private_uses(PACKAGE / rel)}, (module, name, rel)
