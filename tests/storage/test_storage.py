"""S3StorageWriter / S3StorageReader against a real SeaweedFS server, single process."""

from __future__ import annotations

import inspect
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3 import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidCheckpointIdError,
    S3AccessDeniedError,
    S3StorageReader,
    S3StorageWriter,
)
from dcp_s3._local_server import LocalS3Server
from tests.objects import data_key, data_keys, data_name, hooked

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

MiB = 1 << 20


def sample_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return {
        "bf16": torch.randn(300, 200, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(1000, generator=g),
        "fp16": torch.randn(7, 5, 3, generator=g).half(),
        "i64": torch.arange(100),
        "bool": torch.rand(33, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # non-contiguous source
        "view": base[10:20],  # storage larger than the tensor
        "nested": {"a": torch.ones(3, 3), "b": [torch.zeros(2), 7]},
        "step": 12,
        "name": "run-1",
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


def blank_like(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd, 0) if sd.dtype != torch.bool else torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [blank_like(v) for v in sd]
    return None


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def keys(server: LocalS3Server, bucket: str, prefix: str = "") -> dict[str, int]:
    resp = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for o in resp.get("Contents", [])}


def test_round_trip_every_kind_of_value(bucket: str, s3_env: LocalS3Server) -> None:
    sd = sample_state()
    uri = f"s3://{bucket}/run/step-1"
    dcp.save(sd, storage_writer=S3StorageWriter(uri))
    assert set(keys(s3_env, bucket)) == {"run/step-1/.metadata", data_key(s3_env.client(), bucket, "run/step-1")}
    out = blank_like(sd)
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert_same(sd, out)


def test_checkpoint_id_argument_and_keyword_path(bucket: str) -> None:
    sd = {"w": torch.randn(10)}
    dcp.save(sd, storage_writer=S3StorageWriter(), checkpoint_id=f"s3://{bucket}/a")
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=S3StorageReader(path=f"s3://{bucket}/a"))
    assert torch.equal(out["w"], sd["w"])


def test_large_object_goes_multipart_and_small_in_one_put(bucket: str, s3_env: LocalS3Server) -> None:
    sd = {f"w{i}": torch.randn(MiB // 4 * 3) for i in range(4)}  # 12 MiB
    uri = f"s3://{bucket}/big"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, part_size=5 * MiB, max_concurrency=3))
    client = s3_env.client()
    data_etag = client.head_object(Bucket=bucket, Key=data_key(client, bucket, "big"))["ETag"]
    meta_etag = client.head_object(Bucket=bucket, Key="big/.metadata")["ETag"]
    assert data_etag.strip('"').endswith("-3"), data_etag  # 12 MiB in 5 MiB parts
    assert "-" not in meta_etag  # single PUT
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = S3StorageReader(uri, max_range_size=1 * MiB, max_direct_range_size=1 * MiB, max_concurrency=4)
    dcp.load(out, storage_reader=reader)
    assert_same(sd, out)


def test_files_per_rank_splits_items(bucket: str, s3_env: LocalS3Server) -> None:
    sd = {f"w{i}": torch.randn(1000) for i in range(6)}
    uri = f"s3://{bucket}/split"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, files_per_rank=3))
    assert {data_name(k) for k in keys(s3_env, bucket) if k.endswith(".distcp")} == {f"__0_{n}" for n in range(3)}
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert_same(sd, out)


def test_stock_filesystem_reader_loads_a_downloaded_copy(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    sd = sample_state()
    dcp.save(sd, storage_writer=S3StorageWriter(f"s3://{bucket}/ck"))
    client = s3_env.client()
    for key in keys(s3_env, bucket, "ck/"):
        client.download_file(bucket, key, str(tmp_path / key.split("/", 1)[1]))
    out = blank_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path))
    assert_same(sd, out)


