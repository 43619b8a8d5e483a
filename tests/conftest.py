"""Shared fixtures: one real S3 server per test session, a fresh bucket per test."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from dcp_s3._local_server import LocalS3Server


@pytest.fixture(scope="session")
def seaweed() -> Iterator[LocalS3Server]:
    """SeaweedFS on 127.0.0.1: behaves like AWS (multipart, ranges, conditional writes, checksums)."""
    with LocalS3Server.start("seaweedfs") as server:
        yield server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[LocalS3Server]:
    """moto's server mode: fast, validates nothing."""
    with LocalS3Server.start("moto") as server:
        yield server


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """A throw-away certificate authority of this test session and a certificate it signed for 127.0.0.1:
    (certificate chain, private key, CA bundle) PEM paths."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    where = tmp_path_factory.mktemp("tls")
    chain, key, bundle = (os.fspath(where / name) for name in ("chain.pem", "key.pem", "ca.pem"))
    with open(chain, "wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    cert.private_key_pem.write_to_path(key)
    ca.cert_pem.write_to_path(bundle)
    return chain, key, bundle


@pytest.fixture(scope="session")
def seaweed_tls(tls_files: tuple[str, str, str]) -> Iterator[LocalS3Server]:
    """SeaweedFS serving S3 over HTTPS with the session's CA (``ca_bundle`` verifies it)."""
    with LocalS3Server.start("seaweedfs", tls=tls_files) as server:
        yield server


@pytest.fixture(scope="session")
def moto_tls(tls_files: tuple[str, str, str]) -> Iterator[LocalS3Server]:
    """moto's server over HTTPS with the session's CA."""
    with LocalS3Server.start("moto", tls=tls_files) as server:
        yield server


@pytest.fixture
def rank_tmp() -> Iterator[Path]:
    """A short directory for ranks' ``TMPDIR``: multiprocessing binds Unix sockets there (torch's upload
    process, shared tensors), and a socket path has at most 107 bytes, which a pytest ``tmp_path`` with
    ``pymp-*/listener-*`` under it can exceed (``pytest-106/popen-gw0/test_async_with_pinned_mem_sav0/...``)."""
    path = Path(tempfile.mkdtemp(prefix="dcp-s3-rank-tmp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def s3_env(seaweed: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> LocalS3Server:
    """Point the standard boto3 chain (env vars incl. AWS_ENDPOINT_URL) at SeaweedFS."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return seaweed


@pytest.fixture
def bucket(s3_env: LocalS3Server) -> str:
    name = f"t-{uuid.uuid4().hex[:16]}"
    return s3_env.create_bucket(name)


@pytest.fixture(autouse=True)
def _no_real_aws(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    # Never read the developer's ~/.aws; every test configures its own server.
    home = tmp_path_factory.mktemp("aws")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.fspath(home / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.fspath(home / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
