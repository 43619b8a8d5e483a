"""Megatron-core 0.16.1 ``dist_checkpointing`` (``torch_dist``) saving to and loading from SeaweedFS on gloo ranks.

The state dicts are built from Megatron's own building blocks (``ShardedTensor.from_rank_offsets``,
``ShardedObject``, replicated tensors, common state) with plain CPU tensors, saved with
:func:`dcp_s3.integrations.megatron.save` (sync, and async through Megatron's own ``AsyncCallsQueue``) and loaded
back bit-exact with :func:`~dcp_s3.integrations.megatron.load` in fresh processes. What counts is the bucket: the
checkpoint must be there (and nothing of it on local disk).

Megatron's async machinery calls ``torch.cuda.synchronize()`` when it schedules a request and puts its all-reduce
flags on ``torch.cuda.current_device()``; torch built for CPU refuses both, so the async tests make those two calls
CPU no-ops in the rank processes (:func:`_cpu_async_queue`); everything else is Megatron's released code. Its own
``torch_dist`` writer cannot save on a CPU-only torch at all (``FileSystemWriterAsync.preload_tensors`` calls
``torch.cuda.synchronize()``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import queue
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

try:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )
    from megatron.core.dist_checkpointing.validation import StrictHandling
except ImportError as exc:  # a missing framework fails the run, never skips it
    raise ImportError(
        "tests/integrations/test_megatron.py needs megatron-core==0.16.1: pip install -e '.[test]' "
        "(or pip install megatron-core==0.16.1)"
    ) from exc

import pytest
import torch
from dist_utils import run_ranks
from fault_proxy import FaultProxy, Rule
from hostile import read_metadata, replace_items, root_causes, torch_saved, touch, write_metadata
from objects import object_keys

from dcp_s3._dcp import open_store
from dcp_s3._layout import METADATA_KEY
from dcp_s3._local_server import LocalS3Server
from dcp_s3.errors import CheckpointFormatError, ConfigError, DcpS3Error
from dcp_s3.integrations import megatron_async
from dcp_s3.integrations.megatron import COMMON_KEY, _sharded_object, load, load_common_state_dict, save

pytestmark = pytest.mark.multiproc

WORLD = 2


def _pack(result: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _values(rank: int, world: int, seed: int) -> dict[str, torch.Tensor]:
    """This rank's pieces of the global tensors of save number ``seed`` (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(4 * world, 6, generator=g)  # row-sharded
    embed = torch.randn(3, 5 * world, generator=g).to(torch.bfloat16)  # column-sharded
    bias = torch.randn(7, generator=g)  # replicated on every rank
    return {"weight": weight.chunk(world, 0)[rank].clone(), "embed": embed.chunk(world, 1)[rank].clone(), "bias": bias}


def _sharded(rank: int, world: int, values: dict[str, torch.Tensor], seed: int | None) -> dict[str, Any]:
    """A Megatron sharded state dict: ShardedTensors (two shardings, one replicated), a ShardedObject per rank and
    common state (``seed`` None: the request of a load, without data)."""
    return {
        "decoder": {
            "weight": ShardedTensor.from_rank_offsets("decoder.weight", values["weight"], (0, rank, world)),
            "embed": ShardedTensor.from_rank_offsets("embed", values["embed"], (1, rank, world)),
            "bias": ShardedTensor.from_rank_offsets("decoder.bias", values["bias"], replica_id=rank),
        },
        "rng": ShardedObject(
            "rng_state", None if seed is None else {"seed": seed, "rank": rank}, (world,), (rank,), replica_id=0
        ),
        **({} if seed is None else {"iteration": seed, "opt_param_scheduler": {"lr": 0.5 / seed, "steps": [seed]}}),
    }


def _expected(rank: int, world: int, seed: int) -> dict[str, Any]:
    return {
        **_values(rank, world, seed),
        "rng": {"seed": seed, "rank": rank},
        "iteration": seed,
        "opt_param_scheduler": {"lr": 0.5 / seed, "steps": [seed]},
    }


def _flat(loaded: dict[str, Any]) -> dict[str, Any]:
    return {
        **{k: v.clone() for k, v in loaded["decoder"].items()},
        "rng": loaded["rng"],
        "iteration": loaded["iteration"],
        "opt_param_scheduler": loaded["opt_param_scheduler"],
    }


