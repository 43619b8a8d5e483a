"""``finish`` commits only the write results produced for its own save's plan.

A result routed to the wrong save (an async save's queue, a framework gathering results itself) would
otherwise commit a ``.metadata`` naming another save's objects: a checkpoint mixing two saves, or one
whose objects the other save's cleanup deletes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3.errors import ConfigError

Rewrite = Callable[[list[Any], list[Any]], Sequence[Any]]

MISROUTED: dict[str, Rewrite] = {
    # the results of the earlier save this same writer made (a stale plan token)
    "same writer, earlier save": lambda earlier, own: earlier,
    # one rank's results unwrapped: no plan token at all
    "plain results": lambda earlier, own: [list(r) for r in own],
}


class Misrouting(S3StorageWriter):
    """A writer whose ``finish`` is handed ``rewrite(earlier results, this save's results)`` on its second save."""

    def __init__(self, path: str, rewrite: Rewrite) -> None:
        super().__init__(path, overwrite=True)
        self.rewrite = rewrite
        self.seen: list[Any] = []

    def finish(self, metadata: Any, results: Any) -> None:
        self.seen.append(list(results))
        if len(self.seen) == 2:
            results = self.rewrite(self.seen[0], self.seen[1])
        super().finish(metadata, results)


def load(uri: str) -> torch.Tensor:
    out = {"w": torch.zeros(256)}
    dcp.load(out, storage_reader=S3StorageReader(uri))
    return out["w"]


@pytest.mark.parametrize("case", sorted(MISROUTED))
def test_results_of_another_plan_are_refused_and_nothing_is_committed(bucket: str, case: str) -> None:
    uri = f"s3://{bucket}/misrouted-{case.replace(' ', '-').replace(',', '')}"
    writer = Misrouting(uri, MISROUTED[case])
    dcp.save({"w": torch.full((256,), 1.0)}, storage_writer=writer)
    with pytest.raises(BaseException, match=r"rank\(s\) \[0\] were not written for this save's plan") as caught:
        dcp.save({"w": torch.full((256,), 2.0)}, storage_writer=writer)
    assert "nothing was committed" in str(caught.value)
    assert torch.equal(load(uri), torch.full((256,), 1.0))  # the first save is still the checkpoint there


def test_results_of_another_writer_are_refused(bucket: str) -> None:
    other = Misrouting(f"s3://{bucket}/other", lambda earlier, own: own)
    dcp.save({"w": torch.full((256,), 5.0)}, storage_writer=other)
    uri = f"s3://{bucket}/target"
    target = Misrouting(uri, lambda earlier, own: other.seen[0])
    dcp.save({"w": torch.full((256,), 1.0)}, storage_writer=target)
    with pytest.raises(BaseException, match=r"rank\(s\) \[0\] were not written for this save's plan"):
        dcp.save({"w": torch.full((256,), 2.0)}, storage_writer=target)
    assert torch.equal(load(uri), torch.full((256,), 1.0))


def test_finish_without_a_plan_refuses_results() -> None:
    writer = S3StorageWriter("s3://bucket-a/never-planned")
    with pytest.raises(ConfigError, match=r"s3://bucket-a/never-planned.*rank\(s\) \[0\]"):
        writer.finish(None, [[]])  # type: ignore[arg-type]  # refused before the metadata is looked at
