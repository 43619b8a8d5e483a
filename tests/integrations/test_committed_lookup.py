"""The integrations' one "committed / latest" lookup (``dcp_s3.integrations._committed``), against a real server:
absent only on proof (a 404 marker, or a marker its caller's check refuses), anything transient raises; names of
the scheme only, ordered by their ASCII numbers. Each integration's own use of it: the sweep in
``test_absent_not_unavailable_sweep.py`` and the framework tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fault_proxy import FaultProxy, Rule

from dcp_s3 import ClientConfig, S3TransferError
from dcp_s3._checkpointer.ownership import Ownership
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server
from dcp_s3.integrations import _committed as lookup

STEPS = re.compile(r"step_[0-9]+")
FAST = ClientConfig(retry_attempts=2, read_timeout=2.0, connect_timeout=2.0)


def _put(s3_env: LocalS3Server, bucket: str, keys: list[str]) -> None:
    client = s3_env.client()
    for key in keys:
        client.put_object(Bucket=bucket, Key=f"run/{key}", Body=b"{}")


def test_newest_committed_by_number_and_scheme(s3_env: LocalS3Server, bucket: str) -> None:
    _put(
        s3_env,
        bucket,
        [
            "step_9/.metadata",
            "step_10/.metadata",
            "step_11/data",  # not committed: a save in progress
            "step_\u0663\u0663/.metadata",  # Arabic-Indic digits: no step of the scheme
            "other/.metadata",
        ],
    )
    store = open_store(f"s3://{bucket}/run", endpoint_url=s3_env.endpoint_url)
    assert lookup.listed(store, STEPS) == ["step_9", "step_10", "step_11"]
    assert lookup.committed(store, STEPS) == ["step_9", "step_10"]
    assert lookup.latest(store, STEPS) == "step_10"
    assert lookup.latest(store, STEPS, accept=lambda name: name != "step_10") == "step_9"  # a malformed marker
    assert lookup.latest(store, STEPS, marker="absent") is None
    assert lookup.committed(store, lookup.ANY_NAME, order=str) == ["other", "step_10", "step_9", "step_\u0663\u0663"]


def test_an_ownership_judges_names_relative_to_the_root(s3_env: LocalS3Server, bucket: str) -> None:
    _put(s3_env, bucket, ["a/step_1/.mark", "a/step_2/.mark", "a/step_3/.metadata"])
    store = open_store(f"s3://{bucket}/run", endpoint_url=s3_env.endpoint_url)
    own = Ownership("test", store.url(""), re.compile(r"a/step_[0-9]+"), marker=".mark")
    assert lookup.committed(store, own, "a") == ["a/step_1", "a/step_2"]
    assert lookup.committed(store, STEPS, "a") == ["a/step_3"]  # a pattern: the name within the folder
    assert lookup.latest(store, own, "") is None  # "step_1" etc. are not directly in the root


@pytest.mark.parametrize("op", ["HeadObject", "ListObjects"])
def test_a_server_error_raises_never_an_older_checkpoint(s3_env: LocalS3Server, bucket: str, op: str) -> None:
    _put(s3_env, bucket, ["step_1/.metadata", "step_2/.metadata"])
    rule = Rule({op}, "500", key_contains="run/step_2/.metadata" if op == "HeadObject" else None)
    with FaultProxy(s3_env.endpoint_url, [rule]) as proxy:
        store = open_store(f"s3://{bucket}/run", endpoint_url=proxy.url, client=FAST)
        with pytest.raises(S3TransferError):
            lookup.latest(store, STEPS)
    assert rule.injected > 0


def test_no_integration_lists_committed_checkpoints_itself() -> None:
    """The integrations find committed checkpoints through the kit: no other module of theirs lists a folder's
    subdirectories (``list_dir``) to look for markers in them."""
    root = Path(__file__).resolve().parents[2] / "dcp_s3" / "integrations"
    # torch_checkpointing's Storage.listdir (what a user lists) and its one-directory probe (marker, stage, files)
    allowed = {"_committed.py", "_storage.py", "_paths.py"}
    found = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if p.name not in allowed and "list_dir(" in p.read_text()
    ]
    assert found == []
