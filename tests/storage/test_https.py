"""HTTPS: the core paths over TLS, on SeaweedFS and on moto, with a throw-away certificate authority.

The servers (``seaweed_tls``/``moto_tls`` in conftest) present a certificate signed by a CA made for
this test session; nothing in the environment trusts it (``AWS_CA_BUNDLE`` is unset), so every test
that succeeds proves the CA reached the client through dcp_s3's ``verify`` option — and verification
is never turned off except where a test checks what turning it off does. The multi-process tests
(resharded load, a save killed during its commit) run dcp_s3 in children configured by environment
alone: they get the CA as ``AWS_CA_BUNDLE``, which the ``verify`` option's default defers to.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import botocore.config
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from objects import hooked, object_keys
from tcp_counter import ConnectionCounter
from test_commit_protocol import child_save, loaded_seed, state
from test_multirank import load_job, save_job

from dcp_s3 import (
    Checkpointer,
    CheckpointExistsError,
    ClientConfig,
    ConfigError,
    DcpS3Error,
    StorageOptions,
    TransferConfig,
)
from dcp_s3._cli import main as cli_main
from dcp_s3._local_server import LocalS3Server
from dcp_s3._torch_compat import async_save
from dcp_s3.integrations import dcp_route

#: Whether this botocore has ``request_checksum_calculation`` (1.36 on; ``AWS_REQUEST_CHECKSUM_CALCULATION``).
CHECKSUM_SETTING = "request_checksum_calculation" in botocore.config.Config.OPTION_DEFAULTS

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(params=["seaweedfs", "moto"])
def https(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> LocalS3Server:
    """An HTTPS server of each kind; the standard chain points at it, but nothing trusts its CA."""
    server: LocalS3Server = request.getfixturevalue("seaweed_tls" if request.param == "seaweedfs" else "moto_tls")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return server


@pytest.fixture
def tls_bucket(https: LocalS3Server) -> str:
    return https.create_bucket(f"t-{uuid.uuid4().hex[:16]}")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).bfloat16(), "step": seed}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "step": -1}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], want[k]) for k in ("w", "b")) and got["step"] == want["step"]


def _load(opts: StorageOptions, uri: str) -> dict[str, Any]:
    out = _blank()
    dcp.load(out, storage_reader=opts.reader(uri), no_dist=True)
    return out


def test_save_load_and_async_save(https: LocalS3Server, tls_bucket: str) -> None:
    opts = StorageOptions(verify=https.ca_bundle)
    dcp.save(_state(1), storage_writer=opts.writer(f"s3://{tls_bucket}/sync"), no_dist=True)
    assert _same(_load(opts, f"s3://{tls_bucket}/sync"), _state(1))
    async_save(_state(2), storage_writer=opts.writer(f"s3://{tls_bucket}/async"), no_dist=True).result(timeout=120)
    assert _same(_load(opts, f"s3://{tls_bucket}/async"), _state(2))
    keys = object_keys(https.client(), tls_bucket)
    assert {"sync/.metadata", "async/.metadata"} <= set(keys), keys


def _root_cause(exc: BaseException) -> BaseException:
    """The dcp_s3 error inside DCP's ``CheckpointException`` (or ``exc`` itself)."""
    for _ in range(8):
        if isinstance(exc, DcpS3Error):
            return exc
        failures = getattr(exc, "failures", None)
        if failures:
            first = next(iter(failures.values()))
            exc = first[0] if isinstance(first, tuple) else first
        elif exc.__cause__ is not None:
            exc = exc.__cause__
    return exc


def test_an_untrusted_certificate_fails_at_once_naming_the_endpoint(
    https: LocalS3Server, tls_bucket: str, tmp_path: Path
) -> None:
    """Without the CA (the system's authorities only) a save fails on its first connection — no retry can
    mend a certificate — with a ConfigError naming the endpoint and saying what to give; nothing is written."""
    host, port = urlsplit(https.endpoint_url).hostname, urlsplit(https.endpoint_url).port
    with ConnectionCounter((str(host), int(port or 443))) as counter:
        opts = StorageOptions(endpoint_url=f"https://127.0.0.1:{counter.port}", retry_attempts=5)
        with pytest.raises(BaseException) as info:
            dcp.save(_state(1), storage_writer=opts.writer(f"s3://{tls_bucket}/ck"), no_dist=True)
        attempts = counter.connections
    cause = _root_cause(info.value)
    assert isinstance(cause, ConfigError), repr(cause)
    assert f"https://127.0.0.1:{counter.port}" in str(cause) and "not trusted" in str(cause), cause
    assert "verify=" in str(cause) and "--ca-bundle" in str(cause)
    assert attempts == 1, f"{attempts} connections: a certificate failure was retried"
    assert object_keys(https.client(), tls_bucket) == []


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_a_wrong_authority_is_refused_and_verification_off_warns(
    https: LocalS3Server, tls_bucket: str, tmp_path: Path
) -> None:
    import trustme

    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    with pytest.raises(BaseException) as info:
        dcp.save(
            _state(1), storage_writer=StorageOptions(verify=str(other)).writer(f"s3://{tls_bucket}/ck"), no_dist=True
        )
    assert isinstance(_root_cause(info.value), ConfigError) and "not trusted" in str(_root_cause(info.value))
    with pytest.warns(UserWarning, match="verification is off"):
        opts = StorageOptions(verify=False, read_timeout=19)  # a setting of its own: a client of its own
        dcp.save(_state(3), storage_writer=opts.writer(f"s3://{tls_bucket}/off"), no_dist=True)
    assert _same(_load(StorageOptions(verify=https.ca_bundle), f"s3://{tls_bucket}/off"), _state(3))


