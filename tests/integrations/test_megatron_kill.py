"""Megatron-core saves (sync and async) SIGKILLed at each phase on 2 gloo ranks: the last committed checkpoint loads.

The house rule ("test like a crash") with Megatron-core 0.16.1's released save path
(:func:`dcp_s3.integrations.megatron.save`, Megatron's ``AsyncRequest`` and ``AsyncCallsQueue``): every case saves
``iter_0000010`` (committed), then ``iter_0000020`` with a hook on the S3 requests of one rank that SIGKILLs at the
phase, before the request leaves:

- ``before-data``: the first PUT / CreateMultipartUpload of the rank's data object;
- ``mid-upload``: its UploadPart 2 (part 1 is on the server);
- ``parts-uploaded``: its CompleteMultipartUpload (every part is on the server, the object does not exist);
- ``before-commit``: rank 0's PUT of ``.metadata`` (every rank's data object exists, nothing commits them).

What is killed: ``node``, the rank's whole process group (the training process, Megatron's forked async worker and the
results manager: a machine lost), or ``worker``, Megatron's async worker alone (its training process lives on, and
says at once that its worker died: the case sets ``RESULT_WAIT_S`` past the hang guard). The surviving ranks must end
(with an error), and how long each waited after the kill is measured (printed with ``-s``).
Then a fresh process group loads ``iter_0000010`` bit-exact, finds ``iter_0000020`` not committed (its load is refused,
``list_steps`` does not call it complete), saves ``iter_0000020`` again (other values) and loads that bit-exact; the
re-save's ``.metadata`` names none of the objects the killed save left (they stay for ``dcp-s3 gc``).

Ranks are forked from a forkserver that imported this module (and Megatron) once: a spawned rank spends ~15 s of a
loaded 2-core machine importing Megatron, and ranks forked from this test process (which has threads) hung once here.
Each rank is a process-group leader so that a ``node`` kill takes its children and the test reaps every process a
case started. Results travel through files (a shared queue could be left locked by a kill).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port
from megatron.core.dist_checkpointing import ShardedTensor
from objects import object_keys
from test_megatron import _assert_bit_exact, _cpu_async_queue, _expected, _flat, _sharded, _values

from dcp_s3._layout import METADATA_KEY, referenced_objects
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3.admin._listing import list_steps
from dcp_s3.errors import CheckpointNotFoundError
from dcp_s3.integrations import megatron_async
from dcp_s3.integrations.megatron import load, save

pytestmark = pytest.mark.multiproc

WORLD = 2
MiB = 1 << 20
OPTIONS = {"part_size": 5 * MiB}  # the 6 MiB data object of a rank goes up in two parts
#: The process group's timeout: a hang guard only (gloo's default is 30 min). A survivor's wait ends long before it,
#: when gloo sees the dead peer's connection close (measured below).
PG_TIMEOUT_S = 180
HANG_GUARD_S = 400

# (mode, phase, rank killed, what is killed)
CASES = [
    ("sync", "before-data", 1, "node"),
    ("sync", "parts-uploaded", 1, "node"),
    ("sync", "before-commit", 0, "node"),
    ("async", "before-data", 1, "node"),
    ("async", "mid-upload", 1, "worker"),
    ("async", "parts-uploaded", 0, "node"),
    ("async", "before-commit", 0, "node"),
]


def _big(rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's 6 MiB row shard of a tensor of save ``seed``: a data object of two parts."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(768 * world, 2048, generator=g).chunk(world, 0)[rank].clone()


def _state(rank: int, world: int, seed: int) -> dict[str, Any]:
    state = _sharded(rank, world, _values(rank, world, seed), seed)
    state["decoder"]["big"] = ShardedTensor.from_rank_offsets("decoder.big", _big(rank, world, seed), (0, rank, world))
    return state


def _want(rank: int, world: int, seed: int) -> dict[str, Any]:
    return {**_expected(rank, world, seed), "big": _big(rank, world, seed)}


def _load(rank: int, world: int, uri: str) -> dict[str, Any]:
    request = _sharded(rank, world, {k: torch.zeros_like(v) for k, v in _values(rank, world, 0).items()}, None)
    request["decoder"]["big"] = ShardedTensor.from_rank_offsets(
        "decoder.big", torch.zeros_like(_big(rank, world, 0)), (0, rank, world)
    )
    return _flat(load(request, uri, options=OPTIONS))


def _save(uri: str, state: dict[str, Any], mode: str) -> None:
    if mode == "sync":
        assert save(state, uri, options=OPTIONS) is None
        return
    calls = _cpu_async_queue()
    request = save(state, uri, async_sharded_save=True, options=OPTIONS)
    assert request is not None
    calls.schedule_async_request(request)
    try:
        calls.maybe_finalize_async_calls(blocking=True)
    finally:
        calls.close()


# -- the phases ------------------------------------------------------------------------------------------------------


def _at_phase(phase: str, op: str, key: str | None, kwargs: dict[str, Any]) -> bool:
    data = str(key).endswith(".distcp")
    if phase == "before-data":
        return data and op in ("put_object", "create_multipart_upload")
    if phase == "mid-upload":
        return data and op == "upload_part" and kwargs.get("PartNumber") == 2
    if phase == "parts-uploaded":
        return data and op == "complete_multipart_upload"
    if phase == "before-commit":
        return op == "put_object" and str(key).endswith("/" + METADATA_KEY)
    raise AssertionError(f"unknown phase {phase!r}")


def _arm(phase: str, what: str, marker: Path) -> None:
    """SIGKILL at ``phase``: this rank's process group (``node``) or the process making the request (``worker``).
    The hook is inherited by Megatron's forked worker, where an async save's data requests are made."""
    call = S3ObjectStore.call

    def killing_call(self: S3ObjectStore, op: str, key: str | None, **kwargs: Any) -> Any:
        if _at_phase(phase, op, key, kwargs):
            marker.write_text(f"{time.time()} {os.getpid()}")
            if what == "node":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return call(self, op, key, **kwargs)

    S3ObjectStore.call = killing_call  # type: ignore[method-assign]


# -- ranks forked from this process ----------------------------------------------------------------------------------


def _entry(
    rank: int, world: int, port: int, env: dict[str, str], fn: Callable[..., Any], args: tuple[Any, ...], out: Path
) -> None:
    os.setpgid(0, 0)  # this rank's children (async worker, manager) go with it
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
        result: tuple[str, Any] = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # reported to the test
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    tmp.replace(out)
    os._exit(0)  # no gloo teardown: with a dead peer it may wait; the test reaps this process group


def _run(tmp: Path, fn: Callable[..., Any], *args: Any) -> dict[int, tuple[str, Any]]:
    """``fn(rank, world, *args)`` on ``WORLD`` forked ranks; each rank's ``("ok", value)``, ``("error", text)`` or
    ``("killed", exit code)``. Every process a rank started is killed before this returns."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # imported once, by the single-threaded server the ranks fork from
    port, tag = free_port(), time.monotonic_ns()
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # the server's environment is older
    outs = [tmp / f"rank{r}-{tag}.pkl" for r in range(WORLD)]
    procs = [ctx.Process(target=_entry, args=(r, WORLD, port, env, fn, args, outs[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while len(results) < WORLD:
            for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
                if r in results:
                    continue
                if out.exists():
                    results[r] = pickle.loads(out.read_bytes())
                elif p.exitcode is not None:
                    results[r] = ("killed", p.exitcode)
            assert time.monotonic() < deadline, f"ranks still running after {HANG_GUARD_S} s: {sorted(results)} ended"
            time.sleep(0.05)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.join(timeout=30)
    return results


def _killed_save(rank: int, world: int, root: str, mode: str, phase: str, victim: int, what: str, marker: str) -> Any:
    _save(f"{root}/iter_0000010", _state(rank, world, 10), "sync")
    if what == "worker":  # a dead worker is reported at once: waiting for its results would outlast the hang guard
        megatron_async.RESULT_WAIT_S = 10 * HANG_GUARD_S
    if rank == victim:
        _arm(phase, what, Path(marker))
    try:
        _save(f"{root}/iter_0000020", _state(rank, world, 20), mode)
    except BaseException as exc:  # the survivor's end, and when
        return ("raised", time.time(), f"{type(exc).__name__}: {exc}")
    return ("returned", time.time(), None)


def _resume(rank: int, world: int, root: str, mode: str) -> Any:
    """A fresh process group: the last committed checkpoint, the killed one refused, the killed name saved again."""
    earlier = _load(rank, world, f"{root}/iter_0000010")
    try:
        _load(rank, world, f"{root}/iter_0000020")
        refused = None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        refused = f"{type(exc).__name__}: {exc}"
    _save(f"{root}/iter_0000020", _state(rank, world, 21), mode)
    again = _load(rank, world, f"{root}/iter_0000020")
    return earlier, refused, again


def _data_objects(seaweed: LocalS3Server, bucket: str, prefix: str) -> set[str]:
    return {k for k in object_keys(seaweed.client(), bucket, prefix + "/") if k.endswith(".distcp")}


def _unfinished_uploads(seaweed: LocalS3Server, bucket: str, prefix: str) -> list[str]:
    listed = seaweed.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
    return [u["Key"] for u in listed.get("Uploads", [])]


@pytest.mark.parametrize(("mode", "phase", "victim", "what"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_killed_save_leaves_the_last_committed_checkpoint(
    seaweed: LocalS3Server, bucket: str, tmp_path: Path, mode: str, phase: str, victim: int, what: str
) -> None:
    root = f"s3://{bucket}/run"
    marker = tmp_path / "killed"
    ran = _run(tmp_path, _killed_save, root, mode, phase, victim, what, str(marker))

    assert marker.exists(), f"the save never reached {phase}: {ran}"
    killed_at = float(marker.read_text().split()[0])
    waits, errors = {}, {}
    for rank, (status, value) in ran.items():
        if rank == victim and what == "node":
            assert status == "killed" and value == -signal.SIGKILL, (rank, status, value)
            continue
        assert status == "ok", (rank, status, value)  # the save ended, with an error, in time
        outcome, ended, error = value
        assert outcome == "raised", f"rank {rank}: the save of a killed step returned"
        waits[rank] = (round(ended - killed_at, 2), error.splitlines()[0][:160])
        errors[rank] = error
    print(f"\n{mode}/{phase}: rank {victim}'s {what} killed; survivors' wait after the kill: {waits}")
    if what == "worker":  # the training processes live on and refuse the step on every rank, naming the dead worker
        assert all("nothing committed" in error for error in errors.values()), errors
        assert all(f"rank {victim}: its write worker" in e and " died " in e for e in errors.values()), errors

    prefix = "run/iter_0000020"
    left = _data_objects(seaweed, bucket, prefix)
    assert METADATA_KEY not in {k.rsplit("/", 1)[-1] for k in object_keys(seaweed.client(), bucket, prefix + "/")}
    if phase == "before-commit":
        assert len(left) == WORLD  # every rank's data is there, and nothing commits it
    if phase in ("mid-upload", "parts-uploaded"):
        assert _unfinished_uploads(seaweed, bucket, prefix), "the victim's upload should be left unfinished"
    steps = {s.name: s.complete for s in list_steps(root)}
    assert steps.get("iter_0000010") is True and steps.get("iter_0000020") is not True, steps

    resumed = _run(tmp_path, _resume, root, mode)
    for rank, (status, value) in sorted(resumed.items()):
        assert status == "ok", (rank, status, value)
        earlier, refused, again = value
        _assert_bit_exact(earlier, _want(rank, WORLD, 10))
        assert refused is not None and CheckpointNotFoundError.__name__ in refused and prefix in refused, refused
        _assert_bit_exact(again, _want(rank, WORLD, 21))
    body = seaweed.client().get_object(Bucket=bucket, Key=f"{prefix}/{METADATA_KEY}")["Body"].read()
    committed = {f"{prefix}/{name}" for name in referenced_objects(load_metadata(body, prefix))}
    assert committed and not committed & left, "the re-save committed an object of the killed save"
    assert {s.name: s.complete for s in list_steps(root)}["iter_0000020"] is True
