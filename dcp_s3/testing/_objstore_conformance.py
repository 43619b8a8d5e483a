"""The object-store interface (``dcp_s3._objstore.ObjectStore``) as every backend must honour it.

``ObjectStoreConformance`` holds the tests; a subclass provides the ``objstore`` fixture (a
backend on a fresh container: a directory, or a new bucket, or a fresh prefix of one given by the
``base`` fixture). The DCP-level suite (:mod:`dcp_s3.testing._store_conformance`) then checks what
users build on it; this one checks the interface itself, with the same expectations on every
backend: same results, same error classes. dcp_s3's own subclasses: ``tests/test_conformance.py``
(local disk, SeaweedFS, moto) and ``tests/compat/conformance_external.py`` (any S3 server, run by
``tests/compat/run_servers.py``).
"""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest

from dcp_s3._objstore.base import ObjectStore, RangeRead
from dcp_s3._objstore.buffers import BufferPool
from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError

__all__ = ["ObjectStoreConformance"]

MiB = 1 << 20
Record = Callable[[str, object], None]


def _into(buf: bytearray, lo: int, hi: int) -> Any:
    return lambda: memoryview(buf)[lo:hi]


class ObjectStoreConformance:
    """Subclasses define ``objstore`` (a fixture returning an :class:`ObjectStore` on a fresh, empty
    container) and may override ``base`` (a key prefix nothing else uses, ending in ``/``, for a
    server that serves one shared bucket) and ``strict``.

    ``strict``: the backend is known to report ETags on HEAD and to enforce ``If-None-Match``; a
    backend that may lack either (an external server: ``strict = False``) has what it answers
    recorded (``record_property``) instead of failed.
    """

    strict: ClassVar[bool] = True

    @pytest.fixture
    def objstore(self) -> ObjectStore:
        raise NotImplementedError(
            f"{type(self).__name__} subclasses ObjectStoreConformance: it defines the objstore fixture "
            "(a dcp_s3._objstore.ObjectStore on a fresh, empty container)"
        )

    @pytest.fixture
    def base(self) -> str:
        return ""

    @pytest.fixture
    def pool(self) -> Iterator[ThreadPoolExecutor]:
        with ThreadPoolExecutor(4) as ex:
            yield ex

    def test_put_get_head_and_etags(self, objstore: ObjectStore, base: str, record_property: Record) -> None:
        key = f"{base}a/b.bin"
        assert objstore.head(key) is None
        with pytest.raises(CheckpointNotFoundError, match="b.bin"):
            objstore.get(key)
        etag = objstore.put(key, b"one")
        info = objstore.head(key)
        assert info is not None and info.key == key and info.size == 3 and objstore.get(key) == b"one"
        record_property("objstore_head_etag", "yes" if info.etag else "no")
        if self.strict or info.etag:  # SeaweedFS, moto and disk all report one
            assert etag and info.etag == etag
        assert objstore.put(key, b"two!") != etag
        assert objstore.get(key) == b"two!" and objstore.head(key).size == 4  # type: ignore[union-attr]

    def test_conditional_put_refuses_an_existing_key(
        self, objstore: ObjectStore, base: str, record_property: Record
    ) -> None:
        supported = objstore.conditional_writes_supported(f"{base}probe-1")
        assert objstore.head(f"{base}probe-1") is None  # the probe leaves nothing
        record_property("objstore_if_none_match", "enforced" if supported else "ignored")
        assert supported or not self.strict
        key = f"{base}x/.metadata"
        objstore.put(key, b"first", if_none_match=True)
        if not supported:  # the writer refuses overwrite=False there, or falls back to a HEAD (warned)
            return
        with pytest.raises(CheckpointExistsError) as info:
            objstore.put(key, b"second", if_none_match=True)
        pickle.loads(pickle.dumps(info.value))  # crosses ranks intact
        assert objstore.get(key) == b"first"
        assert sorted(o.key for o in objstore.list_objects(f"{base}x/")) == [key]  # no temporary left

    def test_ranged_reads_fill_caller_memory(self, objstore: ObjectStore, base: str, pool: ThreadPoolExecutor) -> None:
        data = os.urandom(3 * MiB + 17)
        key = f"{base}r/obj"
        objstore.put(key, data)
        out = bytearray(len(data))
        done: list[int] = []
        cuts = [0, 100, 5000, MiB, 2 * MiB + 3, len(data)]
        reads = [
            RangeRead(key, lo, hi, _into(out, lo, hi), (lambda lo=lo: done.append(lo)))  # type: ignore[misc]
            for lo, hi in itertools.pairwise(cuts)
        ]
        objstore.read_ranges(reads, executor=pool, max_gap=64, max_size=MiB)
        assert out == data and sorted(done) == cuts[:-1]

    def test_received_sees_every_byte_once_in_order(
        self, objstore: ObjectStore, base: str, pool: ThreadPoolExecutor
    ) -> None:
        """``RangeRead.received`` gets the destination's pieces as they arrive: joined, exactly the read's bytes
        (a checksum taken there covers what the destination holds, each byte once)."""
        data = os.urandom(5 * MiB + 11)
        key = f"{base}r/received"
        objstore.put(key, data)
        out = bytearray(len(data))
        cuts = [0, 7, 3 * MiB, len(data)]
        pieces: dict[int, list[bytes]] = {lo: [] for lo in cuts[:-1]}

        def keep(lo: int) -> Callable[[memoryview], None]:
            return lambda view: pieces[lo].append(bytes(view))  # a copy: the bytes had arrived by then

        reads = [
            RangeRead(key, lo, hi, _into(out, lo, hi), direct=True, received=keep(lo))
            for lo, hi in itertools.pairwise(cuts)
        ]
        objstore.read_ranges(reads, executor=pool, max_gap=64, max_size=MiB, max_direct_size=8 * MiB)
        assert out == data
        for lo, hi in itertools.pairwise(cuts):
            assert b"".join(pieces[lo]) == data[lo:hi], (lo, [len(p) for p in pieces[lo]])

    def test_reading_past_the_end_is_a_format_error(
        self, objstore: ObjectStore, base: str, pool: ThreadPoolExecutor
    ) -> None:
        objstore.put(f"{base}short", b"x" * 100)
        opened: list[int] = []

        def open_() -> memoryview:
            opened.append(1)
            return memoryview(bytearray(100))

        for lo, hi in ((50, 150), (100, 200), (300, 400)):
            with pytest.raises(CheckpointFormatError, match="short"):
                objstore.read_ranges([RangeRead(f"{base}short", lo, hi, open_)], executor=pool, max_gap=0, max_size=MiB)
        assert not opened  # refused before any destination memory was handed out
        with pytest.raises(CheckpointNotFoundError, match="missing"):
            objstore.read_ranges([RangeRead(f"{base}missing", 0, 1, open_)], executor=pool, max_gap=0, max_size=MiB)

    def test_streamed_writer_round_trip_and_abort(
        self, objstore: ObjectStore, base: str, pool: ThreadPoolExecutor
    ) -> None:
        data = os.urandom(11 * MiB + 5)
        buffers = BufferPool(3, 5 * MiB)
        writer = objstore.open_writer(f"{base}w/big", pool=buffers, executor=pool, expected_size=len(data))
        for i in range(0, len(data), 999_999):  # writes that straddle part boundaries
            writer.write(data[i : i + 999_999])
            assert objstore.head(f"{base}w/big") is None  # nothing visible before close
        assert writer.tell() == len(data) and writer.close() == len(data)
        assert objstore.get(f"{base}w/big") == data
        assert buffers.peak_bytes <= buffers.count * writer.part_size
        gone = objstore.open_writer(f"{base}w/gone", pool=buffers, executor=pool)
        gone.write(os.urandom(7 * MiB))
        gone.abort()
        assert [o.key for o in objstore.list_objects(f"{base}w/")] == [f"{base}w/big"]
        assert objstore.list_uploads(f"{base}w/") == []  # an aborted upload leaves no parts behind

    def test_list_recursive_and_one_level(self, objstore: ObjectStore, base: str) -> None:
        for name in ("run/a", "run/s1/x", "run/s1/y", "run/s2/z", "run2/q", "top"):
            objstore.put(base + name, b"12345")

        def rel(keys: list[str]) -> list[str]:
            assert all(k.startswith(base) for k in keys), keys
            return sorted(k[len(base) :] for k in keys)

        assert rel([o.key for o in objstore.list_objects(f"{base}run/")]) == [
            "run/a",
            "run/s1/x",
            "run/s1/y",
            "run/s2/z",
        ]
        assert rel([o.key for o in objstore.list_objects(f"{base}run")]) == [
            "run/a",
            "run/s1/x",
            "run/s1/y",
            "run/s2/z",
            "run2/q",
        ]
        objects, dirs = objstore.list_dir(f"{base}run/")
        assert [o.size for o in objects] == [5] and rel([o.key for o in objects]) == ["run/a"]
        assert rel(dirs) == ["run/s1/", "run/s2/"]
        objects, dirs = objstore.list_dir(base)
        assert rel([o.key for o in objects]) == ["top"] and rel(dirs) == ["run/", "run2/"]
        assert objstore.list_dir(f"{base}nothing/") == ([], [])

    def test_batched_delete_ignores_missing_keys(self, objstore: ObjectStore, base: str) -> None:
        keys = [f"{base}d/{i:04d}" for i in range(1005)]  # more than one DeleteObjects request
        for key in keys[:3] + keys[-2:]:
            objstore.put(key, b"1")
        objstore.put(f"{base}keep", b"k")
        objstore.delete(keys + [f"{base}d/never"])
        assert [o.key for o in objstore.list_objects(base)] == [f"{base}keep"]

    def test_copy_within_the_backend(self, objstore: ObjectStore, base: str, pool: ThreadPoolExecutor) -> None:
        data = os.urandom(MiB)
        objstore.put(f"{base}src/o", data)
        objstore.copy(f"{base}dst/o", objstore, f"{base}src/o", len(data), executor=pool)
        assert objstore.get(f"{base}dst/o") == data and objstore.get(f"{base}src/o") == data