def _cpu_async_queue() -> AsyncCallsQueue:
    """Megatron's ``AsyncCallsQueue`` on a CPU-only torch: its two CUDA calls made CPU no-ops (see the module doc)."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    return AsyncCallsQueue()


def _save_rank(rank: int, world: int, uri: str, seed: int, mode: str, workdir: str) -> bytes:
    os.chdir(workdir)
    values = _values(rank, world, seed)
    state = _sharded(rank, world, values, seed)
    if mode == "sync":  # as Megatron-LM calls Megatron's save: the strategy third
        assert save(state, uri, TorchDistSaveShardedStrategy("torch_dist", 1)) is None
        return _pack(None)
    calls = _cpu_async_queue()
    request = save(state, uri, async_sharded_save=True)
    assert request is not None
    calls.schedule_async_request(request)
    for tensor in values.values():  # training goes on: the save holds the values of when it was scheduled
        tensor.add_(1000)
    committed_before = _committed(uri)
    calls.maybe_finalize_async_calls(blocking=True)
    calls.close()
    return _pack(committed_before)


def _committed(uri: str) -> bool:
    return open_store(uri).size(METADATA_KEY) is not None


def _load_rank(rank: int, world: int, uri: str, workdir: str) -> bytes:
    os.chdir(workdir)
    request = _sharded(rank, world, {k: torch.zeros_like(v) for k, v in _values(rank, world, 0).items()}, None)
    return _pack(_flat(load(request, uri, TorchDistLoadShardedStrategy())))


def _assert_bit_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), (
                key
            )
        else:
            assert got[key] == value, key


def _check_bucket(seaweed: LocalS3Server, bucket: str, prefix: str, workdir: Path) -> None:
    keys = object_keys(seaweed.client(), bucket, prefix + "/")
    names = {k[len(prefix) + 1 :] for k in keys}
    assert METADATA_KEY in names and any(n.endswith(".distcp") for n in names), names
    assert not {"common.pt", "metadata.json"} & names, names  # both are inside the DCP checkpoint
    assert not list(workdir.rglob("*")), "a checkpoint file landed on local disk"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_and_load_bit_exact(seaweed: LocalS3Server, bucket: str, tmp_path: Path, mode: str) -> None:
    uri = f"s3://{bucket}/run/iter_0000010"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    saved = [_unpack(r) for r in run_ranks(_save_rank, WORLD, uri, 10, mode, str(workdir))]
    if mode == "async":
        assert saved == [False, False]  # nothing committed until the finalize step
    _check_bucket(seaweed, bucket, "run/iter_0000010", workdir)
    loaded = [_unpack(r) for r in run_ranks(_load_rank, WORLD, uri, str(workdir))]
    for rank, got in enumerate(loaded):
        _assert_bit_exact(got, _expected(rank, WORLD, 10))
    common = load_common_state_dict(uri)  # no process group: one process reads the common state alone
    assert common == {"iteration": 10, "opt_param_scheduler": {"lr": 0.05, "steps": [10]}}


def _uncommitted_rank(rank: int, world: int, uri: str, workdir: str) -> bytes:
    """Save number 20 over save 10, killed after every rank uploaded its objects and before the commit: the worker
    runs to its end (as Megatron's caller runs it) and the finalize step never does."""
    os.chdir(workdir)
    request = save(_sharded(rank, world, _values(rank, world, 20), 20), uri, async_sharded_save=True)
    assert request is not None
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    request.async_fn(*args)
    return _pack(None)


def _failing_rank(rank: int, world: int, uri: str, endpoint: str, workdir: str) -> bytes:
    os.chdir(workdir)
    state = _sharded(rank, world, _values(rank, world, 30), 30)
    try:
        save(state, uri, options={"endpoint_url": endpoint, "retry_attempts": 1})
    except DcpS3Error as exc:
        return _pack(str(exc))
    return _pack(None)


def test_killed_or_failed_save_leaves_previous_checkpoint(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/run/iter_0000010"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    run_ranks(_save_rank, WORLD, uri, 10, "sync", str(workdir))
    before = set(object_keys(seaweed.client(), bucket, "run/"))

    run_ranks(_uncommitted_rank, WORLD, uri, str(workdir))
    after = set(object_keys(seaweed.client(), bucket, "run/"))
    assert len([k for k in after - before if k.endswith(".distcp")]) >= WORLD  # uploaded, never committed

    # Every data PUT fails: the worker's error reaches the finalize step, which raises on every rank.
    rule = Rule({"PutObject", "CreateMultipartUpload", "UploadPart"}, "500", key_contains=".distcp")
    with FaultProxy(seaweed.endpoint_url, [rule]) as proxy:
        errors = [_unpack(r) for r in run_ranks(_failing_rank, WORLD, uri, proxy.url, str(workdir))]
    assert all(e is not None and "nothing committed" in e for e in errors), errors

    loaded = [_unpack(r) for r in run_ranks(_load_rank, WORLD, uri, str(workdir))]
    for rank, got in enumerate(loaded):
        _assert_bit_exact(got, _expected(rank, WORLD, 10))


def _two_in_flight_rank(rank: int, world: int, first: str, second: str, workdir: str) -> bytes:
    """Two async saves in flight at once, the second one's worker ending first: each finalize step must commit
    its own save's objects (Megatron finalizes in order, whichever worker ended first)."""
    os.chdir(workdir)
    requests = [
        save(_sharded(rank, world, _values(rank, world, seed), seed), uri, async_sharded_save=True)
        for uri, seed in ((first, 10), (second, 20))
    ]
    for request in reversed(requests):  # the workers, as Megatron's caller runs them: second one first
        assert request is not None
        args = list(request.async_fn_args)
        args[1] = request.preload_fn()
        request.async_fn(*args)
    for request in requests:  # finalize in order, on every rank
        assert request is not None
        for finalize in request.finalize_fns:
            finalize()
    return _pack(None)


def test_two_async_saves_in_flight(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    first, second = f"s3://{bucket}/run/iter_0000010", f"s3://{bucket}/run/iter_0000020"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    run_ranks(_two_in_flight_rank, WORLD, first, second, str(workdir))
    for uri, seed in ((first, 10), (second, 20)):
        loaded = [_unpack(r) for r in run_ranks(_load_rank, WORLD, uri, str(workdir))]
        for rank, got in enumerate(loaded):
            _assert_bit_exact(got, _expected(rank, WORLD, seed))


def _strict_load_rank(rank: int, world: int, uri: str, workdir: str) -> bytes:
    """A load that reads the checkpoint's metadata first (``StrictHandling.RETURN_ALL``): one tensor not requested,
    one requested that the checkpoint lacks."""
    os.chdir(workdir)
    request = _sharded(rank, world, {k: torch.zeros_like(v) for k, v in _values(rank, world, 0).items()}, None)
    del request["decoder"]["embed"]
    request["decoder"]["extra"] = ShardedTensor.from_rank_offsets("decoder.extra", torch.zeros(3), replica_id=rank)
    loaded, missing, unexpected = load(request, uri, strict=StrictHandling.RETURN_ALL)
    got = {"weight": loaded["decoder"]["weight"].clone(), "bias": loaded["decoder"]["bias"].clone()}
    return _pack((got, set(missing), set(unexpected), "extra" in loaded["decoder"]))


def test_strict_mode_reading_the_checkpoint_metadata(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/run/iter_0000010"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    run_ranks(_save_rank, WORLD, uri, 10, "sync", str(workdir))
    for rank, packed in enumerate(run_ranks(_strict_load_rank, WORLD, uri, str(workdir))):
        got, missing, unexpected, extra_loaded = _unpack(packed)
        want = _expected(rank, WORLD, 10)
        _assert_bit_exact(got, {"weight": want["weight"], "bias": want["bias"]})
        assert missing == {"embed"} and unexpected == {"decoder.extra"} and not extra_loaded


def _hostile_load_rank(rank: int, world: int, uri: str, workdir: str) -> bytes:
    os.chdir(workdir)
    request = _sharded(rank, world, {k: torch.zeros_like(v) for k, v in _values(rank, world, 0).items()}, None)
    try:
        load(request, uri)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        return _pack([f"{type(e).__name__}: {e}" for e in root_causes(exc)])
    return _pack(None)


def test_hostile_common_state_refused(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/run/iter_0000010"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    run_ranks(_save_rank, WORLD, uri, 10, "sync", str(workdir))
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    # An attacker with write access to the bucket replaces the common state (CRC recomputed).
    assert replace_items(uri, torch_saved({"iteration": touch(marker)}), lambda fqn, _: fqn == COMMON_KEY) == [
        COMMON_KEY
    ]
    causes = [_unpack(r) for r in run_ranks(_hostile_load_rank, WORLD, uri, str(workdir))]
    for rank_causes in causes:
        assert rank_causes and any(CheckpointFormatError.__name__ in c and COMMON_KEY in c for c in rank_causes), (
            rank_causes
        )
    with pytest.raises(BaseException) as refused:  # DCP's CheckpointException, a BaseException
        load_common_state_dict(uri)
    assert any(isinstance(e, CheckpointFormatError) and COMMON_KEY in str(e) for e in root_causes(refused.value))
    assert not marker.exists()


def _strict_error_rank(rank: int, world: int, uri: str, workdir: str) -> bytes:
    os.chdir(workdir)
    request = _sharded(rank, world, {k: torch.zeros_like(v) for k, v in _values(rank, world, 0).items()}, None)
    try:
        load(request, uri, strict=StrictHandling.RETURN_ALL)
    except BaseException as exc:
        return _pack((type(exc).__name__, isinstance(exc, CheckpointFormatError), str(exc)))
    return _pack(None)


def test_strict_load_of_a_crafted_object_key(seaweed: LocalS3Server, bucket: str, tmp_path: Path) -> None:
    """A stored byte item whose key is no ``<key>/shard_<offset>_<shape>`` (issue 50, item 10): a strict load reads
    the keys of the checkpoint's metadata; it raises ``CheckpointFormatError`` naming the checkpoint and the entry
    (Megatron's own parser: ``ValueError: not enough values to unpack``)."""
    uri = f"s3://{bucket}/run/iter_0000010"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    run_ranks(_save_rank, WORLD, uri, 10, "sync", str(workdir))
    md = read_metadata(uri)
    stored = f"rng_state/shard_1_{WORLD}"
    md.state_dict_metadata["rng_state"] = md.state_dict_metadata.pop(stored)
    md.storage_data = {
        (dataclasses.replace(i, fqn="rng_state") if i.fqn == stored else i): v for i, v in md.storage_data.items()
    }
    write_metadata(uri, md)
    for packed in run_ranks(_strict_error_rank, WORLD, uri, str(workdir)):
        assert _unpack(packed) == (
            "CheckpointFormatError",
            True,
            f"{uri}: stored byte item 'rng_state' is not a Megatron ShardedObject key (<key>/shard_<offset>_<shape>, "
            "ASCII digits, as many offsets as shape dimensions)",
        )


@pytest.mark.parametrize(
    "key",
    [
        "rng",  # no /shard_
        "rng/shard_0",  # no shape
        "rng/shard_0_1_2",
        "rng/shard_\u0661_2",  # an Arabic-Indic digit: int() takes it
        "rng/shard_0_\uff12",  # a fullwidth digit
        "rng/shard_ 1_2",  # int() strips spaces
        "rng/shard_+1_2",
        "rng/shard_1..2_2.2",
        "rng/shard_0.0.0_2",  # three offsets for one dimension
        "rng/shard_0_" + "9" * 5000,  # int() refuses 5000 digits (ValueError) under Python's default limit
    ],
)
def test_object_keys_parsed_by_an_ascii_grammar(key: str) -> None:
    with pytest.raises(CheckpointFormatError, match=r"^s3://b/c: stored byte item '.*' is not a Megatron"):
        _sharded_object(key, "s3://b/c")


def test_object_keys_megatron_writes() -> None:
    assert _sharded_object("rng_state/shard_1_2", "s3://b/c").unique_key == "rng_state/shard_1_2"
    obj = _sharded_object("a.b/c/shard_0.3_2.4", "s3://b/c")  # parsed from the right: a key with a slash
    assert (obj.key, obj.global_offset, obj.global_shape) == ("a.b/c", (0, 3), (2, 4))
    older = _sharded_object("opt/shard_0.1_2", "s3://b/c")  # Megatron's older spelling: one offset more
    assert (older.global_offset, older.global_shape) == ((0, 1), (2, -1))


def test_other_formats_refused() -> None:
    """Only the torch_dist format goes through dcp_s3 (before any collective: no process group needed)."""
    with pytest.raises(ConfigError, match="sharded_strategy"):
        save({}, "s3://bucket/run/iter_0000001", ("zarr", 1))
    with pytest.raises(ConfigError, match="common_strategy"):
        save({}, "s3://bucket/run/iter_0000001", None, ("torch", 1))
    with pytest.raises(ConfigError, match="not supported"):
        load({}, "s3://bucket/run/iter_0000001", ("zarr", 1))


@pytest.mark.timeout(120)  # a hang guard: RESULT_WAIT_S is an hour where the worker is dead
def test_the_finalize_step_waits_only_for_a_worker_that_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results are sent before the worker ends: one that ended (reaped or not) without them died, and is reported
    at once; one still running is waited for until RESULT_WAIT_S; results sent just before the end are taken."""
    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    monkeypatch.setattr(megatron_async, "RESULT_WAIT_S", 0.5)
    results.put(("worker", os.getpid()))
    kind, why = megatron_async._outcome(results)
    assert kind == "error" and "no write results within RESULT_WAIT_S = 0.5 s" in why and "still running" in why

    monkeypatch.setattr(megatron_async, "RESULT_WAIT_S", 3600.0)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOWAIT)  # it ended, not reaped yet (as before Megatron's join)
    results.put(("worker", ended.pid))
    assert megatron_async._outcome(results) == (
        "error",
        f"its write worker (process {ended.pid}) died without reporting (killed?)",
    )
    ended.wait()  # reaped
    results.put(("worker", ended.pid))
    results.put(("ok", ["its results"]))
    assert megatron_async._outcome(results) == ("ok", ["its results"])
    results.put(("worker", ended.pid))
    assert megatron_async._outcome(results)[1].endswith("died without reporting (killed?)")
