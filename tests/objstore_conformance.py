"""The object-store interface (``dcp_s3.objstore.ObjectStore``) as every backend must honour it.

``ObjectStoreConformance`` holds the tests; a subclass provides the ``objstore`` fixture (a
backend on a fresh container: a directory, or a new bucket). The DCP-level suite
(``tests/conformance.py``) then checks what users build on it; this one checks the interface
itself, with the same expectations on every backend: same results, same error classes.
Subclasses: ``tests/test_conformance.py`` (local disk, SeaweedFS, moto).
"""

from __future__ import annotations

import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from dcp_s3.buffers import BufferPool
from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError
from dcp_s3.objstore import ObjectStore, RangeRead

__all__ = ["ObjectStoreConformance"]

MiB = 1 << 20


def _into(buf: bytearray, lo: int, hi: int) -> Any:
    return lambda: memoryview(buf)[lo:hi]


class ObjectStoreConformance:
    """Subclasses define ``objstore`` (a fixture returning an empty :class:`ObjectStore`)."""

    @pytest.fixture
    def pool(self) -> ThreadPoolExecutor:
        with ThreadPoolExecutor(4) as ex:
            yield ex  # type: ignore[misc]

    def test_put_get_head_and_etags(self, objstore: ObjectStore) -> None:
        assert objstore.head("a/b.bin") is None
        with pytest.raises(CheckpointNotFoundError, match="b.bin"):
            objstore.get("a/b.bin")
        etag = objstore.put("a/b.bin", b"one")
        info = objstore.head("a/b.bin")
        assert info is not None and info.key == "a/b.bin" and info.size == 3 and objstore.get("a/b.bin") == b"one"
        assert etag and info.etag == etag  # SeaweedFS, moto and disk all report one
        assert objstore.put("a/b.bin", b"two!") != etag
        assert objstore.get("a/b.bin") == b"two!" and objstore.head("a/b.bin").size == 4  # type: ignore[union-attr]

    def test_conditional_put_refuses_an_existing_key(self, objstore: ObjectStore) -> None:
        assert objstore.conditional_writes_supported("probe-1")
        assert objstore.head("probe-1") is None  # the probe leaves nothing
        objstore.put("x/.metadata", b"first", if_none_match=True)
        with pytest.raises(CheckpointExistsError) as info:
            objstore.put("x/.metadata", b"second", if_none_match=True)
        pickle.loads(pickle.dumps(info.value))  # crosses ranks intact
        assert objstore.get("x/.metadata") == b"first"
        assert sorted(o.key for o in objstore.list_objects("x/")) == ["x/.metadata"]  # no temporary left

    def test_ranged_reads_fill_caller_memory(self, objstore: ObjectStore, pool: ThreadPoolExecutor) -> None:
        data = os.urandom(3 * MiB + 17)
        objstore.put("r/obj", data)
        out = bytearray(len(data))
        done: list[int] = []
        cuts = [0, 100, 5000, MiB, 2 * MiB + 3, len(data)]
        reads = [
            RangeRead("r/obj", lo, hi, _into(out, lo, hi), (lambda lo=lo: done.append(lo)))  # type: ignore[misc]
            for lo, hi in zip(cuts, cuts[1:])
        ]
        objstore.read_ranges(reads, executor=pool, max_gap=64, max_size=MiB)
        assert out == data and sorted(done) == cuts[:-1]

    def test_reading_past_the_end_is_a_format_error(self, objstore: ObjectStore, pool: ThreadPoolExecutor) -> None:
        objstore.put("short", b"x" * 100)
        opened: list[int] = []

        def open_() -> memoryview:
            opened.append(1)
            return memoryview(bytearray(100))

        for lo, hi in ((50, 150), (100, 200), (300, 400)):
            with pytest.raises(CheckpointFormatError, match="short"):
                objstore.read_ranges([RangeRead("short", lo, hi, open_)], executor=pool, max_gap=0, max_size=MiB)
        assert not opened  # refused before any destination memory was handed out
        with pytest.raises(CheckpointNotFoundError, match="missing"):
            objstore.read_ranges([RangeRead("missing", 0, 1, open_)], executor=pool, max_gap=0, max_size=MiB)

    def test_streamed_writer_round_trip_and_abort(self, objstore: ObjectStore, pool: ThreadPoolExecutor) -> None:
        data = os.urandom(11 * MiB + 5)
        buffers = BufferPool(3, 5 * MiB)
        writer = objstore.open_writer("w/big", pool=buffers, executor=pool, expected_size=len(data))
        for i in range(0, len(data), 999_999):  # writes that straddle part boundaries
            writer.write(data[i : i + 999_999])
            assert objstore.head("w/big") is None  # nothing visible before close
        assert writer.tell() == len(data) and writer.close() == len(data)
        assert objstore.get("w/big") == data
        assert buffers.peak_bytes <= buffers.count * writer.part_size
        gone = objstore.open_writer("w/gone", pool=buffers, executor=pool)
        gone.write(os.urandom(7 * MiB))
        gone.abort()
        assert [o.key for o in objstore.list_objects("w/")] == ["w/big"]
        assert objstore.list_uploads("w/") == []  # an aborted upload leaves no parts behind

    def test_list_recursive_and_one_level(self, objstore: ObjectStore) -> None:
        for key in ("run/a", "run/s1/x", "run/s1/y", "run/s2/z", "run2/q", "top"):
            objstore.put(key, key.encode())
        assert sorted(o.key for o in objstore.list_objects("run/")) == ["run/a", "run/s1/x", "run/s1/y", "run/s2/z"]
        assert sorted(o.key for o in objstore.list_objects("run")) == [
            "run/a", "run/s1/x", "run/s1/y", "run/s2/z", "run2/q",
        ]
        objects, dirs = objstore.list_dir("run/")
        assert [(o.key, o.size) for o in objects] == [("run/a", 5)] and sorted(dirs) == ["run/s1/", "run/s2/"]
        objects, dirs = objstore.list_dir("")
        assert [o.key for o in objects] == ["top"] and sorted(dirs) == ["run/", "run2/"]
        assert objstore.list_dir("nothing/") == ([], [])

    def test_batched_delete_ignores_missing_keys(self, objstore: ObjectStore) -> None:
        keys = [f"d/{i:04d}" for i in range(1005)]  # more than one DeleteObjects request
        for key in keys[:3] + keys[-2:]:
            objstore.put(key, b"1")
        objstore.put("keep", b"k")
        objstore.delete(keys + ["d/never"])
        assert [o.key for o in objstore.list_objects("")] == ["keep"]

    def test_copy_within_the_backend(self, objstore: ObjectStore, pool: ThreadPoolExecutor) -> None:
        data = os.urandom(MiB)
        objstore.put("src/o", data)
        objstore.copy("dst/o", objstore, "src/o", len(data), executor=pool)
        assert objstore.get("dst/o") == data and objstore.get("src/o") == data