def test_reads_checkpoint_written_by_stock_filesystem_writer(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    sd = sample_state()
    dcp.save(sd, checkpoint_id=tmp_path)
    client = s3_env.client()
    for f in tmp_path.iterdir():
        client.upload_file(str(f), bucket, f"stock/{f.name}")
    out = blank_like(sd)
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/stock"))
    assert_same(sd, out)


def test_cast_and_non_contiguous_destinations(bucket: str) -> None:
    src = {"w": torch.randn(40, 30), "v": torch.randn(30, 40)}
    uri = f"s3://{bucket}/cast"
    dcp.save(src, storage_writer=S3StorageWriter(uri))
    strided = torch.zeros(40, 30).t()  # shape (30, 40), column-major
    out = {"w": torch.zeros(40, 30, dtype=torch.float64), "v": strided}
    dcp.load(out, storage_reader=S3StorageReader(uri, max_range_size=64 * 1024))
    assert out["w"].dtype == torch.float64 and torch.equal(out["w"], src["w"].double())
    assert out["v"] is strided and torch.equal(out["v"], src["v"])


def test_partial_load_reads_only_needed_bytes(bucket: str) -> None:
    sd = {f"layer{i}": torch.randn(256, 1024) for i in range(20)}  # 20 MiB
    uri = f"s3://{bucket}/partial"
    dcp.save(sd, storage_writer=S3StorageWriter(uri))
    reader = S3StorageReader(uri)
    fetched: list[int] = []
    out = {"layer3": torch.zeros(256, 1024), "layer11": torch.zeros(256, 1024)}  # 10% of keys
    with hooked(reader, "after-call.s3.GetObject", lambda parsed, **_: fetched.append(int(parsed["ContentLength"]))):
        dcp.load(out, storage_reader=reader)
    assert torch.equal(out["layer3"], sd["layer3"]) and torch.equal(out["layer11"], sd["layer11"])
    needed = 2 * 256 * 1024 * 4
    metadata_bytes = fetched[0]
    assert sum(fetched) - metadata_bytes <= 1.2 * needed, fetched


def test_direct_reads_take_larger_ranges_than_staged_ones(bucket: str) -> None:
    """Bytes read straight into a CPU tensor hold no buffer: they come in GETs of up to
    ``max_direct_range_size`` (64 MiB), a quarter of the GETs (and of their CPU) at 16 MiB ranges, while
    staged reads (here a cast) keep ``max_range_size`` (16 MiB) as their memory bound."""
    sd = {"w": torch.randn(40, 256 * 1024)}  # 40 MiB in 1 MiB rows
    uri = f"s3://{bucket}/direct-ranges"
    dcp.save(sd, storage_writer=S3StorageWriter(uri))

    def payload_gets(out: dict[str, torch.Tensor], **options: Any) -> list[int]:
        reader = S3StorageReader(uri, **options)
        fetched: list[int] = []
        with hooked(
            reader, "after-call.s3.GetObject", lambda parsed, **_: fetched.append(int(parsed["ContentLength"]))
        ):
            dcp.load(out, storage_reader=reader)
        return sorted(fetched[1:], reverse=True)  # the first is .metadata; the rest arrive in any order

    direct = {"w": torch.zeros(40, 256 * 1024)}
    assert payload_gets(direct) == [40 * MiB]  # one GET, not three of 16 MiB
    assert torch.equal(direct["w"], sd["w"])
    staged = {"w": torch.zeros(40, 256 * 1024, dtype=torch.float64)}
    sizes = payload_gets(staged)
    assert len(sizes) == 3 and max(sizes) <= 16 * MiB, sizes
    assert torch.equal(staged["w"], sd["w"].double())
    # Both are settings: direct ranges as small as asked (and never below max_range_size).
    assert payload_gets({"w": torch.zeros(40, 256 * 1024)}, max_direct_range_size=8 * MiB) == [16 * MiB] * 2 + [8 * MiB]
    assert (
        payload_gets({"w": torch.zeros(40, 256 * 1024)}, max_range_size=4 * MiB, max_direct_range_size=4 * MiB)
        == [4 * MiB] * 10
    )


def test_direct_reads_of_neighbouring_items_coalesce_into_larger_gets(bucket: str) -> None:
    """Small tensors read straight into CPU tensors coalesce up to ``max_direct_range_size`` (one GET for 48
    MiB of 4 MiB tensors); staged ones (a cast) still up to ``max_range_size``."""
    sd = {f"w{i:02d}": torch.randn(MiB) for i in range(12)}  # 12 x 4 MiB
    uri = f"s3://{bucket}/direct-coalesced"
    dcp.save(sd, storage_writer=S3StorageWriter(uri))

    def payload_gets(out: dict[str, torch.Tensor]) -> list[int]:
        reader = S3StorageReader(uri)
        fetched: list[int] = []
        with hooked(
            reader, "after-call.s3.GetObject", lambda parsed, **_: fetched.append(int(parsed["ContentLength"]))
        ):
            dcp.load(out, storage_reader=reader)
        return fetched[1:]  # the first is .metadata

    direct = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert len(payload_gets(direct)) == 1
    assert_same(sd, direct)
    staged = {k: torch.zeros(MiB, dtype=torch.float64) for k in sd}
    sizes = payload_gets(staged)
    assert len(sizes) >= 4 and max(sizes) <= 16 * MiB, sizes
    assert all(torch.equal(staged[k], v.double()) for k, v in sd.items())


def test_resave_replaces_by_default_and_overwrite_false_refuses(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/ow"
    client = s3_env.client()
    dcp.save({"w": torch.ones(4)}, storage_writer=S3StorageWriter(uri))
    first = data_keys(client, bucket, "ow/")
    # As torch's FileSystemWriter: saving to the same path again replaces the checkpoint...
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=S3StorageWriter(uri))
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert torch.equal(out["w"], torch.full((4,), 2.0))
    second = data_keys(client, bucket, "ow/")
    assert len(second) == 1 and not set(first) & set(second), (first, second)  # old objects gone, new names
    # ...and overwrite=False refuses with torch's wording, touching nothing.
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.zeros(4)}, storage_writer=S3StorageWriter(uri, overwrite=False))
    assert "Checkpoint already exists" in str(info.value) and uri in str(info.value)
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert torch.equal(out["w"], torch.full((4,), 2.0)), "refused save must not touch the checkpoint"
    assert data_keys(client, bucket, "ow/") == second


