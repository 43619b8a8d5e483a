"""What the byte-item checker (:mod:`dcp_s3._untrusted.weights_only`) lets a pickle call, and at what cost.

Torch's weights-only allowlist says which globals a pickle may *name*; CPython's unpickler
then calls them with whatever arguments the pickle gives. Several allowed calls cost far more
than the bytes that ask for them: ``_codecs.encode(s, "punycode")`` is quadratic in ``s``,
``torch.UntypedStorage(n)``, ``torch.FloatTensor(n)`` and ``_rebuild_qtensor`` allocate
``n`` elements no stored byte backs, and a sparse or nested tensor is rebuilt without torch's
invariant checks (out-of-range indices crash the process on first use). So, of torch's
allowlist, only what ``torch.save``'s pickles call may be called, each with the arguments
the pickler emits (:func:`check_call`); classes you register with ``add_safe_globals`` are
yours to vouch for and may be called as before.

Beyond torch's allowlist, one standard class is allowed: ``io.BytesIO`` (torch's own DCP tests keep
a train state's ``losses`` in one, and torch's planner pickles it). Rebuilding one runs no code and
costs its stored bytes: it is created empty and its state set, exactly as the pickler emits it
(:data:`EXTRA_GLOBALS`, :func:`check_state`); ``bytes()`` with no argument is allowed for the empty
bytes that protocol 2 pickles as that call.
"""

from __future__ import annotations

import _codecs
import functools
import io
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from dcp_s3._torch_compat import REBUILD_FROM_TYPE_V2, REBUILD_PREFIX, get_layout, rebuild_functions
from dcp_s3._untrusted.metadata_pickle import describe

__all__ = [
    "Refused",
    "Global",
    "Node",
    "label",
    "is_bytes",
    "bytes_size",
    "real",
    "check_call",
    "check_state",
    "MAX_SAME_HASH",
    "EXTRA_GLOBALS",
]

#: Globals allowed beyond torch's weights-only allowlist, each with the calls and state :func:`check_call`
#: and :func:`check_state` accept for it.
EXTRA_GLOBALS: dict[tuple[str, str], Any] = {("_io", "BytesIO"): io.BytesIO, ("builtins", "bytes"): bytes}


class Refused(Exception):
    """Why an item is refused (internal; becomes a message)."""


class Global:
    __slots__ = ("name", "obj")

    def __init__(self, name: str, obj: Any) -> None:
        self.name, self.obj = name, obj


class Node:
    """A value the pickle would build: a container, a call's result or a storage (``items``: its numel)."""

    __slots__ = ("kind", "items", "callee")

    def __init__(self, kind: str, items: list[Any] | None = None, callee: Global | None = None) -> None:
        self.kind, self.items, self.callee = kind, items if items is not None else [], callee


#: Most dict keys / set elements with one hash value in one byte item.
MAX_SAME_HASH = 16


def label(value: object) -> str:
    if isinstance(value, Global):
        return value.name
    if isinstance(value, Node):
        return f"the result of {value.callee.name}" if value.callee is not None else f"a {value.kind}"
    return describe(value)


def is_bytes(value: object) -> bool:
    """Protocol 2 pickles bytes as a call of ``_codecs.encode`` (empty bytes: of ``bytes``)."""
    return isinstance(value, Node) and value.callee is not None and value.callee.obj in (_codecs.encode, bytes)


def bytes_size(value: Node) -> int:
    """The size of the bytes an :func:`is_bytes` node makes (``_codecs.encode(<str>, "latin1")``: one a character)."""
    return len(value.items[0].items[0]) if value.callee is not None and value.callee.obj is _codecs.encode else 0


def real(key: object, depth: int = 0) -> object:
    """The value a hashable symbolic key stands for (tuples of atoms); refuses anything else."""
    if isinstance(key, Node):
        if is_bytes(key):  # bytes hash randomized per process, like str
            return object()
        if key.kind != "tuple":
            raise Refused(f"it uses {label(key)} as a dict key or set element")
        if depth > 16:
            raise Refused("it uses a tuple nested more than 16 deep as a dict key or set element")
        return tuple(real(item, depth + 1) for item in key.items)
    if isinstance(key, Global):
        return key.name
    return key


#: Rebuild functions of plain dense tensors: views of a stored storage (checked by :func:`_view`).
_VIEW_NAMES = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3")
#: The others ``torch.save``'s pickles call that cost what their stored bytes do. Not: storage and
#: tensor classes (``torch.ByteTensor(n)`` allocates n bytes), ``_rebuild_qtensor`` (likewise),
#: sparse and nested tensors (rebuilt without checking their indices).
_CALLABLE_NAMES = (
    "_rebuild_parameter",
    "_rebuild_parameter_with_state",
    "_rebuild_meta_tensor_no_storage",
    "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_cpu_tensor",
    "_rebuild_from_type_v2",
)
_UNCHECKED = ("_rebuild_sparse_tensor", "_rebuild_sparse_csr", "_rebuild_nested_tensor")


@functools.cache
def _views() -> tuple[Any, ...]:
    functions = rebuild_functions()
    return tuple(functions[name] for name in _VIEW_NAMES if name in functions)


