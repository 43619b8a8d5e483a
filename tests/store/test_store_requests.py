"""Every request of the store-based tools carries the user's request options (one S3 stack).

``request_args`` are recorded on the real boto3 clients with a botocore event hook (the
parameters as sent to SeaweedFS), for ``cp`` (S3->disk, disk->S3, S3->S3 incl. multipart
copy), ``rm``, ``gc`` and ``Checkpointer.save`` (markers, retention) and ``load``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from dcp_s3._checkpointer import Checkpointer, latest_checkpoint
from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._checkpointer.retention import retain_last
from dcp_s3._checkpointer.steps import complete_steps, scan
from dcp_s3._cli import commands as cli
from dcp_s3._cli.text import parse_request_arg
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore import config, s3_multipart
from dcp_s3._objstore import s3 as objstore_s3
from dcp_s3.errors import CheckpointNotFoundError

MiB = 1 << 20
OWNER = "123456789012"
ARGS = {
    "ServerSideEncryption": "AES256",
    "StorageClass": "STANDARD",
    "RequestPayer": "requester",
    "ExpectedBucketOwner": OWNER,
}
CLI_ARGS = [f"--request-arg={k}={v}" for k, v in ARGS.items()]
#: Operations that create an object: they take the encryption and storage class options.
NEW_OBJECT_OPS = {"PutObject", "CreateMultipartUpload", "CopyObject"}


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Callable[..., Any]]]:
    """(botocore event, handler) pairs registered on every client made during the test.

    The process-wide client cache is replaced by an empty one, so that every client the test
    uses is new and has the hooks (on the real client: requests still go to the server).
    """
    registered: list[tuple[str, Callable[..., Any]]] = []
    make_client = config.ClientConfig.make_client

    def hooked_client(self: config.ClientConfig) -> Any:
        client = make_client(self)
        for event, handler in registered:
            client.meta.events.register(event, handler)
        return client

    monkeypatch.setattr(config, "_CLIENTS", config._ClientPool())
    monkeypatch.setattr(config.ClientConfig, "make_client", hooked_client)
    return registered


@pytest.fixture
def sent(hooks: list[tuple[str, Callable[..., Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """(operation, parameters) of every request sent by any client made during the test."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        calls.append((model.name, dict(params)))  # returning a value would replace the params

    hooks.append(("provide-client-params.s3", record))
    return calls


def check(calls: list[tuple[str, dict[str, Any]]], expected_ops: set[str]) -> None:
    ops = {op for op, _ in calls}
    assert expected_ops <= ops, f"not seen: {expected_ops - ops}"
    for op, params in calls:
        if op == "CopyObject" or op == "UploadPartCopy":
            assert params.get("ExpectedSourceBucketOwner") == OWNER, op
        assert params.get("ExpectedBucketOwner") == OWNER, (op, params)
        if op != "HeadBucket":  # the one request S3 takes no RequestPayer on
            assert params.get("RequestPayer") == "requester", (op, params)
        if op in NEW_OBJECT_OPS:
            assert params.get("ServerSideEncryption") == "AES256" and params.get("StorageClass") == "STANDARD", op
        else:
            assert "ServerSideEncryption" not in params and "StorageClass" not in params, op  # S3 refuses them there
    calls.clear()


def test_checkpointer_markers_retention_and_load(bucket: str, sent: list[tuple[str, dict[str, Any]]]) -> None:
    root = f"s3://{bucket}/run"
    model = nn.Linear(8, 4)
    ckpt = Checkpointer(root, keep_last=1, request_args=ARGS, retry_attempts=3)
    assert ckpt.store.session.client_config.retry_attempts == 3  # one settings object
    assert ckpt.store.object_store.max_attempts == 3
    ckpt.save({"m": model}, iteration=1)
    ckpt.save({"m": model}, iteration=2)  # keep_last=1 deletes step 1
    check(sent, {"PutObject", "ListObjectsV2", "DeleteObjects", "ListMultipartUploads", "HeadObject"})
    assert ckpt.load({"m": model}) == 2
    check(sent, {"GetObject", "HeadObject"})


