"""The class names stored in ``.metadata`` pickles are pinned (dcp_s3/_untrusted/pinned_names.py).

Every checkpoint written so far names ``dcp_s3.layout.ItemLocation`` and (compressed items)
``dcp_s3.codec.FrameIndex`` by module path. These tests fail when a refactor would make such a
checkpoint unreadable: by today's restricted unpickler, by torch's plain-pickle reader, or by
writing new pickles under names that are not pinned.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._codec import FrameIndex
from dcp_s3._layout import ItemLocation
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._untrusted.metadata_pickle import unpickle_metadata
from dcp_s3._untrusted.pinned_names import DCP_S3_NAMES, pinned
from dcp_s3.errors import CheckpointFormatError

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

GOLDEN = Path(__file__).resolve().parent / "golden"
#: A compressed checkpoint written by 0.2.0: its .metadata names both dcp_s3 classes.
GOLDEN_ZSTD = GOLDEN / "0.2.0" / "s3" / "golden" / "ckpt" / "zstd"

KEEP = (
    "Existing checkpoints store this name. Keep `{0}` importable at that path (a re-export: "
    "torch's FileSystemReader unpickles .metadata with plain pickle, which imports it) and keep "
    "its entry in dcp_s3/_untrusted/pinned_names.py."
)


def pickled_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) of every GLOBAL / STACK_GLOBAL in a pickle, read with pickletools (no unpickling)."""
    found: set[tuple[str, str]] = set()
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # what each pushing opcode put on the stack (strings kept, others None)
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1]
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = pushed[-1]
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo[int(arg)])
        elif op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.add((module, name))
            pushed.append(None)
        elif op.name == "STACK_GLOBAL":
            found.add((pushed[-2], pushed[-1]))
            pushed.append(None)
        elif op.stack_after:
            pushed.append(None)
    return found


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "step": 3,
        "groups": [{"lr": 0.1}],
    }


def _save(path: Path, **options: Any) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=S3StorageWriter(str(path), metadata_format="dcp", **options))
    return (path / ".metadata").read_bytes()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_todays_pickles_name_exactly_the_pinned_paths(tmp_path: Path, compression: str | None) -> None:
    """(a) A real .metadata written today names only pinned globals, dcp_s3's by the frozen paths."""
    data = _save(tmp_path / "ck", compression=compression)
    names = pickled_globals(data)
    # pickletools' reading agrees with what an unpickler is asked for.
    asked: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            asked.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    assert names == asked
    unpinned = sorted(f"{m}.{n}" for m, n in names - set(pinned()))
    assert not unpinned, (
        f"today's .metadata pickles name {unpinned}, which dcp_s3/_untrusted/pinned_names.py does not pin: "
        "checkpoints written now would not load. Keep the class's __module__ at its pinned path "
        "(assign it after moving the class) or add the new name to pinned_names._frozen()."
    )
    ours = {n for n in names if n[0].split(".")[0] == "dcp_s3"}
    want = set(DCP_S3_NAMES) if compression else {("dcp_s3.layout", "ItemLocation")}
    assert ours == want, (
        f"today's .metadata names dcp_s3 classes {sorted(ours)}; every released checkpoint names {sorted(want)}. "
        "Keep ItemLocation.__module__ == 'dcp_s3.layout' and FrameIndex.__module__ == 'dcp_s3.codec'."
    )


def test_the_dcp_s3_names_are_frozen() -> None:
    """The names 0.1.0 and 0.2.0 wrote (tests/golden) are pinned to today's classes."""
    assert DCP_S3_NAMES == (("dcp_s3.layout", "ItemLocation"), ("dcp_s3.codec", "FrameIndex"))
    assert pinned()[("dcp_s3.layout", "ItemLocation")] is ItemLocation
    assert pinned()[("dcp_s3.codec", "FrameIndex")] is FrameIndex
    stored = set()
    for path in GOLDEN.rglob(".metadata"):
        data = path.read_bytes()
        if data[:1] == b"\x80":  # a pickle (compact ones have no class names)
            stored |= pickled_globals(data)
    assert {n for n in stored if n[0].startswith("dcp_s3")} == set(DCP_S3_NAMES)
    assert stored <= set(pinned()), sorted(stored - set(pinned()))


