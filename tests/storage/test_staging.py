"""Pinned staging of CUDA tensors (``dcp_s3._dcp.staging``), tested on CPU.

The pool, its bound, the fallback and the order of copies and uploads are plain logic: a fake side
stream stands in for CUDA, whose copies run only when their event is waited for (as a real copy may
still be running then), so a chunk handed over before its copy was waited for, or a tensor given to DCP
before its host-to-device copies completed, shows up as wrong bytes. Saves and loads run for real, on
disk and on SeaweedFS. The device check (``benchmarks/gpu_check.py``) runs the same paths on a GPU.
"""

from __future__ import annotations

import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fault_proxy import FaultProxy, Rule
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._dcp import staging as staging_mod
from dcp_s3._dcp.staging import DeviceStaging, PinnedPool, Stagings, device_chunks, save_pinned_bound
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.config import ClientConfig, TransferConfig
from dcp_s3.errors import DcpS3Error

MiB = 1 << 20


class FakeEvent:
    def __init__(self, log: list[Any], k: int, run: Any) -> None:
        self.log, self.k, self.run, self.done = log, k, run, False

    def query(self) -> bool:  # the copy runs when first asked about (it may still be running before)
        if not self.done:
            self.run()
            self.done = True
            self.log.append(("sync", self.k))
        return True


