"""``dcp-s3 gc`` and the staging prefixes a failed Hugging Face export leaves (``.dcp_s3-hf-staging.<token>/``):
removed by ownership only — the writer's exact name grammar, only its piece objects, older than the bound — and
a committed export beside them untouched (it still loads bit-exact)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import S3HuggingFaceStorageReader, S3HuggingFaceStorageWriter
from dcp_s3._cli import main
from dcp_s3._layout import new_token
from dcp_s3._local_server import LocalS3Server
from dcp_s3.admin import collect_garbage, find_garbage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _keys(client: Any, bucket: str) -> set[str]:
    return {o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


@pytest.fixture
def moto_env(moto_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> LocalS3Server:
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    return moto_server


def test_gc_removes_only_export_staging_it_owns(moto_env: LocalS3Server, capsys: pytest.CaptureFixture[str]) -> None:
    client = moto_env.client()
    bucket = moto_env.create_bucket(f"gc-hf-{uuid.uuid4().hex[:12]}")
    want = {"a.weight": torch.randn(64, 32), "b.bias": torch.arange(10, dtype=torch.int64)}
    dcp.save(want, storage_writer=S3HuggingFaceStorageWriter(f"s3://{bucket}/exp"), no_dist=True)
    committed = _keys(client, bucket)
    assert "exp/model.safetensors.index.json" in committed

    token = new_token()
    owned = [f"exp/.dcp_s3-hf-staging.{token}/rank-00000", f"exp/.dcp_s3-hf-staging.{token}/rank-00001"]
    nested = f"other/run/.dcp_s3-hf-staging.{new_token()}/rank-00003"  # a failed export deeper down
    arabic = "".join(chr(0x0660 + int(c, 16)) if c.isdigit() else c for c in new_token())  # U+0660.. digits
    lookalikes = [
        "exp/.dcp_s3-hf-staging.x/rank-00000",  # not a token
        f"exp/.dcp_s3-hf-staging.{arabic}/rank-00000",  # non-ASCII digits
        f"exp/.dcp_s3-hf-staging.{token.upper()}/rank-00000",  # not the writer's spelling
        "exp/.dcp_s3-hf-staging../rank-00000",  # '.' as the token
        f"exp/.dcp_s3-hf-staging.{new_token()}/../rank-00000",  # a '..' inside
        f"exp/.dcp_s3-hf-staging.{new_token()}/rank-\u0660\u0660\u0660\u0660\u0660",  # non-ASCII rank digits
    ]
    mixed_token = new_token()
    mixed = [f"exp/.dcp_s3-hf-staging.{mixed_token}/rank-00000", f"exp/.dcp_s3-hf-staging.{mixed_token}/notes.txt"]
    for key in owned + [nested] + lookalikes + mixed:
        client.put_object(Bucket=bucket, Key=key, Body=b"piece bytes")
    everything = _keys(client, bucket)

    # Younger than the bound (the default hour): reported as skipped, nothing removed.
    young = find_garbage(f"s3://{bucket}")
    assert young.staging == [] and young.objects == []
    assert any(".dcp_s3-hf-staging." + token in where and "age bound" in why for where, why in young.skipped)
    assert collect_garbage(young) == (0, 0) and _keys(client, bucket) == everything

    # Older than the bound: only the writer's own prefixes, every object of them, nothing else.
    old = find_garbage(f"s3://{bucket}", now=time.time() + 7200)
    assert sorted(old.staging) == sorted([f"exp/.dcp_s3-hf-staging.{token}/", nested.rpartition("/")[0] + "/"]), (
        old.skipped
    )
    assert sorted(o.name for o in old.objects) == sorted(owned + [nested])
    skipped = {where.rstrip("/").rpartition("/")[2] for where, _ in old.skipped}
    assert {f".dcp_s3-hf-staging.{mixed_token}", ".dcp_s3-hf-staging.x", ".dcp_s3-hf-staging.."} <= skipped

    # The CLI: a dry run names the prefix and removes nothing; --yes removes exactly those objects.
    assert main(["gc", f"s3://{bucket}", "--older-than", "0"]) == 0
    said = capsys.readouterr()
    assert f"would remove staging of a failed Hugging Face export s3://{bucket}/exp/.dcp_s3-hf-staging.{token} " in (
        said.out + said.err
    )
    assert _keys(client, bucket) == everything
    assert main(["gc", f"s3://{bucket}", "--older-than", "0", "--yes"]) == 0
    assert _keys(client, bucket) == everything - set(owned) - {nested}

    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=S3HuggingFaceStorageReader(f"s3://{bucket}/exp"), no_dist=True)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_gc_leaves_a_staging_prefix_with_an_upload_in_progress(moto_env: LocalS3Server) -> None:
    """A piece still being uploaded (a multipart upload that received a part within the bound) keeps its
    prefix, however old its other pieces; once the upload is idle for longer than the bound, it is aborted with
    the prefix."""
    client = moto_env.client()
    bucket = moto_env.create_bucket(f"gc-hf-{uuid.uuid4().hex[:12]}")
    where = f"exp/.dcp_s3-hf-staging.{new_token()}"
    client.put_object(Bucket=bucket, Key=f"{where}/rank-00000", Body=b"done")
    upload = client.create_multipart_upload(Bucket=bucket, Key=f"{where}/rank-00001")["UploadId"]
    client.upload_part(Bucket=bucket, Key=f"{where}/rank-00001", UploadId=upload, PartNumber=1, Body=b"x" * 100)
    busy = find_garbage(f"s3://{bucket}", older_than=3600)
    assert busy.staging == [] and any("upload is in progress" in why for _, why in busy.skipped)
    idle = find_garbage(f"s3://{bucket}", now=time.time() + 7200)
    assert idle.staging == [f"{where}/"] and [u.name for u in idle.uploads] == [f"{where}/rank-00001"]
    assert collect_garbage(idle) == (1, 1)
    assert _keys(client, bucket) == set()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