def test_conditional_commit_refuses_a_racing_save(bucket: str) -> None:
    uri = f"s3://{bucket}/race"
    writer = S3StorageWriter(uri, overwrite=False)
    writer.prepare_global_plan([])  # passes: nothing there yet
    dcp.save({"w": torch.ones(2)}, storage_writer=S3StorageWriter(uri))  # another job commits first
    from torch.distributed.checkpoint.metadata import Metadata

    with pytest.raises(CheckpointExistsError, match="^Checkpoint already exists.*while this one was being written"):
        writer.finish(Metadata(state_dict_metadata={}), [])


def test_commit_retry_that_finds_its_own_metadata_succeeds(bucket: str) -> None:
    """A PUT whose reply was lost is retried by botocore and meets its own .metadata (412)."""
    from torch.distributed.checkpoint.metadata import Metadata

    writer = S3StorageWriter(f"s3://{bucket}/lost-reply", overwrite=False)
    metadata = Metadata(state_dict_metadata={})
    writer.finish(metadata, [])
    writer.finish(metadata, [])  # same bytes already there: committed, not an error


def test_retry_attempts_bound_botocore_and_body_retries() -> None:
    from dcp_s3 import ClientConfig

    writer = S3StorageWriter("s3://bucket/x", client=ClientConfig(retry_attempts=2), part_size=8 << 20)
    assert writer._session.client_config.retry_attempts == 2  # not replaced by a transfer setting
    assert writer._session.object_store.max_attempts == 2
    assert S3StorageReader("s3://bucket/x").__getstate__()["_session"].client_config.retry_attempts == 5


@pytest.mark.parametrize(
    "uri",
    ["gs://bucket/key", "s3://bucket", "s3://bucket/", "s3:///key", "s3://B!/k", "s3://bucket/a/../b", ""],
)
def test_non_s3_uris_rejected(uri: str) -> None:
    assert not S3StorageWriter.validate_checkpoint_id(uri)
    assert not S3StorageReader.validate_checkpoint_id(uri)
    with pytest.raises(InvalidCheckpointIdError, match="checkpoint id"):
        S3StorageWriter(uri)
    with pytest.raises(InvalidCheckpointIdError, match="checkpoint id"):
        S3StorageReader(uri)