class FakeStream:
    """Copies are queued, and run when their event is waited for."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.copies = 0

    def wait_current(self) -> None:
        self.log.append("wait_current")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        k = self.copies
        self.copies += 1
        self.log.append(("copy", k))
        return FakeEvent(self.log, k, lambda: dst.copy_(src))


class Allocations:
    def __init__(self, fail: bool = False) -> None:
        self.made: list[torch.Tensor] = []
        self.fail = fail
        self.calls = 0

    def __call__(self, size: int) -> torch.Tensor:
        self.calls += 1
        if self.fail:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc; locked-memory limit)")
        buf = torch.empty(size, dtype=torch.uint8)
        self.made.append(buf)
        return buf


def test_copy_of_the_next_chunk_is_queued_before_the_previous_is_uploaded() -> None:
    data = torch.randint(0, 256, (10 * 1000 + 7,), dtype=torch.uint8)
    pool = PinnedPool(2, 1000, Allocations())
    stream = FakeStream()
    chunks = device_chunks(data, pool, stream)
    assert chunks is not None
    out = bytearray()
    for i, chunk in enumerate(chunks):
        stream.log.append(("write", i))
        out += chunk  # the writer copies the chunk into its part buffers before asking for the next
    assert bytes(out) == data.numpy().tobytes()
    log = stream.log
    assert log[0] == "wait_current"  # after what the training stream queued, before any copy
    n = 11
    for k in range(n):
        assert log.index(("sync", k)) < log.index(("write", k))  # never handed over before its copy is done
        if k + 1 < n:  # chunk k+1's copy is in flight while chunk k is uploaded
            assert log.index(("copy", k + 1)) < log.index(("write", k))
        if k + 2 < n:  # and its buffer is reused only after chunk k was written
            assert log.index(("write", k)) < log.index(("copy", k + 2))
    assert len(pool._free) == 2 and pool.held_bytes == 2000  # both buffers back in the pool


def test_abandoned_stream_waits_for_its_copies_and_returns_its_buffers() -> None:
    pool = PinnedPool(2, 100, Allocations())
    stream = FakeStream()
    chunks = device_chunks(torch.zeros(1000, dtype=torch.uint8), pool, stream)
    assert chunks is not None
    next(chunks)
    chunks.close()  # the writer failed after one chunk
    assert ("sync", 1) in stream.log  # the copy queued into the second buffer completed first
    assert len(pool._free) == 2


def test_pool_is_bounded_reused_across_items_and_saves_and_released_on_close() -> None:
    alloc = Allocations()
    count, size = save_pinned_bound(part_size=4096, files_per_rank=3)
    pool = PinnedPool(count, size, alloc)
    staging = DeviceStaging(pool, FakeStream())
    peaks = []

    def serializer(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(20):  # items of several saves, on each serializer thread
            t = torch.randint(0, 256, (int(torch.randint(1, 5 * 4096, (1,), generator=g)),), dtype=torch.uint8)
            chunks = device_chunks(t, staging.pool, staging.stream)
            assert chunks is not None
            assert b"".join(bytes(c) for c in chunks) == t.numpy().tobytes()
            peaks.append(pool.held_bytes)

    threads = [threading.Thread(target=serializer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(peaks) == 60
    assert 2 <= alloc.calls <= count  # made once, reused by 60 items
    assert pool.peak_bytes <= count * size == 2 * 3 * 4096
    assert len(pool.take(count + 5)) == count and pool.take(1) == []  # every buffer taken: none more, no wait
    pool.give_back(list(alloc.made))
    pool.close()
    assert pool.held_bytes == 0 and pool._free == []
    assert len(pool.take(1)) == 1 and alloc.calls == count + 1  # a later save makes a new one


def test_pinning_failure_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_mod, "_warned", False)
    alloc = Allocations(fail=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pools = [PinnedPool(2, 100, alloc) for _ in range(3)]
        for pool in pools:
            for _ in range(4):
                assert device_chunks(torch.zeros(1000, dtype=torch.uint8), pool, FakeStream()) is None
    found = [w for w in caught if "pinned host memory is unavailable" in str(w.message)]
    assert len(found) == 1 and issubclass(found[0].category, RuntimeWarning)
    assert "ulimit -l" in str(found[0].message)
    assert alloc.calls == 3  # one attempt per pool, then it stays off
    assert all(p.disabled and p.held_bytes == 0 for p in pools)


class _StageEverything(Stagings):
    """Stagings that stage every tensor (the real one stages CUDA tensors only), on a fake stream."""

    def __init__(self, count: int, size: int, alloc: Allocations) -> None:
        super().__init__(count, size)
        self.staging = DeviceStaging(PinnedPool(count, size, alloc), FakeStream())
        self.asked = 0

    def get(self, tensor: torch.Tensor) -> DeviceStaging:
        self.asked += 1
        with self._lock:
            self._by_device[torch.device("cuda", 0)] = self.staging
        return self.staging


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(2000, 1000, generator=g).to(torch.bfloat16),  # 4 MB: chunks of 512 KiB on save
        "adam": torch.randn(1000, 33, generator=g),
        "step": torch.tensor(7),
    }


def _save_staged(where: str) -> tuple[dict[str, torch.Tensor], _StageEverything, S3StorageWriter]:
    sd = _state()
    writer = S3StorageWriter(where, part_size=5 * MiB)
    fake = _StageEverything(2, 512 << 10, Allocations())  # chunks borrowed if allowed
    writer._stagings = fake
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert fake.staging.stream.copies > 8  # the bytes came through the pinned chunks
    return sd, fake, writer


def test_save_through_pinned_staging_is_bit_exact_and_torch_loads_it(tmp_path: Path) -> None:
    sd, fake, writer = _save_staged(str(tmp_path / "ck"))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "ck"), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    writer.close()
    assert fake.staging.pool.held_bytes == 0


def test_save_through_pinned_staging_to_s3_copies_reused_chunks(bucket: str, s3_env: LocalS3Server) -> None:
    """A multipart part may be sent after the next chunk reused its pinned buffer: staged chunks are copied
    into the part buffers, never borrowed as a tensor's own memory is."""
    uri = f"s3://{bucket}/staged-save"
    sd, _, _ = _save_staged(uri)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=S3StorageReader(uri), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_load_waits_for_every_host_to_device_copy_before_dcp_sees_the_tensor(
    bucket: str, s3_env: LocalS3Server
) -> None:
    sd = _state()
    uri = f"s3://{bucket}/staged"
    dcp.save(sd, storage_writer=S3StorageWriter(uri), no_dist=True)
    # Another dtype, so the reader stages (as it does for every CUDA destination).
    out = {"w": torch.zeros(2000, 1000), "adam": torch.zeros(1000, 33, dtype=torch.float64), "step": torch.tensor(0)}
    reader = S3StorageReader(uri, max_range_size=64 << 10)
    alloc = Allocations()
    fake = _StageEverything(*staging_mod.load_pinned_bound(64 << 10, 3), alloc)
    reader._stagings = fake
    dcp.load(out, storage_reader=reader, no_dist=True)
    # The fake copies run only when waited for: equal tensors mean the reader waited before committing.
    assert torch.equal(out["w"], sd["w"].float()) and torch.equal(out["adam"], sd["adam"].double())
    assert fake.staging.stream.copies >= 5 and fake.staging.stream.log[0] == "wait_current"
    assert 0 < alloc.calls <= 3 and fake.staging.pool.peak_bytes <= 3 * (64 << 10)
    reader.close()
    assert fake.staging.pool.held_bytes == 0


