"""Every wait has a deadline (issue 35, items 4, 10, 14): the wait for a request token, the retries of a throttled
request, a request whose answer trickles in. Each ends in bounded time with an error naming the operation.

Real parts only: SeaweedFS behind tests/fault_proxy.py (refusals, trickling answers), and a real credential
process that fails for a while (a credential outage). Each wait runs in a daemon thread under a hang guard, so
a wait without a deadline fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fault_proxy import FaultProxy, Rule

from dcp_s3 import ClientConfig, S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3.errors import ConfigError, S3ThrottledError

WRITES = {
    "PutObject",
    "CreateMultipartUpload",
    "UploadPart",
    "CompleteMultipartUpload",
    "AbortMultipartUpload",
    "DeleteObject",
    "DeleteObjects",
}


def bounded(fn: Callable[[], Any], guard: float) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a daemon thread: (what it raised or None, seconds it took); fails the test if it runs past
    ``guard`` seconds (a wait without a deadline)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException; the test inspects it
            out.append(exc)
        else:
            out.append(None)

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(guard)
    assert out, f"still waiting after {guard} s: a wait without a deadline"
    return out[0], time.monotonic() - t0


def _state(n: int = 4) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((256,), float(i)) for i in range(n)}


# -- item 4: a token taken before signing is returned when signing fails --------------------------------------------


def _flaky_profile(tmp_path: Path, server: LocalS3Server) -> Path:
    """An AWS profile ``flaky`` whose credentials come from a process that fails while ``outage`` exists. The
    credentials it gives expire within botocore's mandatory refresh window, so every request signs with freshly
    fetched ones: during the outage every signature fails (``CredentialRetrievalError``), after it they work."""
    env = server.env()
    outage = tmp_path / "outage"
    script = tmp_path / "creds.py"
    script.write_text(
        "import datetime, json, os, sys\n"
        f"if os.path.exists({str(outage)!r}):\n"
        "    sys.exit('credential outage')\n"
        "exp = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {env['AWS_ACCESS_KEY_ID']!r}, "
        f"'SecretAccessKey': {env['AWS_SECRET_ACCESS_KEY']!r}, 'Expiration': exp.isoformat()}}))\n"
    )
    Path(os.environ["AWS_CONFIG_FILE"]).write_text(f"[profile flaky]\ncredential_process = {sys.executable} {script}\n")
    return outage


def test_a_credential_outage_does_not_leak_tokens(tmp_path: Path, bucket: str, s3_env: LocalS3Server) -> None:
    """At a small share (2 writes/s: 2 attempts of a key in flight) a short credential outage fails a few PUTs at
    signing, after each took its token. Every token comes back: a save after the outage finishes. (Before: the
    token of a call failing at signing was never returned; two such calls held both in-flight slots and every later
    save hung.)"""
    outage = _flaky_profile(tmp_path, s3_env)
    with FaultProxy(s3_env.endpoint_url) as proxy:  # its own endpoint: its own rate controller
        client = ClientConfig(endpoint_url=proxy.url, profile="flaky", prefix_write_rate=2, throttle_deadline=20)
        store = S3ObjectStore(client.client, bucket)
        store.put("run/before", b"x")  # credentials work
        outage.touch()
        for i in range(4):  # each takes a token, then fails to sign (before: the third waited for a slot forever)
            error, _ = bounded(lambda i=i: store.put(f"run/during-{i}", b"x"), 30)
            assert error is not None and "credential outage" in str(error), error
        outage.unlink()
        uri = f"s3://{bucket}/run/ckpt"
        error, seconds = bounded(
            lambda: dcp.save(_state(), storage_writer=S3StorageWriter(uri, client=client), no_dist=True), 60
        )
    assert error is None, error
    assert store.head("run/ckpt/.metadata") is not None


# -- items 4 and 10: the wait for a token -------------------------------------------------------------------------


def test_a_wait_for_a_token_ends_at_the_throttle_deadline(bucket: str, s3_env: LocalS3Server) -> None:
    """A share of one write per 100 s: the second PUT would wait ~100 s for its token. It fails at
    throttle_deadline (2 s) with an S3ThrottledError naming the operation, the object and the deadline, having taken
    nothing: a later PUT still gets the next token."""
    with FaultProxy(s3_env.endpoint_url) as proxy:
        client = ClientConfig(endpoint_url=proxy.url, prefix_write_rate=0.01, throttle_deadline=2)
        store = S3ObjectStore(client.client, bucket)
        errors = []
        for i in range(2):
            error, seconds = bounded(lambda i=i: store.put(f"slow/obj-{i}", b"x"), 30)
            assert seconds < 10, seconds
            errors.append(error)
        assert any(errors), "a share of 0.01 writes/s gave two tokens within 4 s"
        error = next(e for e in errors if e is not None)
        assert isinstance(error, S3ThrottledError), repr(error)
        message = str(error)
        assert "PutObject" in message and f"s3://{bucket}/slow/obj-" in message, message
        assert "request token" in message and "throttle_deadline=2.0" in message, message


# -- item 10: a save with every write refused ---------------------------------------------------------------------


def test_a_save_with_every_write_refused_ends_near_its_deadline(bucket: str, s3_env: LocalS3Server) -> None:
    """Every write answered 503 SlowDown, throttle_deadline=3, 16 objects: the save fails within 15 s with an
    S3ThrottledError naming the operation and the deadline. (Before: the rate was cut to its floor and a call
    past its deadline noticed it only at its next answer, after waiting for a token at the floor rate: still
    running at 60 s.)"""
    with FaultProxy(s3_env.endpoint_url, [Rule(WRITES, "503")]) as proxy:
        client = ClientConfig(endpoint_url=proxy.url, throttle_deadline=3)
        writer = S3StorageWriter(f"s3://{bucket}/refused/ckpt", client=client, files_per_rank=16)
        error, seconds = bounded(lambda: dcp.save(_state(16), storage_writer=writer, no_dist=True), 60)
    print(f"every write refused: the save failed after {seconds:.1f} s")
    assert error is not None
    assert seconds < 15, seconds
    message = str(error)
    assert "S3ThrottledError" in message and "throttle_deadline=3.0" in message, message
    assert any(op in message for op in WRITES), message


# -- item 14: an answer that trickles in -----------------------------------------------------------------------------


def _trickling(s3_env: LocalS3Server, ops: set[str], fault: str) -> FaultProxy:
    """A proxy that answers ``ops`` one byte every 0.5 s: each socket read gets a byte, well within read_timeout."""
    return FaultProxy(s3_env.endpoint_url, [Rule(ops, fault, trickle_s=0.5)])


def _slow_client(proxy: FaultProxy) -> ClientConfig:
    return ClientConfig(endpoint_url=proxy.url, read_timeout=3, retry_attempts=2, request_deadline=3)


def _assert_deadline_error(error: BaseException | None, proxy: FaultProxy, first: int, op: str, where: str) -> None:
    """``error`` names the call and the deadline, and came within 12 s of the first trickled answer after the
    ``first`` earlier ones began (the deadline, 3 s, and a byte; before: the answer's length x 0.5 s, over a
    minute). Timed from the answer, not the call: a save's planning on a loaded machine is no part of it."""
    ended = time.monotonic()
    assert error is not None
    assert len(proxy.trickle_starts) > first, "no answer trickled"
    seconds = ended - proxy.trickle_starts[first]
    assert seconds < 12, seconds
    message = str(error)
    assert op in message and where in message and "request_deadline=3.0" in message, message


