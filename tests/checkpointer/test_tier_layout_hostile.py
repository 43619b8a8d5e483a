"""A local-tier marker's shard layout is stored bytes: a lying one is refused before it becomes metadata."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3.checkpointer.local_layout import globalize
from dcp_s3.errors import CheckpointFormatError


def _metadata() -> Metadata:
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])
    return Metadata(state_dict_metadata={"w": entry}, storage_data={})


def test_an_honest_layout_moves_the_shard_into_place() -> None:
    out = globalize(_metadata(), {"w": ([8], [4], [4])}, "rank 1")
    entry = out.state_dict_metadata["w"]
    assert list(entry.size) == [8] and list(entry.chunks[0].offsets) == [4]


@pytest.mark.parametrize(
    "spot",
    [
        ([8], [6], [4]),  # past the end of the global tensor
        ([8], [-2], [4]),  # before its start
        ([8, 2], [0, 0], [4]),  # another number of dimensions
        ([8], [1.5], [4]),  # not a whole number
        ([8], ["0"], [4]),
    ],
)
def test_a_lying_layout_is_refused(spot: tuple) -> None:
    with pytest.raises(CheckpointFormatError, match="'w'"):
        globalize(_metadata(), {"w": spot}, "rank 1")


def test_a_layout_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(CheckpointFormatError, match="no layout"):
        globalize(_metadata(), ["w"], "rank 1")
