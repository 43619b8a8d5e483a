"""Private torch names are used only in ``dcp_s3/_torch_compat.py``: a guard that reads the code.

The next torch release has one module to check. The guard parses every ``.py`` file under
``dcp_s3/`` (all subpackages) except the compat module, imports it to see what its names really
are, and reports, as ``path:line: what``:

a. imports of private torch names, in any form (``from torch.x import (a, _b)``,
   ``import torch._x``, ``from torch._x import y``, ``from torch import _x as y``);
b. private attributes (``_name``, not dunders) of an expression rooted at a name that is torch's:
   bound by an import from torch, or a module global whose value is a torch module, class,
   function or object (``dcp_version`` re-exported by the compat module is torch's ``_version``);
c. in every dcp_s3 class that subclasses a torch class (the real class, its MRO): methods and
   class attributes overriding a private member of a torch class in the MRO, and ``self._name``,
   ``super()._name`` where ``_name`` is a torch base's (defined on the class, or assigned as
   ``self._name`` in its source, which is parsed);
d. ``getattr``/``setattr``/``hasattr``/``delattr`` with a literal private name on the same objects.

dcp_s3's own private names (``self._session``, its ``_helper()`` functions) are not torch's and
are not reported. What it cannot see: private attributes of torch objects held in local variables
or attributes (``plan._x`` where ``plan`` is a parameter), and names built at run time.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import dcp_s3

pytestmark = pytest.mark.torch_range  # torch's own classes differ between releases

PACKAGE = Path(dcp_s3.__file__).parent
COMPAT = PACKAGE / "_torch_compat.py"
_ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


# -- the checker ---------------------------------------------------------------------------------------


def is_private(name: str) -> bool:
    """``_name`` or ``__name``, not ``__dunder__``."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_torch_module_name(name: object) -> bool:
    return isinstance(name, str) and (name == "torch" or name.startswith("torch."))


def is_torch_object(value: object) -> bool:
    """A torch module, or a class, function or object that torch defines."""
    if isinstance(value, types.ModuleType):
        return is_torch_module_name(value.__name__)
    try:
        module = value.__module__ if isinstance(value, type) else getattr(value, "__module__", None)
    except Exception:  # an object whose __getattr__ raises something else
        module = None
    if isinstance(module, str):
        return is_torch_module_name(module)
    return is_torch_module_name(type(value).__module__)


def torch_bound_names(tree: ast.Module, namespace: dict[str, Any] | None) -> set[str]:
    """Names that are torch's: bound by an import from torch (anywhere in the file), or module
    globals whose value is torch's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_torch_module_name(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_torch_module_name(node.module):
            names.update(alias.asname or alias.name for alias in node.names)
    if namespace is not None:
        names.update(k for k, v in namespace.items() if not k.startswith("__") and is_torch_object(v))
    return names


def root_name(node: ast.expr) -> str | None:
    """The name an expression such as ``a.b(c)[d].e`` starts from (``a``), or None."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node.id if isinstance(node, ast.Name) else None


def private_imports(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[int, str]]:
    """(line, what) for each private torch name the import binds or goes through (a private module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if is_torch_module_name(alias.name) and any(map(is_private, alias.name.split("."))):
                yield alias.lineno, f"import {alias.name}"
    elif node.level == 0 and is_torch_module_name(node.module):
        assert node.module is not None
        private_module = any(map(is_private, node.module.split(".")))
        for alias in node.names:
            if private_module or is_private(alias.name):
                yield alias.lineno, f"from {node.module} import {alias.name}"


@cache
def torch_private_members(klass: type) -> frozenset[str]:
    """Private names a torch class defines: its own (``vars``) and those its source assigns as
    ``self._name``. Class-private ``__name`` (mangled per class) are left out."""
    names = {n for n in vars(klass) if is_private(n)}
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # classes of torch._C have no Python source
        pass
    else:
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and is_private(node.attr)
            ):
                names.add(node.attr)
    return frozenset(n for n in names if not n.startswith("__"))


def torch_owner(klass: type, name: str) -> type | None:
    """The first torch class in ``klass``'s MRO that has the private member ``name``."""
    for base in klass.__mro__:
        if is_torch_module_name(base.__module__) and name in torch_private_members(base):
            return base
    return None


def _where(base: type) -> str:
    return f"{base.__module__}.{base.__qualname__}"