def test_bad_tls_options_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="verify='/no/such.pem': no CA bundle"):
        ClientConfig(verify="/no/such.pem")
    with pytest.raises(ConfigError, match="verify=3"):
        ClientConfig(verify=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="client_cert: no file at '/no/key.pem'"):
        cert = tmp_path / "cert.pem"
        cert.write_text("")
        ClientConfig(client_cert=(os.fspath(cert), "/no/key.pem"))
    with pytest.raises(ConfigError, match="verify"):
        StorageOptions(verify="")


def test_a_load_opens_at_most_max_concurrency_connections(seaweed_tls: LocalS3Server, monkeypatch: Any) -> None:
    """A load of many ranged GETs through one process makes at most ``max_concurrency`` TLS handshakes.

    On SeaweedFS only: moto's server closes the connection after every answer (5 GETs of plain boto3
    open 5 connections there, over HTTP too), so it cannot show what a client keeps open."""
    https = seaweed_tls
    for name, value in https.env().items():
        monkeypatch.setenv(name, value)
    tls_bucket = https.create_bucket(f"t-{uuid.uuid4().hex[:16]}")
    state = {f"t{i}": torch.randn(64, 1024) for i in range(24)}  # 24 x 256 KiB
    uri = f"s3://{tls_bucket}/many"
    dcp.save(state, storage_writer=StorageOptions(verify=https.ca_bundle, files_per_rank=4).writer(uri), no_dist=True)
    host, port = urlsplit(https.endpoint_url).hostname, urlsplit(https.endpoint_url).port
    with ConnectionCounter((str(host), int(port or 443))) as counter:
        transfer = TransferConfig(max_concurrency=3, max_range_size=64 << 10, coalesce_gap=0)
        opts = StorageOptions(
            endpoint_url=f"https://127.0.0.1:{counter.port}", verify=https.ca_bundle, transfer=transfer
        )
        reader = opts.reader(uri)
        gets: list[str] = []
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        with hooked(reader, "before-send.s3.GetObject", lambda request, **_: gets.append(request.url)):
            dcp.load(out, storage_reader=reader, no_dist=True)
        connections = counter.connections
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert len(gets) >= 24, len(gets)
    assert 1 <= connections <= 3, f"{connections} TLS handshakes for {len(gets)} GETs (max_concurrency=3)"


