"""The transfer engine against SeaweedFS, with faults injected by a client wrapper."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore
import pytest
from botocore.exceptions import ClientError

from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.base import RangeRead, coalesce
from dcp_s3._objstore.buffers import BufferPool, fit_part_size
from dcp_s3._objstore.config import ClientConfig
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3._objstore.user_agent import USER_AGENT
from dcp_s3.errors import S3TransferError

MiB = 1 << 20


class FlakyClient:
    """Wraps a boto3 client; fails or truncates chosen calls, passes the rest through."""

    def __init__(self, client: Any, *, fail_part: int | None = None, truncate_gets: int = 0) -> None:
        self._client = client
        self.fail_part = fail_part
        self.truncate_gets = truncate_gets
        self.gets: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def upload_part(self, **kwargs: Any) -> Any:
        if kwargs["PartNumber"] == self.fail_part:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "UploadPart")
        return self._client.upload_part(**kwargs)

    def get_object(self, **kwargs: Any) -> Any:
        resp = self._client.get_object(**kwargs)
        with self._lock:
            self.gets.append(kwargs.get("Range", ""))
            cut = self.truncate_gets > 0
            self.truncate_gets -= cut
        if cut:  # deliver half the body, then drop the connection
            data = resp["Body"].read()
            resp["Body"] = _CutBody(data[: len(data) // 2])
        return resp


class _CutBody:
    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        data = self._buf.read(n)
        if not data:
            raise ConnectionResetError("injected reset")
        return data

    def readinto(self, buf: memoryview) -> int:  # what botocore's StreamingBody offers, and dcp_s3 reads with
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass


def s3_object_store(server: LocalS3Server, bucket: str, client: Any = None) -> S3ObjectStore:
    client = client or ClientConfig(endpoint_url=server.endpoint_url).make_client()
    return S3ObjectStore(lambda: client, bucket, max_attempts=3, sleep=lambda s: None)


def test_streamed_multipart_upload_round_trip(bucket: str, s3_env: LocalS3Server) -> None:
    t = s3_object_store(s3_env, bucket)
    data = os.urandom(13 * MiB + 123)
    pool = BufferPool(3, 5 * MiB)
    with ThreadPoolExecutor(2) as ex:
        writer = t.open_writer("obj", pool=pool, executor=ex)
        for i in range(0, len(data), 777_777):  # writes that straddle part boundaries
            writer.write(data[i : i + 777_777])
        assert writer.close() == len(data)
    head = s3_env.client().head_object(Bucket=bucket, Key="obj")
    assert head["ContentLength"] == len(data) and head["ETag"].strip('"').endswith("-3")
    assert s3_env.client().get_object(Bucket=bucket, Key="obj")["Body"].read() == data


def test_failed_part_aborts_the_upload(bucket: str, s3_env: LocalS3Server) -> None:
    t = s3_object_store(
        s3_env, bucket, FlakyClient(ClientConfig(endpoint_url=s3_env.endpoint_url).make_client(), fail_part=2)
    )
    with ThreadPoolExecutor(2) as ex:
        writer = t.open_writer("broken", pool=BufferPool(3, 5 * MiB), executor=ex)
        with pytest.raises(S3TransferError, match=f"s3://{bucket}/broken.*InternalError") as info:
            writer.write(os.urandom(12 * MiB))
            writer.close()
    pickle.loads(pickle.dumps(info.value))  # crosses ranks intact
    assert s3_env.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=bucket)


def test_truncated_bodies_are_resumed(bucket: str, s3_env: LocalS3Server) -> None:
    data = os.urandom(3 * MiB)
    s3_env.client().put_object(Bucket=bucket, Key="r", Body=data)
    flaky = FlakyClient(ClientConfig(endpoint_url=s3_env.endpoint_url).make_client(), truncate_gets=2)
    t = s3_object_store(s3_env, bucket, flaky)
    out = bytearray(len(data))
    view = memoryview(out)
    reads = [RangeRead("r", lo, lo + MiB, (lambda lo=lo: view[lo : lo + MiB])) for lo in range(0, len(data), MiB)]
    with ThreadPoolExecutor(3) as ex:
        t.read_ranges(reads, executor=ex, max_gap=0, max_size=MiB)
    assert out == data
    assert len(flaky.gets) == 5  # 3 ranges + 2 resumptions


def test_persistent_body_failure_names_the_object(bucket: str, s3_env: LocalS3Server) -> None:
    s3_env.client().put_object(Bucket=bucket, Key="bad", Body=os.urandom(1000))
    flaky = FlakyClient(ClientConfig(endpoint_url=s3_env.endpoint_url).make_client(), truncate_gets=100)
    t = s3_object_store(s3_env, bucket, flaky)
    buf = bytearray(1000)
    with ThreadPoolExecutor(1) as ex, pytest.raises(S3TransferError, match=f"s3://{bucket}/bad"):
        t.read_ranges([RangeRead("bad", 0, 1000, lambda: memoryview(buf))], executor=ex, max_gap=0, max_size=MiB)
    assert len(flaky.gets) == 3  # max_attempts


def test_coalesce_merges_neighbours_within_gap_and_size() -> None:
    def r(key: str, start: int, end: int) -> RangeRead:
        return RangeRead(key, start, end, lambda: memoryview(bytearray(end - start)))

    reads = [r("a", 100, 200), r("a", 0, 100), r("a", 250, 300), r("a", 2000, 2100), r("b", 0, 10), r("a", 300, 1200)]
    groups = coalesce(reads, max_gap=64, max_size=1000)
    spans = [(g[0].key, g[0].start, g[-1].end) for g in groups]
    assert spans == [("a", 0, 300), ("a", 300, 1200), ("a", 2000, 2100), ("b", 0, 10)]


def test_coalesce_lets_groups_of_direct_reads_alone_grow_to_max_direct_size() -> None:
    """Reads into the caller's own destinations (``direct``) hold no buffer: their groups may reach
    ``max_direct_size``; a group holding any other read keeps ``max_size`` (the staging memory bound)."""

    def r(start: int, end: int, direct: bool) -> RangeRead:
        return RangeRead("a", start, end, lambda: memoryview(bytearray(end - start)), direct=direct)

    direct = [r(i * 100, i * 100 + 90, True) for i in range(10)]
    spans = [(g[0].start, g[-1].end) for g in coalesce(direct, max_gap=64, max_size=300, max_direct_size=1000)]
    assert spans == [(0, 990)]
    assert len(coalesce(direct, max_gap=64, max_size=300)) == 4  # without max_direct_size: max_size
    mixed = [*direct[:5], r(500, 590, False), *direct[6:]]
    spans = [(g[0].start, g[-1].end) for g in coalesce(mixed, max_gap=64, max_size=300, max_direct_size=1000)]
    assert spans == [(0, 490), (500, 790), (800, 990)]


def test_fit_part_size_stays_under_10000_parts() -> None:
    assert fit_part_size(16 * MiB, 10 * MiB) == 16 * MiB
    big = 400 * 1024 * MiB  # 400 GiB
    size = fit_part_size(16 * MiB, big)
    assert -(-big // size) <= 10_000 and size == 64 * MiB
    assert fit_part_size(1, None) == 5 * MiB


def test_buffer_pool_bounds_buffers_in_use() -> None:
    pool = BufferPool(2, 1024)
    a, b = pool.acquire(), pool.acquire()
    got: list[bytearray] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # a third buffer waits for a release
    pool.release(a)
    t.join(5)
    assert got and got[0] is a
    pool.release(b)


def test_object_stores_and_codec_do_not_import_torch() -> None:
    """Every module of the torch-free subpackages (the object stores, the codec): importing them, in a
    fresh interpreter, loads no torch."""
    code = (
        "import importlib, pkgutil, sys, dcp_s3._objstore, dcp_s3._codec\n"
        "names = [m.name for p in (dcp_s3._objstore, dcp_s3._codec) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
        "assert len(names) >= 14, names\n"
        "for name in names: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        "import dcp_s3\n"
        "dcp_s3.S3StorageWriter  # the public API still resolves, importing torch now\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after = out.stdout.split("\n")[:2]
    assert before == "[]", before
    assert after == "True"


def test_wrong_region_is_a_config_error_naming_the_right_one() -> None:
    from dcp_s3._objstore.s3_requests import translate_error
    from dcp_s3.errors import ConfigError

    response = {
        "Error": {"Code": "AuthorizationHeaderMalformed", "Message": "the region 'us-east-1' is wrong"},
        "ResponseMetadata": {"HTTPStatusCode": 400, "HTTPHeaders": {"x-amz-bucket-region": "eu-west-1"}},
    }
    err = translate_error(ClientError(response, "HeadBucket"), "HEAD", "bkt")  # type: ignore[arg-type]
    assert isinstance(err, ConfigError)
    assert "wrong region" in str(err) and "'eu-west-1'" in str(err) and "s3://bkt" in str(err)
    assert pickle.loads(pickle.dumps(err)).args == err.args


def test_credential_errors_are_decided_by_type_not_message() -> None:
    from botocore.exceptions import NoCredentialsError, ParamValidationError, PartialCredentialsError

    from dcp_s3._objstore.s3_requests import translate_error
    from dcp_s3.errors import S3AccessDeniedError

    for exc in (NoCredentialsError(), PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY")):
        assert isinstance(translate_error(exc, "PUT", "bkt", "k"), S3AccessDeniedError), exc
    # A message that merely mentions credentials is not a credential failure.
    other = translate_error(ParamValidationError(report="credentials: bad key name"), "PUT", "bkt", "k")
    assert type(other) is S3TransferError and "s3://bkt/k" in str(other)


def test_buffer_pool_counts_the_bytes_it_holds() -> None:
    pool = BufferPool(2, 1024)
    a = pool.acquire()
    pool.release(a)
    b = pool.acquire(4096)  # the free 1 KiB buffer is too small: dropped, not kept beside the new one
    c = pool.acquire(4096)
    assert pool.peak_bytes == 2 * 4096 <= pool.count * 4096
    pool.release(b)
    pool.release(c)
    pool.clear()
    assert pool.acquire() is not b and pool.peak_bytes == 2 * 4096


def test_memory_bound_holds_when_parts_are_enlarged(bucket: str, s3_env: LocalS3Server) -> None:
    """An object declared too large for 10,000 parts of ``part_size`` gets larger parts; the pool's
    bytes stay within ``count * enlarged part size`` (docs/configuration.md, "Memory")."""
    t = s3_object_store(s3_env, bucket)
    declared = 60 << 30  # 60 GiB: 12,288 parts of 5 MiB, so parts grow to 10 MiB
    pool = BufferPool(3, 5 * MiB)
    data = os.urandom(35 * MiB)
    with ThreadPoolExecutor(2) as ex:
        writer = t.open_writer("enlarged", pool=pool, executor=ex, expected_size=declared)
        assert writer.part_size == fit_part_size(5 * MiB, declared) == 10 * MiB
        for i in range(0, len(data), 3 * MiB):
            writer.write(data[i : i + 3 * MiB])
        writer.close()
    assert 10 * MiB <= pool.peak_bytes <= pool.count * writer.part_size
    head = s3_env.client().head_object(Bucket=bucket, Key="enlarged")
    assert head["ETag"].strip('"').endswith("-4")  # 3 parts of 10 MiB and the rest


def test_requests_carry_one_fixed_user_agent(bucket: str, s3_env: LocalS3Server) -> None:
    """dcp_s3's clients send a fixed User-Agent naming dcp_s3, boto3 and botocore (built once, not by botocore's
    per-request rebuild from ~20 parts: ~850 Python calls of each request, issue 39), the same on every request."""
    client = ClientConfig(endpoint_url=s3_env.endpoint_url).make_client()
    agents: list[str] = []

    def record(request: Any, **_: Any) -> None:
        agent = request.headers.get("User-Agent", b"")
        agents.append(agent.decode() if isinstance(agent, bytes) else agent)

    client.meta.events.register("before-send.s3", record)
    store = S3ObjectStore(lambda: client, bucket)
    store.put("ua", b"x")
    assert store.get("ua") == b"x"
    assert len(agents) == 2 and len(set(agents)) == 1
    assert agents[0].startswith("dcp_s3/") and agents[0].startswith(USER_AGENT)
    assert f" Boto3/{boto3.__version__} " in agents[0] and f"Botocore/{botocore.__version__}" in agents[0]