def _class_uses(node: ast.ClassDef, klass: type) -> Iterator[tuple[int, str]]:
    """Overrides of, and ``self``/``super()`` uses of, private members of ``klass``'s torch bases."""
    for item in node.body:
        targets: list[tuple[str, int]] = []
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            targets.append((item.name, item.lineno))
        elif isinstance(item, ast.Assign):
            targets.extend((t.id, t.lineno) for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            targets.append((item.target.id, item.lineno))
        for name, line in targets:
            owner = torch_owner(klass, name) if is_private(name) else None
            if owner is not None:
                yield line, f"{node.name}.{name} overrides {_where(owner)}.{name}"
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        arguments = item.args.posonlyargs + item.args.args
        selves = {"self", "cls"} | ({arguments[0].arg} if arguments else set())
        for sub in ast.walk(item):
            name = None
            if isinstance(sub, ast.Attribute) and is_private(sub.attr):
                value = sub.value
                is_self = isinstance(value, ast.Name) and value.id in selves
                is_super = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
                if is_self or is_super:
                    name, text = sub.attr, ast.unparse(sub)
            elif (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Name)
                and sub.func.id in _ATTR_FUNCTIONS
                and len(sub.args) >= 2
                and isinstance(sub.args[0], ast.Name)
                and sub.args[0].id in selves
                and isinstance(sub.args[1], ast.Constant)
                and isinstance(sub.args[1].value, str)
                and is_private(sub.args[1].value)
            ):
                name, text = sub.args[1].value, ast.unparse(sub)
            owner = torch_owner(klass, name) if name is not None else None
            if owner is not None:
                yield sub.lineno, f"{text} is {_where(owner)}.{name}"


def _classes(tree: ast.Module, namespace: dict[str, Any]) -> Iterator[tuple[ast.ClassDef, type]]:
    """The file's classes (top level, and nested in classes) with their class objects."""
    todo: list[tuple[list[ast.stmt], Any]] = [(tree.body, None)]
    while todo:
        body, outer = todo.pop()
        for node in body:
            if isinstance(node, ast.ClassDef):
                klass = namespace.get(node.name) if outer is None else getattr(outer, node.name, None)
                if isinstance(klass, type):
                    yield node, klass
                    todo.append((node.body, klass))


def torch_subclasses(source: str, namespace: dict[str, Any]) -> list[str]:
    """Names of the classes in ``source`` that subclass a torch class."""
    return [
        node.name
        for node, klass in _classes(ast.parse(source), namespace)
        if any(is_torch_module_name(base.__module__) for base in klass.__mro__[1:])
    ]


def private_torch_uses(source: str, filename: str, namespace: dict[str, Any] | None = None) -> list[str]:
    """Every use of a private torch name in ``source``, as ``filename:line: what``.

    ``namespace`` is the module's globals (after running it): it tells which globals are
    torch's and which classes subclass torch's (checks b and c). Without it only imports from
    torch count as torch's, and classes are not checked.
    """
    tree = ast.parse(source, filename)
    found: list[tuple[int, str]] = []
    torch_names = torch_bound_names(tree, namespace)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((line, f"imports {what}") for line, what in private_imports(node))
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and root_name(node) in torch_names:
            found.append((node.lineno, f"{ast.unparse(node)}: private attribute {node.attr} of torch's"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
            and root_name(node.args[0]) in torch_names
        ):
            found.append((node.lineno, f"{ast.unparse(node)}: private attribute {node.args[1].value} of torch's"))
    if namespace is not None:
        for node, klass in _classes(tree, namespace):
            if any(is_torch_module_name(base.__module__) for base in klass.__mro__[1:]):
                found.extend(_class_uses(node, klass))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def check_snippet(tmp_path: Path, source: str, name: str = "snippet") -> list[str]:
    """``private_torch_uses`` on ``source`` run as a module of its own."""
    source = textwrap.dedent(source)
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    namespace: dict[str, Any] = {"__name__": name}
    exec(compile(source, str(path), "exec"), namespace)
    return private_torch_uses(source, path.name, namespace)


def package_modules() -> Iterator[tuple[Path, str]]:
    """Every ``.py`` file under dcp_s3/ but the compat module, with its module name."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield path, ".".join(parts)


# -- the guard -----------------------------------------------------------------------------------------


#: The training frameworks dcp_s3.integrations modules import (optional: absent from the torch-range venvs): the
#: forbidden modules of pyproject's import-linter contract that keeps them in dcp_s3.integrations.
#: (Read without tomllib, which Python 3.10 lacks.)
_CONTRACT = (
    (PACKAGE.parent / "pyproject.toml")
    .read_text()
    .split('name = "Only dcp_s3.integrations imports a training framework"')[1]
)
FRAMEWORKS = set(re.findall(r'"([\w.]+)"', _CONTRACT.split("forbidden_modules = [")[1].split("]")[0]))


def _namespace(module_name: str) -> dict[str, Any] | None:
    """The module's globals, or None where its names are read from the source alone: ``__main__``
    (it runs the CLI when imported) and an integration whose framework is not installed here."""
    if module_name.endswith("__main__"):
        return None
    try:
        return vars(importlib.import_module(module_name))
    except ModuleNotFoundError as exc:
        if module_name.startswith("dcp_s3.integrations.") and (exc.name or "").split(".")[0] in FRAMEWORKS:
            return None
        raise


def test_private_torch_names_are_used_only_in_the_compat_module() -> None:
    offenders: list[str] = []
    subclasses: list[str] = []
    files = 0
    for path, module_name in package_modules():
        files += 1
        source = path.read_text()
        namespace = _namespace(module_name)
        offenders += private_torch_uses(source, str(path.relative_to(PACKAGE.parent)), namespace)
        if namespace is not None:
            subclasses += [f"{module_name}.{name}" for name in torch_subclasses(source, namespace)]
    assert files > 50, files  # every subpackage, not only the top level
    # the classes checked for overrides: the guard sees what they really subclass
    assert {"dcp_s3._planners.scale.ScalableSavePlanner", "dcp_s3._planners.load.ScalableLoadPlanner"} <= set(
        subclasses
    ), subclasses
    assert not offenders, "private torch names outside dcp_s3/_torch_compat.py:\n" + "\n".join(offenders)


# -- the checker catches each kind -----------------------------------------------------------------------


def test_multi_line_and_aliased_imports(tmp_path: Path) -> None:
    found = check_snippet(
        tmp_path,
        """
        import torch._utils
        import torch.distributed as dist
        from torch import _weights_only_unpickler as wou
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.metadata import (
            MetadataIndex,
            _MEM_FORMAT_ENCODING,
        )
        from torch.distributed.checkpoint.metadata import Metadata
        """,
    )
    assert found == [
        "snippet.py:2: imports import torch._utils",
        "snippet.py:4: imports from torch import _weights_only_unpickler",
        "snippet.py:5: imports from torch.distributed._shard._utils import narrow_tensor_by_index",
        "snippet.py:8: imports from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING",
    ]


def test_attribute_chains_rooted_at_torch(tmp_path: Path) -> None:
    found = check_snippet(
        tmp_path,
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint import metadata as md

        def f():
            torch._utils._element_size(torch.float32)
            dist.distributed_c10d._get_default_group()
            getattr(torch.serialization, "_get_layout")
            return md.Metadata(state_dict_metadata={})._private_field
        """,
    )
    assert found == [
        "snippet.py:7: torch._utils._element_size: private attribute _element_size of torch's",
        "snippet.py:7: torch._utils: private attribute _utils of torch's",
        "snippet.py:8: dist.distributed_c10d._get_default_group: private attribute _get_default_group of torch's",
        "snippet.py:9: getattr(torch.serialization, '_get_layout'): private attribute _get_layout of torch's",
        "snippet.py:10: md.Metadata(state_dict_metadata={})._private_field: private attribute _private_field "
        "of torch's",
    ]