def test_cpu_only_runs_take_the_old_path_and_writers_pickle(tmp_path: Path) -> None:
    writer = S3StorageWriter(tmp_path / "ck")
    reader = S3StorageReader(tmp_path / "ck")
    sd = _state()
    dcp.save(sd, storage_writer=writer, no_dist=True)
    out = {"w": torch.zeros(2000, 1000), "adam": torch.zeros_like(sd["adam"]), "step": torch.tensor(0)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["adam"], sd["adam"])
    assert writer._stagings.all() == [] and reader._stagings.all() == []  # no pool, no stream: CPU tensors only
    copy = pickle.loads(pickle.dumps(writer))  # async_save(PROCESS) pickles the writer
    assert copy._stagings.all() == [] and copy._stagings.count == writer._stagings.count
    defaults = TransferConfig()
    assert writer._stagings.count * writer._stagings.size == 2 * defaults.files_per_rank * defaults.part_size


def test_a_buffer_is_reused_oldest_first_and_only_after_its_copy() -> None:
    """Reads give buffers back with their host-to-device copy still queued: the next read takes the one
    given back first (its copy the likeliest done) and waits for that copy alone."""
    alloc = Allocations()
    pool = PinnedPool(2, 100, alloc)
    a, b = pool.take(2)
    log: list[Any] = []
    ea, eb = FakeEvent(log, 0, lambda: None), FakeEvent(log, 1, lambda: None)
    pool.give_back([a], ea)
    pool.give_back([b], eb)
    (got,) = pool.take(1)
    assert got is a and log == [("sync", 0)]  # b's copy may still run
    pool.drain()
    assert log == [("sync", 0), ("sync", 1)]


def test_a_copy_that_never_completes_is_an_error_after_the_deadline() -> None:
    class Stuck:
        def query(self) -> bool:
            return False

    with pytest.raises(DcpS3Error, match="did not complete within 0.5 s"):
        staging_mod.wait_copy(Stuck(), timeout=0.5)


class BusyEvent:
    """A copy still running: ``query`` is False until asked ``until`` times."""

    def __init__(self, until: int) -> None:
        self.until, self.asked = until, 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked >= self.until


def test_a_busy_buffer_is_taken_only_at_the_pools_count_and_then_waited_for() -> None:
    """A read whose buffer's copy is still queued must not make the next read wait while the pool may grow: on an
    H200 the pool used to keep one buffer and wait for each copy before the next (72% of torch's pinned rate)."""
    alloc = Allocations()
    pool = PinnedPool(3, 100, alloc)
    (a,) = pool.take(1)
    busy_a = BusyEvent(until=1000)
    pool.give_back([a], busy_a)
    (b,) = pool.take(1)
    assert b is not a and alloc.calls == 2 and busy_a.asked == 1  # a new buffer; a's copy not waited for
    pool.give_back([b])  # b idle (no copy)
    (got,) = pool.take(1)
    assert got is b and alloc.calls == 2  # an idle buffer before a new one
    (c,) = pool.take(1)
    assert c is not a and alloc.calls == 3  # still under the count: a new one, not the busy a
    busy_b, busy_c = BusyEvent(until=5), BusyEvent(until=1000)
    pool.give_back([b], busy_b)
    pool.give_back([c], busy_c)
    busy_a.until = busy_a.asked + 3  # a's copy ends after three more polls
    (got,) = pool.take(1)
    assert got is a and alloc.calls == 3  # at the count, all busy: the oldest, once its copy is done
    assert busy_a.asked >= busy_a.until and busy_c.asked <= 1