def test_cp_rm_gc_send_request_args(
    bucket: str,
    s3_env: LocalS3Server,
    tmp_path: Path,
    sent: list[tuple[str, dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = tmp_path / "src"
    (src / "0000001.m_model").mkdir(parents=True)
    big = os.urandom(17 * MiB)  # a multipart upload (16 MiB parts); a multipart copy below
    (src / "0000001.m_model" / "__0_0.distcp").write_bytes(big)
    (src / "0000001.m_model" / ".metadata").write_bytes(b"m")
    (src / "0000001.pth").write_bytes(b"p")
    s3 = f"s3://{bucket}/run"
    # disk -> S3: PUT (small files) and a streaming multipart upload (the 11 MiB one)
    assert cli.main(["cp", str(src), s3, *CLI_ARGS]) == 0
    check(sent, {"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "ListObjectsV2"})
    client = s3_env.client()
    assert client.get_object(Bucket=bucket, Key="run/0000001.m_model/__0_0.distcp")["Body"].read() == big
    # S3 -> disk: ranged GETs into the file
    out = tmp_path / "out"
    assert cli.main(["cp", s3, str(out), *CLI_ARGS]) == 0
    check(sent, {"GetObject", "HeadObject", "ListObjectsV2"})
    assert (out / "0000001.m_model" / "__0_0.distcp").read_bytes() == big
    # S3 -> S3: server-side copy; objects over the (lowered) CopyObject limit by UploadPartCopy
    monkeypatch.setattr(objstore_s3, "MAX_COPY_SIZE", 8 * MiB)
    monkeypatch.setattr(s3_multipart, "COPY_PART_SIZE", 5 * MiB)
    assert cli.main(["cp", s3, f"s3://{bucket}/copy", *CLI_ARGS]) == 0
    check(sent, {"CopyObject", "CreateMultipartUpload", "UploadPartCopy", "CompleteMultipartUpload"})
    assert client.get_object(Bucket=bucket, Key="copy/0000001.m_model/__0_0.distcp")["Body"].read() == big
    # gc: a stale multipart upload is found (ListMultipartUploads, ListParts) and aborted
    up = client.create_multipart_upload(Bucket=bucket, Key="run/0000002.m_model/__0_0.distcp")
    client.upload_part(
        Bucket=bucket, Key="run/0000002.m_model/__0_0.distcp", UploadId=up["UploadId"], PartNumber=1, Body=b"x"
    )
    time.sleep(1.1)
    assert cli.main(["gc", s3, "--older-than=1s", "--yes", *CLI_ARGS]) == 0
    check(sent, {"ListObjectsV2", "ListMultipartUploads", "ListParts", "AbortMultipartUpload"})
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads")
    # rm
    assert cli.main(["rm", "-r", s3, *CLI_ARGS]) == 0
    check(sent, {"ListObjectsV2", "DeleteObjects"})
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="run/")


def test_cli_request_arg_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["ls", str(tmp_path), "--request-arg", "NoEquals"])
    assert "KEY=VALUE" in capsys.readouterr().err
    assert parse_request_arg("BucketKeyEnabled=True") == ("BucketKeyEnabled", True)
    assert parse_request_arg("SSEKMSKeyId=arn:aws:kms:k=v") == ("SSEKMSKeyId", "arn:aws:kms:k=v")
    capsys.readouterr()
    assert cli.main(["ls", "s3://bucket/x", "--request-arg", "SSECustomerKey=k"]) != 0  # refused, not ignored
    assert "unsupported request_args ['SSECustomerKey']" in capsys.readouterr().err


def test_stream_to_and_from_s3_goes_in_parts(
    bucket: str, tmp_path: Path, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    """An object larger than every buffer goes from a directory to S3 and back in parts and ranges of the
    configured sizes, over both object stores (the directory side reads and writes without following links)."""
    store = open_store(f"s3://{bucket}/f", part_size=5 * MiB, max_range_size=1 * MiB, max_concurrency=2)
    local = open_store(tmp_path, max_range_size=1 * MiB, max_concurrency=2)
    data = os.urandom(13 * MiB + 7)
    (tmp_path / "a").write_bytes(data)
    local.stream_to("a", store, "a")
    assert [op for op, _ in sent].count("UploadPart") == 3
    store.stream_to("a", local, "sub/b")
    assert (tmp_path / "sub" / "b").read_bytes() == data
    assert [op for op, _ in sent].count("GetObject") == 14  # 1 MiB ranges
    with pytest.raises(CheckpointNotFoundError):
        store.stream_to("missing", local, "c")
    assert not (tmp_path / "c").exists()


# -- listings cost O(steps) ---------------------------------------------------------------------------
def _fake_steps(client: Any, bucket: str, root: str, steps: int, objects: int) -> None:
    """Committed steps 1..``steps`` (marker, part ``.metadata``) of ``objects`` empty data objects each."""
    for i in range(1, steps + 1):
        part = f"{root}/{i:07d}.m_model"
        for n in range(objects):
            client.put_object(Bucket=bucket, Key=f"{part}/__{n}_0.{'0' * 16}.distcp", Body=b"")
        client.put_object(Bucket=bucket, Key=f"{part}/.metadata", Body=b"")
        client.put_object(Bucket=bucket, Key=f"{root}/{i:07d}.pth", Body=b"")


def test_latest_resume_retention_list_steps_not_objects(
    bucket: str,
    s3_env: LocalS3Server,
    sent: list[tuple[str, dict[str, Any]]],
    hooks: list[tuple[str, Callable[..., Any]]],
) -> None:
    listed = [0]

    def count_keys(parsed: dict[str, Any], **_: Any) -> None:
        listed[0] += len(parsed.get("Contents", [])) + len(parsed.get("CommonPrefixes", []))

    hooks.append(("after-call.s3.ListObjectsV2", count_keys))
    client = s3_env.client()
    model = nn.Linear(8, 4)
    costs = {}
    for objects in (8, 64):  # data objects per step (ranks)
        root = f"s3://{bucket}/r{objects}"
        _fake_steps(client, bucket, f"r{objects}", 19, objects)
        ckpt = Checkpointer(root, keep_last=100)
        ckpt.save({"m": model}, iteration=20)  # a real step, newest
        sent.clear()
        listed[0] = 0
        assert latest_checkpoint(root) == f"{root}/0000020"
        assert ckpt.load({"m": model}) == 20
        retain_last(ckpt.store, 100, keep=f"{root}/0000020")  # as after a save; keep_last=100 deletes nothing
        ops = [op for op, _ in sent]
        costs[objects] = (ops.count("ListObjectsV2"), listed[0], ops.count("HeadObject"))
    print("costs (LIST requests, keys listed, HEADs) by objects per step:", costs)
    lists, keys, heads = costs[8]
    assert costs[64] == costs[8], costs  # 8x the objects, the same requests and keys
    assert lists == 3 and keys == 3 * (20 + 20), costs  # one delimiter LIST of the root each: 20 markers + 20 parts
    # latest and resume stop at the newest complete step; retention checks the steps it examines
    assert heads <= 2 * 1 + 2 + 20, costs


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("named", [False, True])
def test_find_complete_agrees_with_full_scan(
    where: str, named: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The delimiter search finds exactly the complete steps a full recursive scan finds."""
    if where == "s3":
        store = open_store(f"s3://{request.getfixturevalue('bucket')}/run")
    else:
        store = open_store(tmp_path / "run")
    tree = {
        "0000001.pth": 1,
        "0000001.m_model/.metadata": 1,
        "0000001.m_model/__0_0.distcp": 1,
        "0000002.pth": 1,
        "0000002.m_model/__0_0.distcp": 1,  # marker, part uncommitted
        "0000003.m_model/.metadata": 1,  # no marker
        "0000004.pth": 1,
        "0000004.m_model/.metadata": 1,
        "0000004.m_optim/p-0/__0_0.distcp": 1,  # optim uncommitted
        "0000005.pth": 1,
        "0000005.a_model/.metadata": 1,
        "0000005.a_optim/.metadata": 1,
        "nested/0000009.pth": 1,
        "nested/0000009.m_model/.metadata": 1,  # not directly under the root
        "plain/.metadata": 1,
    }
    # A part whose objects were all deleted: SeaweedFS still lists its directory, a full scan does not see it.
    tree.update({"0000006.pth": 1, "0000006.m_model/.metadata": 1, "0000006.m_optim/__0_0.distcp": 1})
    if named:  # names other than numbers: ordered by marker time
        tree.update({"best.pth": 1, "best.m_model/.metadata": 1, "legacy.pth": 1})
    for name in tree:
        store.write(name, b"x")
        time.sleep(0.01 if where == "local" else 0)
    store.delete(["0000006.m_optim/__0_0.distcp"])
    full = [s.name for s in complete_steps(scan(store.list_objects()))]
    assert [s.name for s in find_complete(store, None)] == full
    assert [s.name for s in find_complete(store, 2)] == full[-2:]
    assert [s.name for s in find_complete(store)] == full[-1:]
    assert find_complete(store, 0) == []
    assert set(full) == {"0000001", "0000005", "0000006"} | ({"best", "legacy"} if named else set())