def test_checkpointer_resume_and_tier_promotion(https: LocalS3Server, tls_bucket: str, tmp_path: Path) -> None:
    """The Checkpointer, its local tier's promotion to S3 and a resume elsewhere: every client gets the CA."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    root = f"s3://{tls_bucket}/run"
    ckpt = Checkpointer(root, local_root=str(tmp_path / "local"), s3_every=1, verify=https.ca_bundle)
    try:
        ckpt.save({"m": model}, {"m": optim}, iteration=5)
        ckpt.wait_promotions(timeout=120)
    finally:
        ckpt.close()
    assert any(k.startswith("run/0000005") for k in object_keys(https.client(), tls_bucket))
    fresh = torch.nn.Linear(32, 8)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    resumed = Checkpointer(root, verify=https.ca_bundle)  # S3 only: another node, no local copy
    assert resumed.load({"m": fresh}, {"m": fresh_optim}) == 5
    resumed.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))


def test_the_route_takes_the_ca(https: LocalS3Server, tls_bucket: str) -> None:
    with dcp_route.s3_route({"verify": https.ca_bundle}):
        dcp.save(_state(4), checkpoint_id=f"s3://{tls_bucket}/routed", no_dist=True)
        out = _blank()
        dcp.load(out, checkpoint_id=f"s3://{tls_bucket}/routed", no_dist=True)
    assert _same(out, _state(4))


def test_cli_verify_and_cp_take_ca_bundle(
    https: LocalS3Server, tls_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"s3://{tls_bucket}/ck"
    dcp.save(_state(5), storage_writer=StorageOptions(verify=https.ca_bundle).writer(uri), no_dist=True)
    assert cli_main(["verify", uri, "--ca-bundle", str(https.ca_bundle)]) == 0
    assert cli_main(["cp", uri, f"s3://{tls_bucket}/copy", "--ca-bundle", str(https.ca_bundle)]) == 0
    assert cli_main(["cp", uri, str(tmp_path / "local"), "--ca-bundle", str(https.ca_bundle)]) == 0
    assert _same(_load(StorageOptions(verify=https.ca_bundle), f"s3://{tls_bucket}/copy"), _state(5))
    assert _same(_load(StorageOptions(), str(tmp_path / "local")), _state(5))
    capsys.readouterr()
    assert cli_main(["verify", uri]) == 1  # the system's authorities do not know the test CA
    err = capsys.readouterr().err
    assert "not trusted" in err and "--ca-bundle" in err and "Traceback" not in err, err


@pytest.fixture
def ca_env(https: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The server's environment with its CA as ``AWS_CA_BUNDLE``, here and for children."""
    env = {**https.env(), "AWS_CA_BUNDLE": str(https.ca_bundle)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env


@pytest.mark.multiproc
def test_resharded_load(https: LocalS3Server, tls_bucket: str, ca_env: dict[str, str], tmp_path: Path) -> None:
    """FSDP2 saved on 2 gloo ranks, loaded on 1 and on 3, every request over HTTPS."""
    uri, ref = f"s3://{tls_bucket}/fsdp/step-3", str(tmp_path / "ref.pt")
    run_ranks(save_job, 2, ca_env, uri, ref)
    run_ranks(load_job, 1, ca_env, uri, ref)
    run_ranks(load_job, 3, ca_env, uri, ref)


def test_a_save_killed_during_its_commit_leaves_the_old_checkpoint(
    https: LocalS3Server, tls_bucket: str, ca_env: dict[str, str], tmp_path: Path
) -> None:
    uri = f"s3://{tls_bucket}/ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(1), storage_writer=StorageOptions().writer(uri), no_dist=True)
    child = child_save(ca_env, tmp_path, uri, 2, "commit")
    child.wait_held()
    child.kill()
    assert loaded_seed(uri) == 1  # bit-exact, the old save whole


@pytest.mark.parametrize("calculation", ["when_supported", "when_required"])
def test_uploads_send_their_crc32c_as_a_header_never_aws_chunked(
    https: LocalS3Server, tls_bucket: str, monkeypatch: pytest.MonkeyPatch, calculation: str
) -> None:
    """Over HTTPS botocore sends bodies unsigned, and streams whose checksum it must compute as ``aws-chunked``
    with a trailer (which many S3-compatible servers refuse). dcp_s3 computes each body's CRC32C itself and
    sends it as a header (``when_supported``, botocore's default) or none (``when_required``): never chunked.
    botocore before 1.36 has no such setting: the header is always sent."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", calculation)
    opts = StorageOptions(verify=https.ca_bundle, part_size=5 << 20)
    uri = f"s3://{tls_bucket}/{calculation}"
    writer = opts.writer(uri)
    uploads: list[dict[str, str]] = []

    def record(request: Any, event_name: str, **_: Any) -> None:
        if event_name.endswith((".PutObject", ".UploadPart")):
            uploads.append({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})

    state = {"big": torch.randn(3 << 20), "small": torch.randn(16)}  # a multipart data object and a PUT .metadata
    with hooked(writer, "before-send.s3", record):
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert len(uploads) >= 3, uploads
    for headers in uploads:
        assert "aws-chunked" not in headers.get("content-encoding", "") and "x-amz-trailer" not in headers, headers
        assert headers.get("x-amz-content-sha256") == "UNSIGNED-PAYLOAD", headers
        assert ("x-amz-checksum-crc32c" in headers) == (calculation == "when_supported" or not CHECKSUM_SETTING), (
            headers
        )
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=opts.reader(uri), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_overwrite_false_is_a_conditional_write(https: LocalS3Server, tls_bucket: str) -> None:
    """``overwrite=False`` commits with ``If-None-Match: *``: the second save of one location is refused."""
    opts = StorageOptions(verify=https.ca_bundle, overwrite=False)
    uri = f"s3://{tls_bucket}/once"
    dcp.save(_state(1), storage_writer=opts.writer(uri), no_dist=True)
    with pytest.raises(BaseException) as info:
        dcp.save(_state(2), storage_writer=opts.writer(uri), no_dist=True)
    assert isinstance(_root_cause(info.value), CheckpointExistsError), repr(_root_cause(info.value))
    assert _same(_load(opts, uri), _state(1))


def test_addressing_style_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """Path-style by default for a custom endpoint; ``addressing_style="virtual"`` puts the bucket in the host
    (what AWS and some appliances want); anything else is refused by name. (No DNS name here resolves a bucket
    subdomain to loopback, so the URLs are checked as botocore builds them, signed, without sending them.)"""

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")

    def url(**settings: Any) -> str:
        client = ClientConfig(endpoint_url="https://s3.example.internal", region="us-east-1", **settings).make_client()
        return str(client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": "k"}))

    assert url().startswith("https://s3.example.internal/bkt/k?")
    assert url(addressing_style="virtual").startswith("https://bkt.s3.example.internal/k?")
    with pytest.raises(ConfigError, match="addressing_style='dns'"):
        StorageOptions(addressing_style="dns")
