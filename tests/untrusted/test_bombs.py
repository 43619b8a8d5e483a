"""Decompression, unpickler and allocation bombs (issue 20, items 4-6 and 8): hand-made hostile
payloads in real checkpoints on a real directory, each loaded in a child process under
``RLIMIT_AS`` with a timeout; the child reports what was raised, its peak RSS and seconds.

Each payload is refused with ``CheckpointFormatError`` and a bounded peak RSS; legitimate
items of the same kinds still load bit-exact. (No time asserts: the timeouts are hang guards.)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from hostile import (
    MiB,
    global_op,
    int_op,
    pickle_ops,
    read_metadata,
    replace_items,
    root_causes,
    torch_saved,
    unicode_op,
    with_pickle,
    write_metadata,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata

import dcp_s3
from dcp_s3 import CheckpointFormatError, S3StorageReader, S3StorageWriter
from dcp_s3._untrusted.byte_items import byte_item_problem
from dcp_s3.admin import convert_checkpoint

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

ROOT = Path(__file__).resolve().parents[2]
#: Address space the child may map beyond what it holds once torch and dcp_s3 are imported (a CUDA
#: build of torch maps far more than a CPU one, so the limit is set after the imports); every bomb
#: here asks for more.
HEADROOM = 1024 * MiB
#: Peak RSS a refused payload may add to the child (generous: the byte-item bound is 64 MiB).
GROWTH = 256 * MiB

_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    import psutil, torch
    from bomb_child import blank_load
    import dcp_s3._dcp.reader, dcp_s3._untrusted.foreign_items, dcp_s3._untrusted.weights_only  # noqa: F401  (mapped before the limit)
    limit = psutil.Process().memory_info().vms + int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start = psutil.Process().memory_info().rss
    t0 = time.monotonic()
    try:
        blank_load(sys.argv[2], json.loads(sys.argv[3]))
        outcome, message = "loaded", ""
    except BaseException as exc:
        outcome, message = type(exc).__name__, str(exc)[:500]
    seconds = time.monotonic() - t0
    # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, inherited across fork)
    status = open("/proc/self/status").read().split("VmHWM:")[1]
    peak = int(status.split()[0]) * 1024
    print(json.dumps({"outcome": outcome, "message": message, "seconds": seconds, "start": start, "peak": peak}))
    """
)


