"""A local-tier marker's shard layout is stored bytes: a lying one is refused before it becomes metadata
(alone, and merged with the other ranks' for a resharded load)."""

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
from dcp_s3.checkpointer.tier_reshard import _check_cover
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


def _chunks(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes])


def test_merged_shards_must_cover_each_tensor_exactly_once() -> None:
    """A resharded load from the local tier merges every rank's layout: shards that leave a gap or overlap
    (lying markers that each pass on their own) are refused before the load."""
    _check_cover("w", _chunks([8], [([0], [4]), ([4], [4])]), "root")
    _check_cover("w", _chunks([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])]), "root")
    _check_cover("w", _chunks([8], [([0], [8]), ([8], [0])]), "root")  # an empty shard of an uneven split
    with pytest.raises(CheckpointFormatError, match="'w'.* cover 4 of its 8"):
        _check_cover("w", _chunks([8], [([0], [4])]), "root")
    with pytest.raises(CheckpointFormatError, match="overlap"):
        _check_cover("w", _chunks([8], [([0], [4]), ([2], [4])]), "root")
    with pytest.raises(CheckpointFormatError, match="overlap"):
        _check_cover("w", _chunks([4, 4], [([0, 0], [4, 2]), ([0, 1], [4, 2])]), "root")
