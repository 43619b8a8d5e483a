"""Every request of the store-based tools carries the user's request options (one S3 stack).

``request_args`` are recorded on the real boto3 clients with a botocore event hook (the
parameters as sent to SeaweedFS), for ``cp`` (S3->disk, disk->S3, S3->S3 incl. multipart
copy), ``rm``, ``gc`` and ``Checkpointer.save`` (markers, retention) and ``load``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from dcp_s3 import cli, config, transfer
from dcp_s3.checkpointer import Checkpointer
from dcp_s3.errors import CheckpointNotFoundError
from dcp_s3.local_server import LocalS3Server
from dcp_s3.store import open_store

MiB = 1 << 20
OWNER = "123456789012"
ARGS = {
    "ServerSideEncryption": "AES256", "StorageClass": "STANDARD", "RequestPayer": "requester",
    "ExpectedBucketOwner": OWNER,
}
CLI_ARGS = [f"--request-arg={k}={v}" for k, v in ARGS.items()]
#: Operations that create an object: they take the encryption and storage class options.
NEW_OBJECT_OPS = {"PutObject", "CreateMultipartUpload", "CopyObject"}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """(operation, parameters) of every request sent by any client made during the test.

    The process-wide client cache is replaced by an empty one, so that every client the test
    uses is new and has the recording hook.
    """
    calls: list[tuple[str, dict[str, Any]]] = []

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        calls.append((model.name, dict(params)))  # returning a value would replace the params

    make_client = config.ClientConfig.make_client

    def recording_client(self: config.ClientConfig) -> Any:
        client = make_client(self)
        client.meta.events.register("provide-client-params.s3", record)
        return client

    monkeypatch.setattr(config, "_CLIENTS", config._ClientPool())
    monkeypatch.setattr(config.ClientConfig, "make_client", recording_client)
    yield calls


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
    assert ckpt.store.transport.max_attempts == 3
    ckpt.save({"m": model}, iteration=1)
    ckpt.save({"m": model}, iteration=2)  # keep_last=1 deletes step 1
    check(sent, {"PutObject", "ListObjectsV2", "DeleteObjects", "ListMultipartUploads", "HeadObject"})
    assert ckpt.load({"m": model}) == 2
    check(sent, {"GetObject", "HeadObject"})


def test_cp_rm_gc_send_request_args(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, sent: list[tuple[str, dict[str, Any]]],
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
    monkeypatch.setattr(transfer, "MAX_COPY_SIZE", 8 * MiB)
    monkeypatch.setattr(transfer, "COPY_PART_SIZE", 5 * MiB)
    assert cli.main(["cp", s3, f"s3://{bucket}/copy", *CLI_ARGS]) == 0
    check(sent, {"CopyObject", "CreateMultipartUpload", "UploadPartCopy", "CompleteMultipartUpload"})
    assert client.get_object(Bucket=bucket, Key="copy/0000001.m_model/__0_0.distcp")["Body"].read() == big
    # gc: a stale multipart upload is found (ListMultipartUploads, ListParts) and aborted
    up = client.create_multipart_upload(Bucket=bucket, Key="run/0000002.m_model/__0_0.distcp")
    client.upload_part(Bucket=bucket, Key="run/0000002.m_model/__0_0.distcp", UploadId=up["UploadId"],
                       PartNumber=1, Body=b"x")
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
    assert cli.parse_request_arg("BucketKeyEnabled=True") == ("BucketKeyEnabled", True)
    assert cli.parse_request_arg("SSEKMSKeyId=arn:aws:kms:k=v") == ("SSEKMSKeyId", "arn:aws:kms:k=v")
    capsys.readouterr()
    assert cli.main(["ls", "s3://bucket/x", "--request-arg", "SSECustomerKey=k"]) != 0  # refused, not ignored
    assert "unsupported request_args ['SSECustomerKey']" in capsys.readouterr().err


def test_upload_and_download_go_in_parts(bucket: str, tmp_path: Path, sent: list[tuple[str, dict[str, Any]]]) -> None:
    """A file larger than every buffer round-trips in parts of the configured sizes."""
    store = open_store(f"s3://{bucket}/f", part_size=5 * MiB, max_range_size=1 * MiB, max_concurrency=2)
    data = os.urandom(13 * MiB + 7)
    (tmp_path / "a").write_bytes(data)
    store.upload(str(tmp_path / "a"), "a")
    assert [op for op, _ in sent].count("UploadPart") == 3
    store.download("a", str(tmp_path / "b"))
    assert (tmp_path / "b").read_bytes() == data
    assert [op for op, _ in sent].count("GetObject") == 14  # 1 MiB ranges
    with pytest.raises(CheckpointNotFoundError):
        store.download("missing", str(tmp_path / "c"))