def test_globals_that_are_torch_objects(tmp_path: Path) -> None:
    """A torch module under a public name of another module (``_torch_compat.dcp_version``) is still torch's."""
    found = check_snippet(
        tmp_path,
        """
        from dcp_s3._torch_compat import dcp_version

        def f():
            dcp_version._derived_version = "2_3"
        """,
    )
    assert found == ["snippet.py:5: dcp_version._derived_version: private attribute _derived_version of torch's"]


def test_overrides_and_private_attributes_of_a_torch_base(tmp_path: Path) -> None:
    found = check_snippet(
        tmp_path,
        """
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def set_up_planner(self, *args, **kwargs):
                super().set_up_planner(*args, **kwargs)
                self._cached_plans_key = "mine"

            def _create_global_plan(self, all_plans):
                return super()._create_global_plan(all_plans)

            def cached(self):
                return hasattr(self, "_cached_global_plan")

        class Deeper(Planner):
            def _create_global_plan_with_caching(self, all_plans):  # torch 2.7-2.15 have it
                return all_plans
        """,
    )
    base = "torch.distributed.checkpoint.default_planner.DefaultSavePlanner"
    saver = "torch.distributed.checkpoint.planner.SavePlanner"  # its class attribute, the cache itself
    assert found == [
        f"snippet.py:7: self._cached_plans_key is {base}._cached_plans_key",
        f"snippet.py:9: Planner._create_global_plan overrides {base}._create_global_plan",
        f"snippet.py:10: super()._create_global_plan is {base}._create_global_plan",
        f"snippet.py:13: hasattr(self, '_cached_global_plan') is {saver}._cached_global_plan",
        f"snippet.py:16: Deeper._create_global_plan_with_caching overrides {base}._create_global_plan_with_caching",
    ]


def test_own_private_names_are_not_reported(tmp_path: Path) -> None:
    found = check_snippet(
        tmp_path,
        """
        import torch
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        _CACHE = {}

        def _helper(x):
            return x._items  # a local: not known to be torch's

        class Session:
            def __init__(self):
                self._session = None
                self.__mangled = 1

            def _own(self):
                return getattr(self, "_session"), _CACHE, torch.__version__, torch.Tensor.__init__

        class Planner(DefaultSavePlanner):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self._group_key = "mine"  # not a name of torch's planners

            def _mine(self):
                return self._group_key, self.__class__
        """,
    )
    assert found == []


def test_without_a_namespace_imports_still_count(tmp_path: Path) -> None:
    """Static checks (imports, chains rooted at imported names) need no import of the module."""
    source = "import torch\nx = torch._C\n"
    assert private_torch_uses(source, "s.py") == ["s.py:2: torch._C: private attribute _C of torch's"]


def test_is_private() -> None:
    assert is_private("_x") and is_private("__x") and not is_private("__init__") and not is_private("x")