def run_child(ckpt: Path, state: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Load ``ckpt`` into the blank ``state`` (tensor shapes as lists, see ``bomb_child``) in a child."""
    code = Path(dcp_s3.__file__).resolve().parents[1]  # the child runs the dcp_s3 this process imported
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(code), str(ROOT / "tests"), str(ROOT / "tests" / "untrusted")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(HEADROOM), str(ckpt), json.dumps(state)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["growth"] = report["peak"] - report["start"]
    print(f"{ckpt.name}: {report}")  # the figures for the note (pytest -s)
    return report


def refused(report: dict[str, Any], match: str) -> None:
    assert report["outcome"] == "CheckpointFormatError", report
    assert match in report["message"], report
    assert report["growth"] < GROWTH, report


def zstd_of_zeros(n: int) -> bytes:
    """One zstd frame (as torch's ``ZStandard`` writes) decompressing to ``n`` zero bytes, made in 1 MiB steps."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as w:
        piece = bytes(MiB)
        for _ in range(n // MiB):
            w.write(piece)
    return out.getvalue()


SHAPES = {"w": [64, 16], "cfg": {"lr": None, "betas": None}}


def torch_zstd_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by torch's own writer with its ZStandard transform (tensor and byte items)."""
    sd = {"w": torch.arange(1024.0).reshape(64, 16), "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}}
    dcp.save(sd, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]), no_dist=True)
    return sd


def test_legitimate_torch_zstd_items_still_load_bit_exact(tmp_path: Path) -> None:
    sd = torch_zstd_checkpoint(tmp_path / "ck")
    out = {"w": torch.zeros(64, 16), "cfg": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp.load(out, storage_reader=S3StorageReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["cfg"] == sd["cfg"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", ["tensor", "byte"])
def test_zstd_bomb_behind_torch_transform_is_refused_within_its_bound(tmp_path: Path, target: str) -> None:
    """32 KiB of stored zstd that decompresses to 1 GiB, in place of a tensor chunk or a byte item."""
    ckpt = tmp_path / f"zbomb-{target}"
    torch_zstd_checkpoint(ckpt)
    bomb = zstd_of_zeros(1024 * MiB)
    assert len(bomb) < 64 << 10
    byte = target == "byte"
    assert replace_items(str(ckpt), bomb, lambda fqn, m: isinstance(m, BytesStorageMetadata) == byte)
    refused(run_child(ckpt, SHAPES), "gives more than the")


def _byte_item_checkpoint(path: Path, payload: bytes) -> None:
    dcp.save({"w": torch.ones(4), "cfg": {"lr": 0.1}}, storage_writer=S3StorageWriter(path), no_dist=True)
    assert replace_items(str(path), payload, lambda fqn, m: isinstance(m, BytesStorageMetadata))


def _archive(pkl: bytes) -> bytes:
    """A genuine ``torch.save`` archive whose pickle is ``pkl``."""
    return with_pickle(torch_saved(1), lambda _: pkl)


_MEMO = pickle_ops(pickle.BININT1 + b"\x01", pickle.LONG_BINPUT + (1 << 26).to_bytes(4, "little"))
#: 8,000 distinct non-ASCII characters: punycode encodes them in ~10 s (quadratic).
_PUNY = pickle_ops(
    global_op("_codecs", "encode"),
    unicode_op("".join(chr(0x100 + i) for i in range(8000))),
    unicode_op("punycode"),
    pickle.TUPLE2,
    pickle.REDUCE,
)
_STORAGE = pickle_ops(
    global_op("torch", "ByteTensor"),
    pickle.BININT + ((1 << 31) - 1).to_bytes(4, "little"),
    pickle.TUPLE1,
    pickle.REDUCE,
)


def _sparse_out_of_range() -> bytes:
    indices = torch.tensor([[0, 1 << 40], [0, 1 << 40]])  # (2^40, 2^40) in a 4 x 4 tensor: coalesce() segfaults
    bad = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (4, 4), check_invariants=False)
    return torch_saved({"x": bad})


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("name", "make", "match"),
    [
        ("memo", lambda: _archive(_MEMO), "memo entry 67108864 after only 0 entries"),
        ("punycode", lambda: _archive(_PUNY), "encoding 'punycode': only latin1"),
        ("tensor-class", lambda: _archive(_STORAGE), "torch.ByteTensor"),
        ("sparse", _sparse_out_of_range, "_rebuild_sparse_tensor"),
    ],
)
def test_byte_item_bombs_the_c_unpickler_would_run_are_refused(
    tmp_path: Path, name: str, make: Any, match: str
) -> None:
    """Payloads weights-only rules allow but whose cost is not linear in their size: a LONG_BINPUT
    of index 2^26 (CPython's memo array: 1 GiB), punycode (quadratic), ``torch.ByteTensor(2^31)``
    (2 GiB no byte backs), a sparse tensor whose indices lie outside it (segfault on first use)."""
    ckpt = tmp_path / name
    _byte_item_checkpoint(ckpt, make())
    refused(run_child(ckpt, {"w": [4], "cfg": {"lr": None}}), match)


def _bytes_io(*state: bytes, args: bytes = pickle.EMPTY_TUPLE) -> bytes:
    """A pickle creating ``_io.BytesIO`` (with ``args``) and setting ``state`` (opcodes building a tuple)."""
    return pickle_ops(global_op("_io", "BytesIO"), args, pickle.NEWOBJ, *state, pickle.BUILD)


_LATIN1 = (global_op("_codecs", "encode"), unicode_op("hello"), unicode_op("latin1"), pickle.TUPLE2, pickle.REDUCE)


def test_bytesio_loads_as_torch_save_writes_it_and_nothing_else() -> None:
    """torch's own DCP tests keep ``losses`` in an ``io.BytesIO``: what torch.save writes for one passes; a
    BytesIO called with arguments, a position past its bytes, other state or a forbidden global in its state
    dict is refused."""
    for value in (io.BytesIO(b"hello"), io.BytesIO(), {"losses": io.BytesIO(torch.randn(4).numpy().tobytes())}):
        assert byte_item_problem(torch_saved(value)) is None, value
    at = io.BytesIO(b"hello")
    at.seek(5)
    assert byte_item_problem(torch_saved(at)) is None
    refusals = {
        "with arguments": _bytes_io(pickle.NONE, args=int_op(1 << 30) + pickle.TUPLE1),
        "to position 6": _bytes_io(*_LATIN1, int_op(6), pickle.NONE, pickle.TUPLE3),
        "not (bytes, position": _bytes_io(int_op(1 << 30), pickle.TUPLE1),
        "posix.system": _bytes_io(
            *_LATIN1,
            int_op(0),
            pickle.EMPTY_DICT,
            unicode_op("x"),
            global_op("posix", "system"),
            pickle.SETITEM,
            pickle.TUPLE3,
        ),
    }
    for match, pkl in refusals.items():
        assert match in str(byte_item_problem(_archive(pkl))), match


def test_checker_refuses_other_uncosted_calls_and_passes_what_torch_save_writes() -> None:
    view = torch.zeros(1).expand(1 << 20)  # a stride-0 view: 1 stored element claiming 2^20
    assert "over a storage of 1 elements" in str(byte_item_problem(torch_saved(view)))
    for call in (global_op("torch.storage", "UntypedStorage"), global_op("torch._utils", "_rebuild_qtensor")):
        pkl = pickle_ops(call, pickle.BININT + (1 << 30).to_bytes(4, "little"), pickle.TUPLE1, pickle.REDUCE)
        assert "which can allocate" in str(byte_item_problem(_archive(pkl)))
    puny = pickle_ops(
        global_op("builtins", "bytearray"), unicode_op("x"), unicode_op("punycode"), pickle.TUPLE2, pickle.REDUCE
    )
    assert "bytearray" in str(byte_item_problem(_archive(puny)))
    put_again = pickle_ops(
        pickle.BININT1 + b"\x01", pickle.BINPUT + b"\x00", pickle.BINPUT + b"\x00", pickle.BINPUT + b"\x01"
    )
    assert byte_item_problem(_archive(put_again)) is None  # dense indices, re-used: what a pickler may write
    groups = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict()["param_groups"]
    for value in (
        groups,
        b"bytes",
        bytearray(b"ba"),
        bytearray(),
        {1, 2},
        complex(1, 2),
        torch.Size([2]),
        torch.device("cpu"),
        torch.ones(4)[1:3],
        torch.ones(2, 3).t(),
        torch.nn.Parameter(torch.ones(2)),
    ):
        assert byte_item_problem(torch_saved(value)) is None, value


def test_convert_refuses_metadata_whose_chunks_do_not_cover_the_tensor(tmp_path: Path) -> None:
    """An empty (or partial) chunk list used to give convert a torch.empty tensor it never filled:
    the output held leftover heap bytes, at any size the metadata claimed."""
    ckpt = tmp_path / "ck"
    dcp.save({"w": torch.ones(8, 4)}, storage_writer=S3StorageWriter(ckpt), no_dist=True)
    md = read_metadata(str(ckpt))
    tensor = md.state_dict_metadata["w"]
    entries = dict(md.storage_data)
    for chunks, match in (
        ([], "cover 0 of its 32 elements"),
        ([ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))] * 2, "overlap"),
    ):
        tensor.chunks = chunks  # (with the storage entries of the chunks kept, none for an empty list)
        md.storage_data = {k: v for k, v in entries.items() if any(c.offsets == k.offset for c in chunks)}
        write_metadata(str(ckpt), md)
        with pytest.raises(BaseException) as info:
            convert_checkpoint(str(ckpt), str(tmp_path / "out.pt"))
        causes = root_causes(info.value)
        assert causes and all(isinstance(c, CheckpointFormatError) and match in str(c) for c in causes), causes
        assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("table", ["codecs", "objects", "transforms"])
def test_compact_metadata_with_an_empty_table_is_a_format_error(table: str) -> None:
    """An empty codecs table used to raise IndexError when the first compressed entry was built."""
    from dcp_s3._metadata.formats import load_metadata
    from tests.metadata.test_metadata_compact_hostile import WHERE, genuine, join

    header, arrays = genuine()
    section = header["storage"]["frames"] if table == "codecs" else header["storage"]
    section[table] = []
    with pytest.raises(CheckpointFormatError, match="out of range|outside") as info:
        dict(load_metadata(join(header, arrays), WHERE).storage_data.items())
    assert str(info.value).startswith(WHERE)


def _zstd_raw_frame(payload: bytes, window_log: int) -> bytes:
    """A zstd frame holding ``payload`` in raw blocks whose header asks for a window of 2^``window_log``."""
    out = bytearray((0xFD2FB528).to_bytes(4, "little") + bytes([0x00, (window_log - 10) << 3]))
    blocks = [payload[i : i + (1 << 17)] for i in range(0, len(payload), 1 << 17)] or [b""]
    for i, block in enumerate(blocks):
        out += (int(i == len(blocks) - 1) | len(block) << 3).to_bytes(3, "little") + block
    return bytes(out)


def test_stream_zstd_frame_asking_for_a_huge_window_is_refused(tmp_path: Path) -> None:
    """The decoder's own scratch is bounded too: a frame may ask for at most a 64 MiB window
    (torch's writer uses zstd's defaults: 2 MiB at level 3). The same bytes with an 8 MiB window load."""
    sd = torch_zstd_checkpoint(tmp_path / "ck")
    chunk = torch_saved(sd["w"])
    for window_log, ok in ((23, True), (27, False)):
        replace_items(str(tmp_path / "ck"), _zstd_raw_frame(chunk, window_log), lambda fqn, m: fqn == "w")
        out = {"w": torch.zeros(64, 16), "cfg": {"lr": 0.0, "betas": (0.0, 0.0)}}
        if ok:
            dcp.load(out, storage_reader=S3StorageReader(tmp_path / "ck"), no_dist=True)
            assert torch.equal(out["w"], sd["w"])
        else:
            with pytest.raises(BaseException) as info:
                dcp.load(out, storage_reader=S3StorageReader(tmp_path / "ck"), no_dist=True)
            causes = root_causes(info.value)
            assert causes and all(isinstance(c, CheckpointFormatError) and "cannot undo" in str(c) for c in causes)


def test_step_markers_and_load_object_are_checked_like_byte_items(tmp_path: Path) -> None:
    """A step marker (``<step>.pth``, which a re-saved step's load follows) and ``load_object`` go
    through the byte-item checker before ``torch.load(weights_only=True)``: punycode, which torch's
    weights-only rules allow (12-23 s for this marker before), and a memo bomb are refused at once."""
    from dcp_s3 import Checkpointer, load_object

    run = tmp_path / "run"
    net = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(run)
    ckpt.save({"m": net}, iteration=5)
    marker = run / "0000005.pth"
    for payload, match in (
        (_archive(_PUNY), "encoding 'punycode': only latin1"),
        (_archive(_MEMO), "memo entry 67108864 after only 0 entries"),
    ):
        marker.write_bytes(payload)
        with pytest.raises(CheckpointFormatError, match=match):
            Checkpointer(run).load({"m": net}, path=run / "0000005")
        with pytest.warns(RuntimeWarning, match=match):  # the newest step: not resumed from, and why
            assert Checkpointer(run).load({"m": net}) == 0
        with pytest.raises(CheckpointFormatError, match=match):
            load_object(marker)


def test_verify_never_loads_a_marker_the_checker_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dcp-s3 verify`` reads a step's marker to check its parts; a refused marker is never handed to
    ``torch.load`` (which would run the punycode encoding, ~10 s here, or grow the memo array)."""
    from dcp_s3 import Checkpointer
    from dcp_s3.admin._verify import verify_checkpoint

    run = tmp_path / "run"
    Checkpointer(run).save({"m": torch.nn.Linear(2, 2)}, iteration=5)
    payload = _archive(_PUNY)
    (run / "0000005.pth").write_bytes(payload)
    loaded: list[bytes] = []
    real_load = torch.load

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, io.BytesIO):
            loaded.append(f.getvalue())
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    verify_checkpoint(str(run))
    assert payload not in loaded
