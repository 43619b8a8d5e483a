"""The restricted unpickler of ``.metadata``: builds DCP's metadata classes and nothing else.

A checkpoint's ``.metadata`` comes from whoever can write to the bucket, so its pickle is
run by an interpreter that admits only what DCP metadata is made of:

- globals: DCP's metadata dataclasses, dcp_s3's ``ItemLocation``/``FrameIndex``, torch
  dtypes (looked up in a table, never with ``getattr(torch, name)``, which can import
  modules), ``torch.Size``, layouts, paths, and the builtin containers — each by the name
  stored pickles give it, pinned in ``dcp_s3._untrusted.pinned_names`` (never a class's current ``__module__``,
  so moving a class leaves every written checkpoint readable);
- calls (REDUCE): only the few constructors the pickler emits, each with the argument
  types it emits; a dataclass instance is created without calling anything (NEWOBJ);
- state (BUILD): only on *instances* of the metadata classes, once each, with plain
  attribute names — never on a class or function, so a pickle cannot change a class for
  the rest of the process;
- dict keys and set elements: ``str``, small ``int`` or ``MetadataIndex``, whose hashes
  cost O(1) (a nested tuple as a key would take exponential time to hash), and at most
  a few keys per hash value (offsets can be chosen so that tuple hashes collide, which
  would make building the dict quadratic);
- no persistent ids, extension codes or out-of-band buffers.

Work that is not proportional to the pickle's own bytes (a constructor copying an
argument fetched from the memo, a state applied from the memo) is charged to a budget
proportional to the pickle's size; running out is a ``CheckpointFormatError``.

Python's own pure-Python unpickler (``pickle._Unpickler``) provides the opcode decoding;
this class replaces the entries of its dispatch table that create, call or mutate.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import pathlib
import pickle
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_s3._torch_compat import MEM_FORMAT_ENCODING, get_layout
from dcp_s3._untrusted.pinned_names import metadata_classes, pinned
from dcp_s3.errors import CheckpointFormatError, ConfigError

__all__ = ["unpickle_metadata", "budget_for", "describe", "MAX_INT_KEY", "MAX_NDIM"]

#: Work units allowed per byte of pickle (plus a floor), for constructor copies and walks.
BUDGET_PER_BYTE = 8
BUDGET_FLOOR = 1 << 16
#: Largest int allowed as a dict key / set element of untrusted input (here, in byte items and in
#: compact metadata): below the hash modulus, so such ints hash to themselves and never collide.
MAX_INT_KEY = (1 << 61) - 2
#: Most dimensions an offset in a ``MetadataIndex`` key may have (hashing it costs one step per dimension).
MAX_NDIM = 64
#: Most ``MetadataIndex`` keys with one hash value (distinct keys collide by chance with odds ~2^-64).
_MAX_SAME_HASH = 16


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def budget_for(size: int) -> int:
    """Work units a metadata pickle of ``size`` bytes may cost beyond decoding its opcodes."""
    return BUDGET_FLOOR + BUDGET_PER_BYTE * size


def describe(value: object) -> str:
    """A short description of an untrusted value for an error message (no deep repr)."""
    if isinstance(value, int) and not -(1 << 64) < value < 1 << 64:
        return "a large int"
    if isinstance(value, (int, float, str, bytes)) or value is None:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return f"{value.__module__}.{value.__qualname__}"
    return f"a {type(value).__name__}"


def _size_args(args: tuple[Any, ...]) -> int:
    _check_args(args, (tuple, list), 1, 1)
    for x in args[0]:
        if type(x) is not int:
            raise CheckpointFormatError("a torch.Size with a non-integer element")
    return len(args[0]) + 1


def _path_args(args: tuple[Any, ...]) -> int:
    _check_args(args, (str,), 0, 64)
    return sum(map(len, args)) + 1


def _sequence_args(args: tuple[Any, ...]) -> int:
    _check_args(args, (tuple, list), 0, 1)
    return len(args[0]) + 1 if args else 1


def _no_args(args: tuple[Any, ...]) -> int:
    _check_args(args, (), 0, 0)
    return 1


def _one(kind: type) -> Callable[[tuple[Any, ...]], int]:
    def check(args: tuple[Any, ...]) -> int:
        _check_args(args, (kind,), 1, 1)
        return 1

    return check


def _call_checks(keyed: Callable[[tuple[Any, ...]], int]) -> dict[Any, Callable[[tuple[Any, ...]], int]]:
    """The callables REDUCE may call, each with a check of its arguments returning their cost."""
    return {
        torch.Size: _size_args,
        get_layout: _one(str),
        MEM_FORMAT_ENCODING: _one(int),
        collections.OrderedDict: _no_args,
        pathlib.PosixPath: _path_args,
        pathlib.PurePosixPath: _path_args,
        set: keyed,
        frozenset: keyed,
        list: _sequence_args,
        tuple: _sequence_args,
        dict: _no_args,
    }


def _check_args(args: tuple[Any, ...], types: tuple[type, ...], lo: int, hi: int) -> None:
    if not lo <= len(args) <= hi:
        raise CheckpointFormatError(f"{len(args)} arguments")
    for a in args:
        if type(a) not in types:
            raise CheckpointFormatError(f"an argument of type {type(a).__name__}")


class _Unpickler(pickle._Unpickler):
    """See the module docstring."""

    #: Stored (module, name) -> global: pinned names, never a class's ``__module__`` (dcp_s3._untrusted.pinned_names).
    table: Mapping[tuple[str, str], Any]

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    # Set by pickle._Unpickler (not in typeshed).
    stack: list[Any]
    metastack: list[list[Any]]
    append: Callable[[Any], None]
    pop_mark: Callable[[], list[Any]]
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    _file_read: Callable[[int], bytes]
    _file_readline: Callable[[], bytes]
    proto: int

    def __init__(self, data: bytes, classes: tuple[type, ...]) -> None:
        super().__init__(io.BytesIO(data))
        self.table = pinned()
        self.budget = budget_for(len(data))
        self.built: dict[int, Any] = {}  # id -> instance (kept alive so that ids stay unique)
        for cls in classes:
            if cls not in self.table.values():
                raise ConfigError(
                    f"{describe(cls)} has no pinned stored name (add it to dcp_s3._untrusted.pinned_names._frozen)"
                )
        classes = (*metadata_classes(), *classes)
        # Looked up by id: hashing an untrusted stack object could itself be the attack.
        self.calls = {id(func): check for func, check in _call_checks(self._keyed_args).items()}
        self.hashes: dict[str, int] = {}  # MetadataIndex key hashes seen (as str: its hash is randomized)
        self.newobj = {id(cls): cls for cls in classes}

    def load(self) -> Any:
        """``pickle._Unpickler.load``, reading straight from the in-memory bytes.

        Frames (protocol 4+) only tell a streaming reader how much to buffer; the whole
        pickle is in memory, so FRAME is skipped instead of copying each frame.
        """
        self.read, self.readline = self._file_read, self._file_readline
        self.metastack, self.stack = [], []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def load_frame(self) -> None:
        if len(self.read(8)) != 8:
            raise EOFError

    def charge(self, units: int) -> None:
        self.budget -= units
        if self.budget < 0:
            raise CheckpointFormatError(
                "the pickle expands far beyond its size (shared references re-used by constructors)"
            )

    # -- globals ---------------------------------------------------------------------------------
    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # Python 2 names, renamed as pickle's own find_class does (fix_imports)
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        try:
            return self.table[(module, name)]
        except (KeyError, TypeError):
            raise CheckpointFormatError(f"refusing to load {module}.{name}: not a checkpoint metadata class") from None

    # -- dict keys and set elements ------------------------------------------------------------------
    def check_key(self, key: object) -> None:
        """Refuse a dict key / set element whose hash is costly or can be made to collide.

        ``str`` hashes are randomized per process; ints within the hash modulus hash to
        themselves. A ``MetadataIndex`` hashes its fqn and offset; offsets can be chosen so
        that their (unrandomized) tuple hashes collide, which would make every insertion
        scan all the others: more than a few keys with one hash are refused.
        """
        kind = type(key)
        if kind is str:
            return
        if kind is int and -MAX_INT_KEY <= key <= MAX_INT_KEY:  # type: ignore[operator]
            return
        if kind is MetadataIndex:
            fqn, offset = getattr(key, "fqn", None), getattr(key, "offset", None)
            if type(fqn) is not str or not (offset is None or (type(offset) is torch.Size and len(offset) <= MAX_NDIM)):
                raise CheckpointFormatError(
                    f"a MetadataIndex used as a key has fqn {describe(fqn)} and offset {describe(offset)}"
                )
            h = str(hash(key))
            seen = self.hashes[h] = self.hashes.get(h, 0) + 1
            if seen > _MAX_SAME_HASH:
                raise CheckpointFormatError(f"more than {_MAX_SAME_HASH} keys of {_short(fqn)} share one hash")
            return
        raise CheckpointFormatError(f"{describe(key)} used as a dict key or set element")

    def _keyed_args(self, args: tuple[Any, ...]) -> int:
        units = _sequence_args(args)
        for element in args[0] if args else ():
            self.check_key(element)
        return units

    # -- opcodes that call, create or mutate -------------------------------------------------------
    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        check = self.calls.get(id(func))
        if check is None or type(args) is not tuple:
            raise CheckpointFormatError(f"refusing to call {describe(func)} while loading metadata")
        try:
            cost = check(args)
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"{func.__module__}.{func.__qualname__}: {exc}") from None
        self.charge(cost)
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in self.newobj or args != ():
            raise CheckpointFormatError(f"refusing to create {describe(cls)} while loading metadata")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if id(cls) not in self.newobj:  # an instance of a metadata class; never a class or function
            raise CheckpointFormatError(f"refusing to set state on {describe(inst)} while loading metadata")
        if id(inst) in self.built:
            raise CheckpointFormatError(f"state set twice on one {cls.__name__}")
        self.built[id(inst)] = inst
        setstate = getattr(cls, "__setstate__", None)
        if setstate is not None:
            if type(state) is not tuple:
                raise CheckpointFormatError(f"{cls.__name__} state is {describe(state)}, not a tuple")
            self.charge(len(state))
            setstate(inst, state)
            return
        if type(state) is not dict:
            raise CheckpointFormatError(f"{cls.__name__} state is {describe(state)}, not a dict")
        for key in state:
            if type(key) is not str or key.startswith("__"):
                raise CheckpointFormatError(f"{cls.__name__} state sets attribute {describe(key)}")
        self.charge(len(state))
        inst.__dict__.update(state)

    def _target(self, kinds: tuple[type, ...], keys: Any) -> Any:
        target = self.stack[-1]
        if type(target) not in kinds:
            raise CheckpointFormatError(f"refusing to add items to {describe(target)}")
        for key in keys:
            if type(key) is not str:  # (the common case, inline)
                self.check_key(key)
        return target

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(_MAPPINGS, (key,))[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        keys = items[::2]
        self._target(_MAPPINGS, keys).update(zip(keys, items[1::2], strict=True))

    def load_dict(self) -> None:
        items = self.pop_mark()
        for key in items[::2]:
            self.check_key(key)
        self.append(dict(zip(items[::2], items[1::2], strict=True)))

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._target((set,), items).update(items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        for item in items:
            self.check_key(item)
        self.append(frozenset(items))

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target((list,), ()).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target((list,), ()).extend(items)


_MAPPINGS = (dict, collections.OrderedDict)


def _refuse(name: str) -> Callable[[Any], None]:
    def refuse(self: Any) -> None:
        raise CheckpointFormatError(f"pickle opcode {name} is not used by checkpoint metadata")

    return refuse


def _setup_dispatch() -> None:
    table = _Unpickler.dispatch
    ops = {
        pickle.REDUCE: _Unpickler.load_reduce,
        pickle.NEWOBJ: _Unpickler.load_newobj,
        pickle.BUILD: _Unpickler.load_build,
        pickle.SETITEM: _Unpickler.load_setitem,
        pickle.SETITEMS: _Unpickler.load_setitems,
        pickle.DICT: _Unpickler.load_dict,
        pickle.ADDITEMS: _Unpickler.load_additems,
        pickle.FROZENSET: _Unpickler.load_frozenset,
        pickle.FRAME: _Unpickler.load_frame,
        pickle.APPEND: _Unpickler.load_append,
        pickle.APPENDS: _Unpickler.load_appends,
    }
    for opcode, handler in ops.items():
        table[opcode[0]] = handler
    refused = (
        "NEWOBJ_EX",
        "OBJ",
        "INST",
        "PERSID",
        "BINPERSID",
        "EXT1",
        "EXT2",
        "EXT4",
        "BYTEARRAY8",
        "NEXT_BUFFER",
        "READONLY_BUFFER",
    )
    for name in refused:
        table[getattr(pickle, name)[0]] = _refuse(name)


_setup_dispatch()


def unpickle_metadata(data: bytes, classes: tuple[type, ...] = ()) -> Any:
    """Unpickle ``.metadata`` bytes under the rules above; ``CheckpointFormatError`` on any breach.

    ``classes``: further pinned classes (``pinned_names.pinned()``) that NEWOBJ/BUILD may create;
    dcp_s3's ``ItemLocation`` and ``FrameIndex`` are admitted anyway.
    Other failures (a truncated or garbled pickle) propagate as the unpickler raised them.
    """
    return _Unpickler(data, classes).load()
