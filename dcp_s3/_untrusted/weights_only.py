"""A symbolic check that ``torch.load`` of a ``torch.save`` archive does only what weights-only loading allows.

:func:`byte_item_problem` locates the pickle exactly as ``torch.load`` does (torch's own
zip reader), then interprets its opcodes symbolically under the rules of torch's
weights-only unpickler — the same opcode set; globals only from torch's weights-only
allowlist, including classes registered with ``torch.serialization.add_safe_globals``;
calls and object creation only of those globals; state only on objects created so, never
on a class — while calling nothing. A pickle that passes makes ``torch.load`` perform
only operations weights-only loading allows. On top, the work such a load would do is
bounded by the pickle's size: shared references re-used by constructors, a
self-referencing value, ``bytearray(<int>)``, dict keys chosen to share one hash and
storages larger than their records are refused. The interpretation models CPython's C
unpickler (what ``torch.load(weights_only=False)`` runs): memo indices must be dense (it
keeps the memo in an array as long as the largest index), and of torch's allowlist only the
calls ``torch.save``'s pickles make, with the arguments the pickler emits, are allowed
(:mod:`dcp_s3._untrusted.weights_only_calls`: no punycode, no allocation no stored byte backs, no
sparse or nested tensors). Legacy (non-zip) files, TorchScript archives and raw bytes are
refused too.

Torch's private allowlist and zip reader come from ``dcp_s3._torch_compat``.
"""

from __future__ import annotations

import _compat_pickle
import functools
import pickle
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from dcp_s3._torch_compat import (
    REBUILD_PREFIX,
    element_size,
    record_size,
    torch_zip_reader,
    weights_only_allowed_globals,
    weights_only_blocklisted_modules,
    weights_only_user_allowed_globals,
)
from dcp_s3._untrusted.metadata_pickle import MAX_INT_KEY, budget_for, describe
from dcp_s3._untrusted.weights_only_calls import (
    EXTRA_GLOBALS,
    MAX_SAME_HASH,
    Global,
    Node,
    Refused,
    check_call,
    check_state,
    is_bytes,
    label,
    real,
)

__all__ = ["byte_item_problem"]

_ZIP_MAGIC = b"PK\x03\x04"  # what torch.serialization._is_zipfile compares


def _leaf_weight(value: object) -> int:
    return 1 + len(value) if isinstance(value, (str, bytes)) else 1


def _weight(root: object, cap: int) -> int:
    """How many objects ``root`` expands to as a tree (saturating above ``cap``); a cycle is refused."""
    if not isinstance(root, Node):
        return _leaf_weight(root)
    done: dict[int, int] = {}
    open_: set[int] = set()
    stack = [root]
    while stack:
        node = stack[-1]
        key = id(node)
        if key in done:
            stack.pop()
        elif key not in open_:
            open_.add(key)
            for child in node.items:
                if isinstance(child, Node) and id(child) not in done:
                    if id(child) in open_:
                        raise Refused("it holds a value that contains itself")
                    stack.append(child)
        else:
            total = 1 + sum(done[id(c)] if isinstance(c, Node) else _leaf_weight(c) for c in node.items)
            done[key] = min(total, cap + 1)
            open_.discard(key)
            stack.pop()
    return done[id(root)]


def _canonical(full: str, obj: Any) -> tuple[str, str]:
    """The (module, name) a pickle names ``obj`` by (what the unpickler's find_class resolves)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and f"{module}.{qualname}" == full:
        return module, qualname
    return full.rpartition(".")[0], full.rpartition(".")[2]


def _table(allowlist: dict[str, Any]) -> dict[tuple[str, str], Any]:
    blocked = weights_only_blocklisted_modules()
    return {_canonical(full, obj): obj for full, obj in allowlist.items() if full.partition(".")[0] not in blocked}


@functools.cache
def _torch_allowlist() -> dict[tuple[str, str], Any]:
    return _table(weights_only_allowed_globals())


@functools.cache
def _torch_ids() -> frozenset[int]:
    return frozenset(id(obj) for obj in _torch_allowlist().values())


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """Torch's weights-only allowlist, ``io.BytesIO`` and what the user registered with ``add_safe_globals``."""
    user = weights_only_user_allowed_globals()
    return {**_torch_allowlist(), **EXTRA_GLOBALS, **(_table(user) if user else {})}


