"""Absent is not unavailable: a step whose objects answer a server or network error is never skipped for an
older one; only proof (a 404, a malformed marker) skips a step (issue 50, item 6)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fault_proxy import FaultProxy, Rule

from dcp_s3 import ClientConfig, S3TransferError
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._local_server import LocalS3Server

pytestmark = pytest.mark.torch_range

FAST = {"client": ClientConfig(retry_attempts=2, read_timeout=1.0, connect_timeout=2.0, throttle_deadline=2.0)}


def _saved(bucket: str, steps: tuple[int, ...] = (100, 200)) -> dict[int, dict[str, torch.Tensor]]:
    states = {}
    for it in steps:
        torch.manual_seed(it)
        model = torch.nn.Linear(4, 3)
        Checkpointer(f"s3://{bucket}/run").save({"model": model}, iteration=it)
        Checkpointer(f"s3://{bucket}/run").save({"model": model}, iteration=it)  # a re-save: generation dirs
        states[it] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


@pytest.mark.parametrize(
    ("op", "fault"),
    [
        ("GetObject", "500"),  # a 500 on every attempt of the marker's GET
        ("HeadObject", "500"),
        ("GetObject", "stall"),  # an answer held past read_timeout
        ("GetObject", "503"),  # throttled past throttle_deadline
    ],
)
def test_an_unreadable_newest_step_raises_rather_than_rolling_back(
    s3_env: LocalS3Server, bucket: str, op: str, fault: str
) -> None:
    _saved(bucket)
    rule = Rule({op}, fault, key_contains="run/0000200.pth", stall_s=3.0)
    with FaultProxy(s3_env.endpoint_url, [rule]) as proxy:
        ckpt = Checkpointer(f"s3://{bucket}/run", endpoint_url=proxy.url, **FAST)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "falling back to step 100" warning either
            with pytest.raises(S3TransferError) as info:
                ckpt.load({"model": torch.nn.Linear(4, 3)})
    assert rule.injected > 0
    assert "0000200.pth" in str(info.value)


def test_a_malformed_newest_marker_is_skipped_with_a_warning(s3_env: LocalS3Server, bucket: str) -> None:
    states = _saved(bucket)
    s3_env.client().put_object(Bucket=bucket, Key="run/0000200.pth", Body=b"not a torch file")
    model = torch.nn.Linear(4, 3)
    with pytest.warns(RuntimeWarning, match="0000200.pth is refused"):
        assert Checkpointer(f"s3://{bucket}/run").load({"model": model}) == 100
    torch.testing.assert_close(model.state_dict(), states[100], rtol=0, atol=0)


def test_the_newest_step_loads_once_the_server_answers(s3_env: LocalS3Server, bucket: str) -> None:
    states = _saved(bucket)
    rule = Rule({"GetObject"}, "500", key_contains="run/0000200.pth", max_per_request=1)  # transient: one 500
    with FaultProxy(s3_env.endpoint_url, [rule]) as proxy:
        model = torch.nn.Linear(4, 3)
        assert Checkpointer(f"s3://{bucket}/run", endpoint_url=proxy.url, **FAST).load({"model": model}) == 200
    assert rule.injected == 1
    torch.testing.assert_close(model.state_dict(), states[200], rtol=0, atol=0)