@pytest.mark.parametrize("path", ["/tmp/ckpt", "file:///tmp/ckpt", Path("/tmp/ckpt"), "rel/ckpt"])
def test_local_paths_select_the_local_backend(path: str | Path) -> None:
    """Local paths used to be refused; they now mean the local object store (same format and protocol)."""
    from dcp_s3._objstore.local import LocalObjectStore

    assert S3StorageWriter.validate_checkpoint_id(path) and S3StorageReader.validate_checkpoint_id(path)
    writer = S3StorageWriter(path)
    assert isinstance(writer._session.object_store, LocalObjectStore)
    expected = os.path.abspath(str(path).removeprefix("file://"))
    assert writer.checkpoint_id == expected == S3StorageReader(path).checkpoint_id


def test_missing_path_is_a_clear_error() -> None:
    with pytest.raises(BaseException, match="no checkpoint location"):
        dcp.save({"w": torch.ones(1)}, storage_writer=S3StorageWriter())


def test_missing_bucket(s3_env: LocalS3Server) -> None:
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(1)}, storage_writer=S3StorageWriter("s3://no-such-bucket-xyz/ck"))
    assert "no-such-bucket-xyz" in str(info.value) and "does not exist" in str(info.value)
    with pytest.raises(CheckpointNotFoundError, match="no-such-bucket-xyz"):
        S3StorageReader("s3://no-such-bucket-xyz/ck").read_metadata()


def test_nonexistent_checkpoint(bucket: str) -> None:
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.ones(1)}, storage_reader=S3StorageReader(f"s3://{bucket}/nothing-here"))
    assert f"no checkpoint at s3://{bucket}/nothing-here" in str(info.value)


def test_bad_credentials(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(1)}, storage_writer=S3StorageWriter(f"s3://{bucket}/ck"))
    assert "access denied" in str(info.value) and bucket in str(info.value)
    assert "wrong-secret-value" not in str(info.value)
    with pytest.raises(S3AccessDeniedError):
        S3StorageReader(f"s3://{bucket}/ck").read_metadata()


def test_credential_file(bucket: str, s3_env: LocalS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    cred = tmp_path / "cred.json"
    cred.write_text(json.dumps(s3_env.credentials()))
    cred.chmod(0o600)
    uri = f"s3://{bucket}/cred"
    writer = S3StorageWriter(credential_path=str(cred), path=uri)
    dcp.save({"w": torch.arange(5)}, storage_writer=writer)
    out = {"w": torch.zeros(5, dtype=torch.long)}
    dcp.load(out, storage_reader=S3StorageReader(uri, credential_path=str(cred)))
    assert torch.equal(out["w"], torch.arange(5))
    # Pickled state names the file, never the secret it holds.
    blob = pickle.dumps(writer)
    assert s3_env.secret_key.encode() not in blob and str(cred).encode() in blob
    assert s3_env.secret_key not in repr(writer)


def test_writer_and_reader_pickle_and_work_after(bucket: str) -> None:
    uri = f"s3://{bucket}/pk"
    writer = pickle.loads(pickle.dumps(S3StorageWriter(uri)))
    dcp.save({"w": torch.arange(3)}, storage_writer=writer)
    reader = S3StorageReader(uri)
    reader.read_metadata()  # creates the client
    reader = pickle.loads(pickle.dumps(reader))
    out = {"w": torch.zeros(3, dtype=torch.long)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], torch.arange(3))


def test_shape_mismatch_names_the_key(bucket: str) -> None:
    uri = f"s3://{bucket}/shape"
    dcp.save({"w": torch.ones(4, 4)}, storage_writer=S3StorageWriter(uri))
    with pytest.raises(BaseException, match="w"):
        dcp.load({"w": torch.zeros(5, 4)}, storage_reader=S3StorageReader(uri))


def test_truncated_object_is_detected(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/trunc"
    dcp.save({"w": torch.randn(1000)}, storage_writer=S3StorageWriter(uri))
    client = s3_env.client()
    body = client.get_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "trunc"))["Body"].read()
    client.put_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "trunc"), Body=body[:-2000])
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=S3StorageReader(uri))
    assert data_key(s3_env.client(), bucket, "trunc") in str(info.value)


def test_metadata_pickle_cannot_run_code(bucket: str, s3_env: LocalS3Server) -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned > /dev/null",))

    s3_env.client().put_object(Bucket=bucket, Key="evil/.metadata", Body=pickle.dumps(Evil()))
    with pytest.raises(BaseException, match="refusing to load posix.system|refusing to load os.system"):
        S3StorageReader(f"s3://{bucket}/evil").read_metadata()