@functools.cache
def _unchecked() -> tuple[Any, ...]:
    functions = rebuild_functions()
    return tuple(functions[name] for name in _UNCHECKED if name in functions)


@functools.cache
def _callable_ids() -> frozenset[int]:
    """What ``torch.save``'s pickles call among torch's allowlist (by identity)."""
    functions = rebuild_functions()
    allowed: list[Any] = [
        OrderedDict,
        Counter,
        set,
        bytearray,
        complex,
        _codecs.encode,
        torch.Size,
        torch.device,
        get_layout,
        *_views(),
        *(functions[n] for n in _CALLABLE_NAMES if n in functions),
    ]
    return frozenset(id(obj) for obj in allowed)


def _ints(node: object) -> list[int] | None:
    if isinstance(node, Node) and node.kind == "tuple" and all(type(v) is int for v in node.items):
        return node.items
    return None


def _view(func: Global, args: list[Any]) -> None:
    """A tensor rebuilt over a storage may not have more elements than the storage holds
    (a stride-0 view of one element can claim 2^60, which any later copy materializes)."""
    storage = args[0] if args else None
    sizes = _ints(args[2]) if len(args) > 2 else None
    if not (isinstance(storage, Node) and storage.kind == "storage") or sizes is None:
        raise Refused(f"it would call {func.name} with arguments torch.save does not emit")
    have = max(1, storage.items[0])
    if 0 in sizes:
        return
    n = 1
    for s in sizes:
        n *= s
        if s < 0 or n > have:
            raise Refused(
                f"it would rebuild a tensor of size {list(sizes[:8])} over a storage of "
                f"{storage.items[0]} elements (a view larger than its stored bytes)"
            )


def check_call(
    func: Global, args: Node, torch_ids: frozenset[int], key: Callable[[object, dict[str, int]], None]
) -> None:
    """Refuse calling (or creating) ``func`` with ``args`` unless it costs what its stored bytes do.

    ``torch_ids``: ids of torch's allowlisted objects; ``key(value, seen)`` checks one dict key or set element.
    """
    obj, items = func.obj, args.items
    if id(obj) in torch_ids and id(obj) not in _callable_ids():
        if any(obj is f for f in _unchecked()):
            raise Refused(
                f"it would call {func.name}: torch rebuilds sparse and nested tensors without checking "
                "their indices (out-of-range ones crash the process on first use)"
            )
        raise Refused(
            f"it would call {func.name}, which can allocate or cost more than its stored bytes "
            "(dcp_s3 allows only the calls torch.save's pickles of dense values make)"
        )
    if obj is bytearray and not (not items or (len(items) == 1 and is_bytes(items[0]))):
        raise Refused(
            "it would call bytearray with arguments other than bytes (bytearray(<int>) allocates, "
            "bytearray(str, encoding) decodes at any cost)"
        )
    if obj is _codecs.encode and not (len(items) == 2 and type(items[0]) is str and items[1] == "latin1"):
        encoding = describe(items[1] if len(items) > 1 else None)
        raise Refused(
            f"it would call _codecs.encode with encoding {encoding}: only latin1 (what the pickler "
            "emits for bytes) is linear in its input"
        )
    if obj in (set, Counter, OrderedDict) and items:  # they hash what they are given
        source = items[0]
        seen: dict[str, int] = {}
        if isinstance(source, Node) and source.kind in ("list", "tuple"):
            for element in source.items:
                pair = isinstance(element, Node) and element.kind == "tuple" and len(element.items) == 2
                key(element.items[0] if obj is OrderedDict and pair else element, seen)
        elif not (isinstance(source, Node) and source.kind == "dict"):  # a dict's keys were checked
            raise Refused(f"it would build a {func.name} from {label(source)}")
    if obj in (io.BytesIO, bytes) and items:
        raise Refused(f"it would call {func.name} with arguments (torch.save's pickles call it without)")
    if any(obj is v for v in _views()):
        _view(func, items)
    if func.name == REBUILD_FROM_TYPE_V2 and not (
        items and isinstance(items[0], Global) and items[0].name.startswith(REBUILD_PREFIX)
    ):
        raise Refused("it would rebuild a tensor subclass through something other than a tensor rebuild function")


def check_state(inst: Node, state: object) -> None:
    """Refuse setting ``state`` on ``inst`` (a created object) where its class is one of :data:`EXTRA_GLOBALS`
    and ``state`` is not what the pickler emits for it: for ``io.BytesIO`` ``(bytes, position, None or dict)``,
    the position within the bytes."""
    if inst.callee is None or inst.callee.obj is not io.BytesIO:
        return
    items = state.items if isinstance(state, Node) and state.kind == "tuple" else None
    if not (
        items is not None
        and len(items) == 3
        and is_bytes(items[0])
        and type(items[1]) is int
        and (items[2] is None or (isinstance(items[2], Node) and items[2].kind == "dict"))
    ):
        raise Refused(f"it would set the state of _io.BytesIO to {label(state)}, not (bytes, position, None or dict)")
    size = bytes_size(items[0])
    if not 0 <= items[1] <= size:
        raise Refused(f"it would set an _io.BytesIO of {size} bytes to position {items[1]}")