@pytest.mark.parametrize("fault", ["trickle", "trickle_body"])
def test_a_trickling_get_ends_at_the_request_deadline(fault: str, bucket: str, s3_env: LocalS3Server) -> None:
    """A ``.metadata`` GET whose answer (``trickle``: headers and body; ``trickle_body``: the body) comes one byte
    every 0.5 s, read_timeout=3, retry_attempts=2: fails at request_deadline=3 s with an error naming the operation,
    the object and the deadline. (Before: still running at 30 s; a 64 KiB body takes 9 hours.)"""
    s3_env.client().put_object(Bucket=bucket, Key="run/ckpt/.metadata", Body=os.urandom(64 << 10))
    with _trickling(s3_env, {"GetObject"}, fault) as proxy:
        store = S3ObjectStore(_slow_client(proxy).client, bucket)
        error, _ = bounded(lambda: store.get("run/ckpt/.metadata"), 60)
        _assert_deadline_error(error, proxy, 0, "GetObject", f"s3://{bucket}/run/ckpt/.metadata")
        assert proxy.injected(fault) == 1  # cut, not retried


def test_a_trickling_ranged_get_of_a_load_ends_at_the_request_deadline(bucket: str, s3_env: LocalS3Server) -> None:
    """A load whose data GETs (ranged) trickle their bodies fails at the deadline, naming the object."""
    uri = f"s3://{bucket}/run/ckpt"
    dcp.save(_state(), storage_writer=S3StorageWriter(uri), no_dist=True)
    with _trickling(s3_env, {"GetObjectRange"}, "trickle_body") as proxy:
        reader = S3StorageReader(uri, client=_slow_client(proxy))
        got = {k: torch.zeros_like(v) for k, v in _state().items()}
        error, _ = bounded(lambda: dcp.load(got, storage_reader=reader, no_dist=True), 60)
        _assert_deadline_error(error, proxy, 0, "GetObject", f"s3://{bucket}/run/ckpt/__0_0.")
    assert ".distcp bytes " in str(error), error


def test_a_trickling_put_ends_at_the_request_deadline(bucket: str, s3_env: LocalS3Server) -> None:
    """A PUT whose answer trickles (status line first) fails at the deadline naming the operation and object; so does
    a save whose writes' answers trickle."""
    with _trickling(s3_env, {"PutObject"}, "trickle") as proxy:
        store = S3ObjectStore(_slow_client(proxy).client, bucket)
        error, _ = bounded(lambda: store.put("run/obj", b"x" * 1000), 60)
        _assert_deadline_error(error, proxy, 0, "PutObject", f"s3://{bucket}/run/obj")
        writer = S3StorageWriter(f"s3://{bucket}/run/ckpt", client=_slow_client(proxy))
        first = len(proxy.trickle_starts)
        error, _ = bounded(lambda: dcp.save(_state(), storage_writer=writer, no_dist=True), 60)
        _assert_deadline_error(error, proxy, first, "PutObject", f"s3://{bucket}/run/ckpt/")


def test_the_request_deadline_is_a_checked_setting() -> None:
    assert ClientConfig().request_deadline == 600.0
    for bad in (0, -1, float("inf"), "30", True):
        with pytest.raises(ConfigError, match="request_deadline"):
            ClientConfig(request_deadline=bad)  # type: ignore[arg-type]