def test_torch_load_of_item_bytes_matches(bucket: str, s3_env: LocalS3Server) -> None:
    """Each stored tensor item is a complete torch.save file (the stock format)."""
    t = torch.randn(17, 3).to(torch.bfloat16)
    uri = f"s3://{bucket}/fmt"
    dcp.save({"t": t}, storage_writer=S3StorageWriter(uri))
    md = S3StorageReader(uri).read_metadata()
    (info,) = md.storage_data.values()
    body = s3_env.client().get_object(Bucket=bucket, Key=f"fmt/{info.relative_path}")["Body"].read()
    item = body[info.offset : info.offset + info.length]
    assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), t)


def test_request_args_reach_every_request(bucket: str) -> None:
    uri = f"s3://{bucket}/sse"
    args = {"ServerSideEncryption": "AES256", "StorageClass": "STANDARD"}
    writer = S3StorageWriter(uri, request_args=args, part_size=5 * MiB)
    seen: dict[str, dict[str, Any]] = {}

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        seen.setdefault(model.name, dict(params))  # returning a value would replace the params

    with hooked(writer, "provide-client-params.s3", record):
        dcp.save({"big": torch.randn(3 * MiB // 2)}, storage_writer=writer)  # 6 MiB: multipart
        dcp.save({"big": torch.randn(3 * MiB // 2)}, storage_writer=writer)  # replacing it: a GET and a HEAD
    for op in ("PutObject", "CreateMultipartUpload"):
        assert seen[op]["ServerSideEncryption"] == "AES256" and seen[op]["StorageClass"] == "STANDARD", op
    for op in ("UploadPart", "CompleteMultipartUpload", "HeadObject", "GetObject"):
        assert "ServerSideEncryption" not in seen[op], op  # S3 rejects it there
    out = {"big": torch.zeros(3 * MiB // 2)}
    dcp.load(out, storage_reader=S3StorageReader(uri, request_args={"RequestPayer": "requester"}))
    with pytest.raises(ValueError, match="unsupported request_args \\['SSECustomerKey'\\]"):
        S3StorageWriter(uri, request_args={"SSECustomerKey": "k"})


def test_corrupted_bytes_are_detected(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/corrupt"
    sd = {"w": torch.randn(1000), "meta": {"note": "x" * 100}}
    dcp.save(sd, storage_writer=S3StorageWriter(uri))
    md = S3StorageReader(uri).read_metadata()
    client = s3_env.client()
    body = bytearray(client.get_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "corrupt"))["Body"].read())
    for index, info in md.storage_data.items():
        bad = bytearray(body)
        start = info.offset + (info.payload_offset or 0)
        bad[start + 10] ^= 0xFF  # one flipped byte inside this item's payload
        client.put_object(Bucket=bucket, Key=data_key(s3_env.client(), bucket, "corrupt"), Body=bytes(bad))
        with pytest.raises(BaseException) as exc:
            dcp.load(blank_like(sd) | {"meta": {"note": ""}}, storage_reader=S3StorageReader(uri))
        message = str(exc.value)
        assert (
            "checksum mismatch" in message
            and data_key(s3_env.client(), bucket, "corrupt") in message
            and index.fqn in message
        )


def test_round_trip_on_moto(moto_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second S3 implementation: moto's server mode (no checksum or signature validation)."""
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = moto_server.create_bucket("moto-bucket")
    sd = sample_state() | {"big": torch.randn(3 * MiB // 2)}  # 6 MiB: multipart with 5 MiB parts
    uri = f"s3://{bucket}/ck"
    dcp.save(sd, storage_writer=S3StorageWriter(uri, part_size=5 * MiB))
    out = blank_like(sd)
    dcp.load(out, storage_reader=S3StorageReader(uri))
    assert_same(sd, out)
    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save(sd, storage_writer=S3StorageWriter(uri, overwrite=False))  # moto honours If-None-Match


@pytest.mark.skipif(
    "use_collectives" not in inspect.signature(dcp.save).parameters, reason="torch < 2.9 has no use_collectives mode"
)
def test_no_collectives_mode_is_refused_clearly(bucket: str) -> None:
    with pytest.raises(BaseException, match="use_collectives=True"):
        dcp.save({"w": torch.ones(1)}, storage_writer=S3StorageWriter(f"s3://{bucket}/nc"), use_collectives=False)