class _Checker:
    """Interprets a protocol-2 pickle symbolically under torch's weights-only rules."""

    def __init__(self, data: bytes, record_size: Callable[[str], int]) -> None:
        self.data, self.pos, self.proto = data, 0, 0
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.budget = budget_for(len(data))
        self.keys: dict[int, tuple[Node, dict[str, int]]] = {}  # per dict: hashes of its keys
        self.record_size = record_size
        self.allowed = _allowed_globals()

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise Refused("the pickle is truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def readline(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise Refused("the pickle is truncated")
        line = self.data[self.pos : end].decode("utf-8")
        self.pos = end + 1
        return line

    def charge(self, value: object) -> None:
        self.budget -= _weight(value, self.budget)
        if self.budget < 0:
            raise Refused("it expands far beyond its size (shared references re-used by constructors)")

    def pop_mark(self) -> list[Any]:
        items = self.stack
        if not self.metastack:
            raise Refused("the pickle is malformed (no MARK)")
        self.stack = self.metastack.pop()
        return items

    def callee(self, value: object, what: str) -> Global:
        if not isinstance(value, Global):
            raise Refused(f"it would {what} {describe(value)}, which weights-only loading does not allow")
        return value

    def run(self) -> object:
        ops = _OPS
        while True:
            op = self.read(1)[0]
            handler = ops.get(op)
            if handler is None:
                raise Refused(f"it uses pickle opcode {op:#04x}, which weights-only loading does not allow")
            result = handler(self)
            if result is not None:
                return result[0]

    # -- opcode handlers; a handler returns (value,) at STOP ----------------------------------------------
    def op_global(self) -> None:
        module, name = self.readline(), self.readline()
        # The unpickler renames Python 2 names (fix_imports) below protocol 3, as torch.save's pickles need.
        renamed = _compat_pickle.NAME_MAPPING.get((module, name))
        if renamed is None and module in _compat_pickle.IMPORT_MAPPING:
            renamed = (_compat_pickle.IMPORT_MAPPING[module], name)
        if renamed is not None:
            if self.proto >= 3:
                raise Refused(f"it would load {module}.{name}, which weights-only loading does not allow")
            module, name = renamed
        obj = self.allowed.get((module, name))
        if obj is None:
            raise Refused(f"it would load {module}.{name}, which weights-only loading does not allow")
        self.stack.append(Global(f"{module}.{name}", obj))

    def op_reduce(self) -> None:
        args = self.stack.pop()
        func = self.callee(self.stack[-1], "call")
        if not isinstance(args, Node) or args.kind != "tuple":
            raise Refused(f"the arguments of {func.name} are not a tuple")
        check_call(func, args, _torch_ids(), self.key)
        self.charge(args)
        self.stack[-1] = Node("call", [args], func)

    def op_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.callee(self.stack.pop(), "create")
        if not isinstance(args, Node) or args.kind != "tuple":
            raise Refused(f"the arguments of {cls.name} are not a tuple")
        check_call(cls, args, _torch_ids(), self.key)
        self.charge(args)
        self.stack.append(Node("call", [args], cls))

    def op_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if not isinstance(inst, Node) or inst.kind != "call" or inst.callee is None:
            raise Refused(f"it would set state on {label(inst)}, which weights-only loading does not allow")
        # Weights-only loading sets a plain tensor's state with set_(*state); torch.load's
        # Tensor.__setstate__ does the same only for a 4-tuple (else it sets hooks).
        name = inst.callee.name
        if (
            (inst.callee.obj is torch.Tensor or name.startswith(REBUILD_PREFIX))
            and "parameter" not in name
            and not (isinstance(state, Node) and state.kind == "tuple" and len(state.items) == 4)
        ):
            raise Refused(f"it would set the state of the result of {name} other than with set_")
        check_state(inst, state)
        self.charge(state)
        inst.items.append(state)

    def key(self, key: object, seen: dict[str, int]) -> None:
        """A dict key or set element (``seen``: hashes counted so far in that container).

        Hashing a key costs its size. str and bytes hashes are randomized per process and
        small ints hash to themselves; other keys (large ints, floats, tuples) can be chosen
        to share one hash, which makes every insertion scan the others: more than a few keys
        of one container with one hash are refused.
        """
        self.charge(key)
        if (
            isinstance(key, (str, bytes, Global))
            or key is None
            or is_bytes(key)
            or (isinstance(key, int) and type(key) in (int, bool) and -MAX_INT_KEY <= key <= MAX_INT_KEY)
        ):
            return
        h = str(hash(real(key)))
        seen[h] = seen.get(h, 0) + 1
        if seen[h] > MAX_SAME_HASH:
            raise Refused(f"more than {MAX_SAME_HASH} keys of one of its dicts or sets share one hash")

    def op_persid(self) -> None:
        pid = self.stack.pop()
        items = pid.items if isinstance(pid, Node) and pid.kind == "tuple" else None
        if not items or len(items) != 5 or items[0] != "storage":
            raise Refused("it holds a persistent id that is not a storage")
        storage_type, key, location, numel = items[1:]
        if not (
            isinstance(storage_type, Global)
            and "Storage" in storage_type.name
            and type(key) is str
            and type(location) is str
            and type(numel) is int
            and numel >= 0
        ):
            raise Refused("it holds a malformed storage reference")
        try:  # how torch.load reads the storage type's name
            dtype = torch.serialization.StorageType(storage_type.name.rpartition(".")[2]).dtype
        except KeyError:  # UntypedStorage: bytes
            dtype = torch.uint8
        elem = element_size(dtype)
        try:
            size = self.record_size(f"data/{key}")
        except Exception:
            raise Refused(f"it refers to storage {describe(key)}, which the archive lacks") from None
        if numel * elem > size:
            raise Refused(f"storage {describe(key)} claims {numel * elem} bytes, its record holds {size}")
        self.stack.append(Node("storage", [numel]))

    def op_setitems(self, items: list[Any]) -> None:
        target = self.stack[-1]
        if not (
            isinstance(target, Node)
            and (
                target.kind == "dict"
                or (target.kind == "call" and target.callee is not None and target.callee.obj in (OrderedDict, Counter))
            )
        ):
            raise Refused(f"it would set items on {label(target)}")
        seen = self.keys.setdefault(id(target), (target, {}))[1]  # (target kept alive: its id stays unique)
        for key in items[::2]:
            self.key(key, seen)
        target.items.extend(items)

    def op_appends(self, items: list[Any]) -> None:
        target = self.stack[-1]
        if not isinstance(target, Node) or target.kind != "list":
            raise Refused(f"it would append to {label(target)}")
        target.items.extend(items)


def _tuple(n: int) -> Callable[[_Checker], None]:
    def build(c: _Checker) -> None:
        if len(c.stack) < n:
            raise Refused("the pickle is malformed (stack underflow)")
        items = c.stack[len(c.stack) - n :]
        del c.stack[len(c.stack) - n :]
        c.stack.append(Node("tuple", items))

    return build


def _tuple_mark(c: _Checker) -> None:
    items = c.pop_mark()  # (replaces c.stack: read it after)
    c.stack.append(Node("tuple", items))


def _push(make: Callable[[_Checker], Any]) -> Callable[[_Checker], None]:
    return lambda c: c.stack.append(make(c))


def _mark(c: _Checker) -> None:
    c.metastack.append(c.stack)
    c.stack = []


def _put(c: _Checker, index: int) -> None:
    """The pickler numbers memo entries 0, 1, 2...; CPython's unpickler keeps the memo in an array
    it grows to twice the largest index: an index past the entries so far is refused (a crafted
    ``LONG_BINPUT 2**31`` would cost GiBs), re-using an index is allowed."""
    if not c.stack:
        raise Refused("the pickle is malformed (PUT on an empty stack)")
    if index > len(c.memo):
        raise Refused(
            f"it stores memo entry {index} after only {len(c.memo)} entries (the pickler numbers them "
            "0, 1, 2...; the unpickler would allocate memory for every index up to it)"
        )
    c.memo[index] = c.stack[-1]


def _get(c: _Checker, index: int) -> None:
    if index not in c.memo:
        raise Refused("the pickle is malformed (unknown memo entry)")
    c.stack.append(c.memo[index])


def _stop(c: _Checker) -> tuple[Any]:
    value = c.stack.pop()
    c.charge(value)  # the whole value, as a consumer walking it would see it
    return (value,)


_u = struct.Struct("<I")
_OPS: dict[int, Callable[[_Checker], Any]] = {
    pickle.PROTO[0]: lambda c: setattr(c, "proto", c.read(1)[0]),
    pickle.STOP[0]: _stop,
    pickle.GLOBAL[0]: _Checker.op_global,
    pickle.REDUCE[0]: _Checker.op_reduce,
    pickle.NEWOBJ[0]: _Checker.op_newobj,
    pickle.BUILD[0]: _Checker.op_build,
    pickle.BINPERSID[0]: _Checker.op_persid,
    pickle.APPEND[0]: lambda c: c.op_appends([c.stack.pop()]),
    pickle.APPENDS[0]: lambda c: c.op_appends(c.pop_mark()),
    pickle.SETITEM[0]: lambda c: c.op_setitems([c.stack.pop(-2), c.stack.pop()]),
    pickle.SETITEMS[0]: lambda c: c.op_setitems(c.pop_mark()),
    pickle.MARK[0]: _mark,
    pickle.TUPLE[0]: _tuple_mark,
    pickle.TUPLE1[0]: _tuple(1),
    pickle.TUPLE2[0]: _tuple(2),
    pickle.TUPLE3[0]: _tuple(3),
    pickle.EMPTY_TUPLE[0]: _push(lambda c: Node("tuple")),
    pickle.EMPTY_LIST[0]: _push(lambda c: Node("list")),
    pickle.EMPTY_DICT[0]: _push(lambda c: Node("dict")),
    pickle.EMPTY_SET[0]: _push(lambda c: Node("set")),
    pickle.NONE[0]: _push(lambda c: None),
    pickle.NEWFALSE[0]: _push(lambda c: False),
    pickle.NEWTRUE[0]: _push(lambda c: True),
    pickle.BININT[0]: _push(lambda c: struct.unpack("<i", c.read(4))[0]),
    pickle.BININT1[0]: _push(lambda c: c.read(1)[0]),
    pickle.BININT2[0]: _push(lambda c: struct.unpack("<H", c.read(2))[0]),
    pickle.BINFLOAT[0]: _push(lambda c: struct.unpack(">d", c.read(8))[0]),
    pickle.LONG1[0]: _push(lambda c: int.from_bytes(c.read(c.read(1)[0]), "little", signed=True)),
    pickle.BINUNICODE[0]: _push(lambda c: c.read(_u.unpack(c.read(4))[0]).decode("utf-8", "surrogatepass")),
    pickle.SHORT_BINSTRING[0]: _push(lambda c: c.read(c.read(1)[0]).decode("utf-8")),
    pickle.BINGET[0]: lambda c: _get(c, c.read(1)[0]),
    pickle.LONG_BINGET[0]: lambda c: _get(c, _u.unpack(c.read(4))[0]),
    pickle.BINPUT[0]: lambda c: _put(c, c.read(1)[0]),
    pickle.LONG_BINPUT[0]: lambda c: _put(c, _u.unpack(c.read(4))[0]),
}


def byte_item_problem(data: bytes | bytearray | memoryview) -> str | None:
    """Why ``torch.load(data, weights_only=False)`` could do more than weights-only loading allows, or None."""
    blob = bytes(data)
    if blob[:4] != _ZIP_MAGIC:
        return "it is not a torch.save zip archive (a legacy or raw byte item)"
    try:
        # torch's own zip reader, so that the pickle checked is the one torch.load would run.
        archive = torch_zip_reader(blob)
        if "constants.pkl" in archive.get_all_records():  # what torch.serialization._is_torchscript_zip checks
            return "it is a TorchScript archive (torch.load would run torch.jit.load)"
        pkl = archive.get_record("data.pkl")
    except RuntimeError as exc:
        return f"it is not a readable torch.save archive ({describe(str(exc))})"
    try:
        _Checker(pkl, record_size(archive)).run()
    except Refused as exc:
        return str(exc)
    except (IndexError, UnicodeDecodeError, struct.error):
        return "its pickle is malformed"
    return None
