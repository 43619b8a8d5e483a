"""One exception hierarchy: library code raises dcp_s3.errors classes, never a bare builtin.

Every module of the package is parsed (``ast``) and each ``raise`` of a builtin exception class
(``raise ValueError(...)``, ``raise RuntimeError``) is reported with its file and line. Allowed:
re-raises (``raise``, ``raise exc``), ``NotImplementedError`` (abstract or unused methods),
``AttributeError`` from a module's ``__getattr__`` (the import protocol), and the protocol
signals listed in ``PROTOCOL``.
"""

from __future__ import annotations

import ast
import builtins
import pickle
from pathlib import Path

import pytest

import dcp_s3
from dcp_s3 import errors

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

PACKAGE = Path(__file__).resolve().parents[1] / "dcp_s3"  # the tree these tests belong to
# Errors only: SystemExit and KeyboardInterrupt are control flow (a CLI exits with SystemExit).
BUILTIN_EXCEPTIONS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, Exception)
}
ALWAYS_ALLOWED = {"NotImplementedError"}
#: (module, exception): a builtin that a protocol requires, not an error of ours.
PROTOCOL = {
    ("_untrusted/metadata_pickle.py", "EOFError"),  # the restricted unpickler's end-of-data signal, as pickle's own
    ("testing/__init__.py", "ImportError"),  # dcp_s3.testing without pytest: an import that cannot succeed
    # Fabric's load(strict=True) contract: a requested key the checkpoint lacks is a KeyError, as Lightning raises
    ("integrations/lightning_fabric.py", "KeyError"),
}
# What Python's data model requires these methods to raise (a module's __getattr__, a lazy
# Sequence's or Mapping's __getitem__).
DUNDER_PROTOCOL = {("AttributeError", "__getattr__"), ("IndexError", "__getitem__"), ("KeyError", "__getitem__")}


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name


def builtin_raises(path: Path) -> list[tuple[int, str]]:
    """(line, exception name) of each ``raise`` of a builtin exception class in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if (
                    isinstance(exc, ast.Name)
                    and exc.id in BUILTIN_EXCEPTIONS
                    and (exc.id, function) not in DUNDER_PROTOCOL
                ):
                    found.append((child.lineno, exc.id))
            visit(child, inner)

    visit(tree, "")
    return [
        (line, name) for line, name in found if name not in ALWAYS_ALLOWED and (_relative(path), name) not in PROTOCOL
    ]


def test_library_code_raises_only_dcp_s3_errors() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20 and PACKAGE / "errors.py" in modules  # the package, not an empty glob
    bad = [f"{p.relative_to(PACKAGE)}:{line}: raise {name}" for p in modules for line, name in builtin_raises(p)]
    assert not bad, "raise a dcp_s3.errors class instead:\n" + "\n".join(bad)


def test_the_check_finds_a_bare_builtin(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('bad')\n"
        "    try:\n"
        "        pass\n"
        "    except OSError as exc:\n"
        "        raise exc\n"
        "    raise RuntimeError\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(name)\n"
        "def g():\n"
        "    raise NotImplementedError\n"
        "def h():\n"
        "    raise AttributeError('not in __getattr__')\n"
    )
    assert builtin_raises(sample) == [(3, "ValueError"), (8, "RuntimeError"), (14, "AttributeError")]


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_a_picklable_dcp_s3_error(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.DcpS3Error)
    assert getattr(dcp_s3, name) is cls  # exported from the package root too
    exc = cls("s3://bucket/key: why")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc)


def test_argument_errors_are_typed_and_name_the_argument(tmp_path: Path) -> None:
    from torch import nn

    from dcp_s3._checkpointer import Checkpointer
    from dcp_s3._codec import Codec
    from dcp_s3._planners import frozen_parameter_fqns

    ckpt = Checkpointer(tmp_path / "run")
    model = nn.Linear(2, 2)
    with pytest.raises(errors.InvalidTypeError, match=r"model_dict\['m'\] is a str") as info:
        ckpt.save({"m": "not a module"})  # type: ignore[dict-item]
    assert isinstance(info.value, TypeError)
    with pytest.raises(errors.ConfigError, match=r"model_dict key 'a\.b'") as bad_key:
        ckpt.save({"a.b": model})
    assert isinstance(bad_key.value, ValueError)
    with pytest.raises(errors.ConfigError, match=r"optimizer_dict keys \['x'\]"):
        ckpt.save({"m": model}, {"x": None})  # type: ignore[dict-item]
    with pytest.raises(errors.InvalidTypeError, match=r"scheduler_dict\['m'\]: cannot save a object"):
        ckpt.save({"m": model}, scheduler_dict={"m": object()})
    assert not list((tmp_path / "run").glob("*.pth"))  # checked before anything is written
    with pytest.raises(errors.InvalidTypeError, match="key 'enc'"):
        frozen_parameter_fqns({"enc": 3})  # type: ignore[dict-item]
    with pytest.raises(errors.ConfigError, match=r"Codec\(threads=0"):
        Codec(threads=0)
    with Codec() as codec, pytest.raises(errors.InvalidTypeError, match="encode: data must be buffers"):
        codec.encode([1, 2], 4, True, lambda _: None)  # type: ignore[list-item]
