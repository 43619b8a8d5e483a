"""The conformance suites of :mod:`dcp_s3.testing` (checkpoints, and the object-store interface)
against any S3 server named by environment variables.

Not collected by a plain ``python -m pytest`` (the file name does not start with ``test_``);
``tests/compat/run_servers.py`` starts each server and runs::

    DCP_S3_COMPAT_ENDPOINT=http://127.0.0.1:PORT DCP_S3_COMPAT_ACCESS_KEY=... \\
    DCP_S3_COMPAT_SECRET_KEY=... DCP_S3_COMPAT_BUCKET=... \\
    python -m pytest tests/compat/conformance_external.py

Every test gets a fresh prefix in the one bucket (some servers serve a single bucket). The
server is reached the way a user names an endpoint: ``endpoint_url=`` as a storage option,
keys from the standard environment variables.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from dcp_s3._objstore import ObjectStore
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3.testing import ObjectStoreConformance, S3Raw, StoreConformance, Target

ENV = ("DCP_S3_COMPAT_ENDPOINT", "DCP_S3_COMPAT_ACCESS_KEY", "DCP_S3_COMPAT_SECRET_KEY", "DCP_S3_COMPAT_BUCKET")


def _server(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, Any]:
    """(endpoint, bucket, boto3 client) of the server named by the environment."""
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        pytest.fail(f"set {', '.join(missing)} (tests/compat/run_servers.py does)", pytrace=False)
    endpoint, access, secret, bucket = (os.environ[name] for name in ENV)
    region = os.environ.get("DCP_S3_COMPAT_REGION", "us-east-1")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", region)

    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=access,
        aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": "path"}),
    )
    return endpoint, bucket, client


class TestExternalServer(StoreConformance):
    @pytest.fixture
    def target(self, monkeypatch: pytest.MonkeyPatch) -> Target:
        endpoint, bucket, client = _server(monkeypatch)
        prefix = f"conf-{uuid.uuid4().hex[:12]}"
        name = os.environ.get("DCP_S3_COMPAT_NAME", endpoint)
        return Target(
            name, f"s3://{bucket}/{prefix}", S3Raw(client, bucket, prefix), options={"endpoint_url": endpoint}
        )


class TestExternalObjectStore(ObjectStoreConformance):
    """The object-store interface on the server (what it lacks is recorded, not failed)."""

    strict = False

    @pytest.fixture
    def objstore(self, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
        _, bucket, client = _server(monkeypatch)
        return S3ObjectStore(lambda: client, bucket)

    @pytest.fixture
    def base(self) -> str:
        return f"os-{uuid.uuid4().hex[:12]}/"
