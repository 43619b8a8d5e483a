"""Payload builders for the hostile-checkpoint tests: tamper with a real, saved checkpoint.

Payloads are built by saving a genuine checkpoint and then rewriting its stored objects
and ``.metadata`` the way an attacker with write access to the bucket (or directory)
would: CRCs are recomputed, so only dcp_s3's own checks stand in the way. No object
names are hard-coded: everything is found through the metadata.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import shlex
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch
from crc32c import crc32c
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from dcp_s3._dcp import open_store
from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._layout import METADATA_KEY

MiB = 1 << 20


class Call:
    """Pickles as ``func(*args)``: what a ``__reduce__`` payload looks like."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


class CallWith:
    """Like ``Call``, but with a given argument tuple: instances sharing one are pickled with memo references."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def touch(marker: Path) -> Call:
    """A payload that, if it ever runs, creates ``marker``."""
    return Call(os.system, f"touch {shlex.quote(str(marker))}")


def torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def read_metadata(uri: str) -> Metadata:
    """The checkpoint's metadata, unpickled without restriction (we wrote it: trusted here)."""
    md = pickle.loads(open_store(uri).read(METADATA_KEY))
    assert isinstance(md, Metadata)
    return md


def write_metadata(uri: str, md: Metadata | bytes) -> None:
    open_store(uri).write(METADATA_KEY, md if isinstance(md, bytes) else pickle.dumps(md))


def replace_items(uri: str, payload: bytes, pick: Callable[[str, Any], bool]) -> list[str]:
    """Point every item ``pick(fqn, entry)`` selects at ``payload``, appended to its data object.

    The item's length and CRC32C are rewritten to match, as an attacker would. Returns the
    fqns replaced.
    """
    store = open_store(uri)
    md = read_metadata(uri)
    bodies: dict[str, bytearray] = {}
    replaced = []
    for index, info in md.storage_data.items():
        if not pick(index.fqn, md.state_dict_metadata[index.fqn]):
            continue
        body = bodies.setdefault(info.relative_path, bytearray(store.read(info.relative_path)))
        info.offset, info.length = len(body), len(payload)
        body += payload
        if hasattr(info, "crc32c"):
            info.crc32c = crc32c(payload)
        replaced.append(index.fqn)
    for name, body in bodies.items():
        store.write(name, bytes(body))
    write_metadata(uri, md)
    return replaced


def replace_byte_items(uri: str, payload: bytes) -> list[str]:
    return replace_items(uri, payload, lambda fqn, m: isinstance(m, BytesStorageMetadata))


def root_causes(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's ``CheckpointException`` (or ``exc`` itself)."""
    if isinstance(exc, CheckpointException):
        return [e for e, _ in exc.failures.values()]
    return [exc]


def load_direct(uri: str, state: dict[str, Any], planner: Any = None, **reader_args: Any) -> None:
    """``dcp.load``'s steps on one process, without DCP's exception wrapping."""
    reader = S3StorageReader(uri, **reader_args)
    md = reader.read_metadata()
    planner = planner or DefaultLoadPlanner()
    planner.set_up_planner(state, md, True)
    reader.set_up_storage_reader(md, True)
    plan = planner.finish_plan(planner.create_global_plan([planner.create_local_plan()])[0])
    reader.read_data(plan, planner).wait()


class PeakRss:
    """Samples this process's RSS every few ms while active; ``growth`` is peak minus start."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.start = self.peak = 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    @contextmanager
    def watch(self) -> Iterator[PeakRss]:
        self.start = self.peak = self.proc.memory_info().rss
        thread = threading.Thread(target=self._poll, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


@contextmanager
def memory_cap(headroom: int) -> Iterator[None]:
    """At most ``headroom`` more address space (``RLIMIT_AS``) for the block, so that a regression fails with
    ``MemoryError`` instead of exhausting the machine; the limit before is restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def pickle_ops(*parts: bytes) -> bytes:
    """Concatenate raw pickle opcodes (protocol 2 header and STOP added)."""
    return b"\x80\x02" + b"".join(parts) + pickle.STOP


def global_op(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def unicode_op(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + len(data).to_bytes(4, "little") + data


def put_op(i: int) -> bytes:
    return pickle.LONG_BINPUT + i.to_bytes(4, "little")


def get_op(i: int) -> bytes:
    return pickle.LONG_BINGET + i.to_bytes(4, "little")


def int_op(n: int) -> bytes:
    return pickle.BININT + n.to_bytes(4, "little", signed=True)


_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_M64, _MOD = (1 << 64) - 1, (1 << 61) - 1


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def colliding_offsets(n: int) -> list[tuple[int, int]]:
    """``n`` distinct pairs of ints whose tuple hashes are equal (CPython's xxHash-based tuple hash)."""
    target = 0x1234_5678_9ABC_DEF0
    need = _rotl(target * pow(_P1, -1, 1 << 64) & _M64, 64 - 31)  # acc after lane 2, before the rotation
    out = []
    a = 0
    while len(out) < n:
        a += 1
        acc = _rotl((_P5 + a * _P2) & _M64, 31) * _P1 & _M64
        lane = (need - acc) * pow(_P2, -1, 1 << 64) & _M64  # the hash b must have
        b = lane if lane < _MOD else lane - (1 << 64) if lane > (1 << 64) - _MOD else None
        if b is not None and b not in (-1, -2):
            out.append((a, b))
    assert len({hash(p) for p in out}) == 1
    return out


def with_pickle(archive: bytes, patch: Callable[[bytes], bytes]) -> bytes:
    """A copy of a ``torch.save`` archive whose ``data.pkl`` is ``patch(data.pkl)`` (CRCs rewritten)."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info.filename, patch(data) if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()