def test_a_buffer_given_back_twice_is_refused() -> None:
    """Given back twice, a buffer would be handed to two takers, each overwriting the other's bytes (issue 50,
    item 12): the second give-back is refused naming the buffer, and the pool still hands out distinct buffers."""
    alloc = Allocations()
    pool = PinnedPool(2, 100, alloc)
    a, b = pool.take(2)
    pool.give_back([a])
    with pytest.raises(DcpS3Error, match=rf"pinned pool of 2 x 100 bytes: buffer at 0x{a.data_ptr():x} \(100 bytes\)"):
        pool.give_back([a])
    with pytest.raises(DcpS3Error, match="given back but not taken"):
        pool.give_back([b, b])  # twice in one call
    with pytest.raises(DcpS3Error, match="given back but not taken"):
        pool.give_back([torch.empty(100, dtype=torch.uint8)])  # never this pool's
    pool.give_back([b])  # b's first give-back: accepted (the refused calls took nothing back)
    first, second = pool.take(2)
    assert first is not second and {id(first), id(second)} == {id(a), id(b)} and pool.take(1) == []


class _FailingStream(FakeStream):
    """A side stream whose host-to-device copies raise while ``failing`` (a CUDA error at launch)."""

    failing = True

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        if self.failing:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().copy(dst, src)


def test_a_piece_whose_copy_raises_gives_its_buffer_back(tmp_path: Path) -> None:
    """A staged piece whose host-to-device copy raises gives its pinned buffer back (issue 50, item 12): two
    failed loads used to keep both buffers of the pool for good, and every later read silently took the
    pageable path."""
    sd = _state()
    uri = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=S3StorageWriter(uri), no_dist=True)
    alloc = Allocations()
    fake = _StageEverything(2, 64 << 10, alloc)
    stream = _FailingStream()
    fake.staging.stream = stream
    for _ in range(2):
        reader = S3StorageReader(uri, max_range_size=64 << 10)
        reader._stagings = fake
        out = {
            "w": torch.zeros(2000, 1000),
            "adam": torch.zeros(1000, 33, dtype=torch.float64),
            "step": torch.tensor(0),
        }
        with pytest.raises(BaseException, match="illegal memory access"):
            dcp.load(out, storage_reader=reader, no_dist=True)
        back = fake.staging.pool.take(2)
        assert len(back) == 2  # every buffer back
        fake.staging.pool.give_back(back)
    stream.failing = False
    reader = S3StorageReader(uri, max_range_size=64 << 10)
    reader._stagings = fake
    out = {"w": torch.zeros(2000, 1000), "adam": torch.zeros(1000, 33, dtype=torch.float64), "step": torch.tensor(0)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], sd["w"].float()) and torch.equal(out["adam"], sd["adam"].double())
    assert stream.copies >= 5 and alloc.calls <= 2  # through the pinned buffers, the same two


def test_a_piece_whose_read_fails_gives_its_buffer_back(bucket: str, s3_env: LocalS3Server) -> None:
    """A staged piece whose GET fails after its buffer was taken (every answer cut short, past the retries) never
    reaches ``done``: the reader gives its pinned buffer back once every read has ended."""
    sd = _state()
    uri = f"s3://{bucket}/cut"
    dcp.save(sd, storage_writer=S3StorageWriter(uri), no_dist=True)
    fake = _StageEverything(2, 64 << 10, Allocations())
    with FaultProxy(s3_env.endpoint_url, [Rule({"GetObjectRange"}, "truncate")], lifetime_s=120) as proxy:
        reader = S3StorageReader(
            uri, endpoint_url=proxy.url, max_range_size=64 << 10, client=ClientConfig(retry_attempts=2)
        )
        reader._stagings = fake
        out = {
            "w": torch.zeros(2000, 1000),
            "adam": torch.zeros(1000, 33, dtype=torch.float64),
            "step": torch.tensor(0),
        }
        with pytest.raises(BaseException, match="cut"):
            dcp.load(out, storage_reader=reader, no_dist=True)
        assert proxy.injected("truncate") >= 2
    assert fake.staging.pool.peak_bytes > 0  # pieces took pinned buffers before their reads failed
    assert len(fake.staging.pool.take(2)) == 2  # both buffers back
