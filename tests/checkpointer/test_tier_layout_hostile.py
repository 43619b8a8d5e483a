"""A local-tier marker's shard layout is stored bytes: a lying one is refused before it becomes metadata
(alone, and merged with the other ranks' for a resharded load)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_s3._checkpointer.local_layout import globalize
from dcp_s3._checkpointer.tier_reshard import _check_cover
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
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes],
    )


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


@pytest.mark.timeout(60)
def test_the_cover_check_of_shards_along_dimension_1_is_not_quadratic() -> None:
    """Shards along dimension 1 (every chunk at row 0) once made the check compare every pair: 20,000 of them
    took minutes. A crafted merge of that shape — an exact tiling, the same with one overlap, with one gap —
    is decided in well under the hang guard, with the same verdicts."""
    n = 20_000
    tiles = [([0, i], [4, 1]) for i in range(n)]
    _check_cover("w", _chunks([4, n], tiles), "root")
    with pytest.raises(CheckpointFormatError, match="overlap"):
        _check_cover("w", _chunks([4, n], [*tiles[:-2], ([0, n - 2], [4, 2]), ([0, n - 1], [4, 1])]), "root")
    with pytest.raises(CheckpointFormatError, match=f"cover {4 * (n - 1)} of its {4 * n}"):
        _check_cover("w", _chunks([4, n], tiles[:-1]), "root")
    # Not a grid (rows of different splits), still refused or accepted without comparing every pair.
    rows = [([0, i], [2, 1]) for i in range(n)] + [([2, 2 * i], [2, 2]) for i in range(n // 2)]
    _check_cover("w", _chunks([4, n], rows), "root")


def test_the_cover_check_agrees_with_counting_every_element() -> None:
    """Random shardings of small tensors (grids, grids with a shard split again or moved), against a count of
    how often each element is covered: accepted iff every element is covered exactly once."""
    rng = random.Random(35)
    for _ in range(400):
        size = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        cuts = [sorted({0, d, *(rng.randint(0, d) for _ in range(2))}) for d in size]
        boxes = [
            ([c[0] for c in cell], [c[1] - c[0] for c in cell])
            for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
        ]
        for _ in range(rng.randint(0, 2)):  # damage: move, grow or drop one shard (kept inside the tensor)
            i = rng.randrange(len(boxes))
            o, s = boxes[i]
            k = rng.randrange(len(size))
            o, s = list(o), list(s)
            o[k] = rng.randint(0, size[k] - 1)
            s[k] = rng.randint(0, size[k] - o[k])
            boxes[i] = (o, s)
        count = torch.zeros(size, dtype=torch.int32)
        for o, s in boxes:
            count[tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))] += 1
        exact = bool((count == 1).all())
        try:
            _check_cover("w", _chunks(size, boxes), "root")
            verdict = True
        except CheckpointFormatError:
            verdict = False
        assert verdict == exact, (size, boxes)