def _stack_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle of just STACK_GLOBAL module name (how today's pickler names a class)."""

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    return b"\x80\x04" + text(module) + text(name) + b"\x93."


def _plain_pickle_global(module: str, name: str) -> Any:
    """What plain ``pickle`` (torch's FileSystemReader) resolves a stored GLOBAL to."""
    return pickle.loads(b"c" + module.encode() + b"\n" + name.encode() + b"\n.")


@pytest.mark.parametrize("key", sorted(pinned(), key=str), ids=lambda k: f"{k[0]}.{k[1]}")
def test_every_pinned_path_resolves_with_plain_pickle(key: tuple[str, str]) -> None:
    """(b) Each pinned path imports and resolves, through plain pickle, to the very object the table holds."""
    module, name = key
    if module == "pathlib._local" and sys.version_info < (3, 13):
        pytest.skip("pathlib._local exists from Python 3.13 (pinned for pickles written there)")
    try:
        got = _plain_pickle_global(module, name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{module}.{name} no longer resolves with plain pickle ({exc}). " + KEEP.format(name))
    assert got is pinned()[key], f"{module}.{name} resolves to {got!r}, not {pinned()[key]!r}. " + KEEP.format(name)


def test_restricted_unpickler_uses_the_table_not_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """(c) Moving the classes (their __module__ changes, the old module is gone) leaves old checkpoints readable."""
    data = (GOLDEN_ZSTD / ".metadata").read_bytes()
    assert set(DCP_S3_NAMES) <= pickled_globals(data)
    monkeypatch.setattr(ItemLocation, "__module__", "dcp_s3.formats.layout")
    monkeypatch.setattr(FrameIndex, "__module__", "dcp_s3.formats.codec")
    metadata = load_metadata(data, "golden 0.2.0 zstd/.metadata")
    kinds = {type(info) for info in metadata.storage_data.values()}
    assert kinds == {ItemLocation}
    assert any(isinstance(getattr(info, "frames", None), FrameIndex) for info in metadata.storage_data.values())
    # The table does not follow __module__: the moved class's new path is not a stored name.
    for module in ("dcp_s3.formats.codec", "dcp_s3.formats.layout"):
        name = "FrameIndex" if module.endswith("codec") else "ItemLocation"
        for stored in (_stack_global(module, name), f"c{module}\n{name}\n.".encode()):
            with pytest.raises(CheckpointFormatError, match=f"{module}.{name}"):
                unpickle_metadata(stored)
    # Nor does it import: with the old module unimportable, plain pickle fails but the restricted one loads.
    monkeypatch.setitem(sys.modules, "dcp_s3.codec", None)
    with pytest.raises(ImportError):
        pickle.loads(data)
    assert unpickle_metadata(data).storage_data.keys() == metadata.storage_data.keys()


def test_moved_classes_still_load_a_golden_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole load of 0.2.0's compressed checkpoint with both classes "moved" is bit-exact."""
    import shutil

    sys.path.insert(0, str(GOLDEN))
    try:
        import golden_state
    finally:
        sys.path.remove(str(GOLDEN))
    shutil.copytree(GOLDEN_ZSTD, tmp_path / "ck")
    monkeypatch.setattr(ItemLocation, "__module__", "dcp_s3.formats.layout")
    monkeypatch.setattr(FrameIndex, "__module__", "dcp_s3.formats.codec")
    target = golden_state.placeholder(golden_state.plain_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=S3StorageReader(str(tmp_path / "ck")))
    golden_state.assert_same(target, golden_state.plain_state())


def test_an_extra_class_must_be_pinned() -> None:
    """A caller cannot admit a class by its __module__: extra classes must have a pinned stored name."""
    from dataclasses import dataclass

    from dcp_s3.errors import ConfigError

    @dataclass
    class Unpinned:
        x: int = 0

    data = (GOLDEN_ZSTD / ".metadata").read_bytes()
    with pytest.raises(ConfigError, match="Unpinned"):
        unpickle_metadata(data, (Unpinned,))
    assert unpickle_metadata(data, (ItemLocation,)).storage_data
