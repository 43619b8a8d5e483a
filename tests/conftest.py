"""Shared fixtures: one real S3 server per test session, a fresh bucket per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from dcp_s3.local_server import LocalS3Server


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
