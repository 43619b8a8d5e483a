"""The conformance suites of :mod:`dcp_s3.testing` on a local directory, SeaweedFS and moto:
``StoreConformance`` (checkpoints through the public API) and ``ObjectStoreConformance`` (the
object-store interface), each backend plugged in only through the suites' documented fixture
(``target``, ``objstore``), as another backend would.

Each backend is reached the way a user would: the directory by its path, SeaweedFS through
the standard ``AWS_*`` environment (``AWS_ENDPOINT_URL``), moto through a credential file
(``credential_path=``, the JSON of boto3 client arguments training codebases carry).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from dcp_s3._objstore.base import ObjectStore
from dcp_s3._objstore.local import LocalObjectStore
from dcp_s3._objstore.s3 import S3ObjectStore
from dcp_s3.errors import CheckpointFormatError
from dcp_s3.testing import LocalRaw, LocalS3Server, ObjectStoreConformance, S3Raw, StoreConformance, Target


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
            "moto",
            f"s3://{bucket}/run-a",
            S3Raw(moto_server.client(), bucket, "run-a"),
            options={"credential_path": str(credentials)},
        )


# -- the object-store interface itself -----------------------------------------------------------------
class TestLocalObjectStore(ObjectStoreConformance):
    @pytest.fixture
    def objstore(self, tmp_path: Path) -> ObjectStore:
        return LocalObjectStore(tmp_path / "root")

    def test_names_that_leave_the_root_are_refused(self, tmp_path: Path) -> None:
        store = LocalObjectStore(tmp_path / "root")
        for name in ("../x", "a/../../x", "/etc/passwd", "a//b", "./a"):
            with pytest.raises(CheckpointFormatError, match="refusing object name"):
                store.put(name, b"evil")
        assert not list((tmp_path).rglob("x")) and not (tmp_path / "root").exists()


class TestSeaweedObjectStore(ObjectStoreConformance):
    @pytest.fixture
    def objstore(self, bucket: str, s3_env: LocalS3Server) -> ObjectStore:
        client = s3_env.client()
        return S3ObjectStore(lambda: client, bucket)


class TestMotoObjectStore(ObjectStoreConformance):
    @pytest.fixture
    def objstore(self, moto_server: LocalS3Server) -> ObjectStore:
        bucket = moto_server.create_bucket(f"os-{uuid.uuid4().hex[:16]}")
        client = moto_server.client()
        return S3ObjectStore(lambda: client, bucket)
