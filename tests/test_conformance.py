"""The conformance suite (``tests/conformance.py``) on a local directory, SeaweedFS and moto.

Each backend is reached the way a user would: the directory by its path, SeaweedFS through
the standard ``AWS_*`` environment (``AWS_ENDPOINT_URL``), moto through a credential file
(``credential_path=``, the JSON of boto3 client arguments training codebases carry).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from dcp_s3.local_server import LocalS3Server
from tests.conformance import LocalRaw, S3Raw, StoreConformance, Target


class TestLocalDirectory(StoreConformance):
    @pytest.fixture
    def target(self, tmp_path: Path) -> Target:
        root = tmp_path / "store"
        return Target("local", str(root), LocalRaw(root))


class TestSeaweedFS(StoreConformance):
    @pytest.fixture
    def target(self, bucket: str, s3_env: LocalS3Server) -> Target:
        return Target("seaweedfs", f"s3://{bucket}/conf", S3Raw(s3_env.client(), bucket, "conf"))


class TestMoto(StoreConformance):
    @pytest.fixture
    def target(self, moto_server: LocalS3Server, tmp_path: Path) -> Target:
        bucket = moto_server.create_bucket(f"conf-{uuid.uuid4().hex[:16]}")
        credentials = tmp_path / "credentials.json"
        credentials.write_text(json.dumps(moto_server.credentials()))
        credentials.chmod(0o600)
        return Target(
            "moto", f"s3://{bucket}/run-a", S3Raw(moto_server.client(), bucket, "run-a"),
            options={"credential_path": str(credentials)},
        )
