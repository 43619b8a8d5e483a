"""planners_vector: a tensor stored as torch.chunk's split gets ``RuleChunks``, not one object per chunk,
with metadata equal to torch's ``DefaultSavePlanner``'s."""

from __future__ import annotations

import itertools
import os
import pickle
import random
import uuid

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_scale_dedup import packed
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_s3 import CheckpointFormatError, S3StorageReader, S3StorageWriter
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.compact_chunks import RuleChunks, chunk_rule, rule_chunk
from dcp_s3._planners.scale import ScalableSavePlanner
from dcp_s3._planners.vector import rule_dim

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

Box = tuple[list[int], list[int]]  # (offsets, sizes)


def item(fqn: str, size: tuple[int, ...], box: Box) -> WriteItem:
    offsets, sizes = torch.Size(box[0]), torch.Size(box[1])
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets, sizes),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(size),
        ),
    )


def split(size: tuple[int, ...], dim: int, n: int) -> list[Box]:
    """torch.chunk's split (FSDP's sharding), trailing chunks short or empty."""
    return [rule_chunk(size, dim, n, i) for i in range(n)]


def grid(size: tuple[int, int], a: int, b: int) -> list[Box]:
    return [([i * size[0] // a, j * size[1] // b], [size[0] // a, size[1] // b]) for i in range(a) for j in range(b)]


def rows(size: tuple[int, ...], cuts: list[int]) -> list[Box]:
    """Dim-0 slabs between ``cuts`` (0 and size[0] implied)."""
    edges = [0, *cuts, size[0]]
    return [([lo, *[0] * (len(size) - 1)], [hi - lo, *size[1:]]) for lo, hi in itertools.pairwise(edges)]


def plans_of(tensors: dict[str, tuple[tuple[int, ...], list[Box]]], ranks: int) -> list[SavePlan]:
    """Rank r plans box ``r % len(boxes)`` of each tensor: more ranks than boxes make replicas (HSDP)."""
    return [
        SavePlan(
            [item(fqn, size, boxes[r % len(boxes)]) for fqn, (size, boxes) in tensors.items()],
            planner_data={fqn: (fqn,) for fqn in tensors},
        )
        for r in range(ranks)
    ]


def ours_and_torchs(plans: list[SavePlan], lowest: bool = False) -> tuple[Metadata, Metadata]:
    planner = ScalableSavePlanner(enable_plan_caching=False, dedup_save_to_lowest_rank=lowest)
    ours = planner.create_global_plan(packed(plans))[1]
    theirs = DefaultSavePlanner(dedup_save_to_lowest_rank=lowest).create_global_plan(plans)[1]
    assert ours == theirs
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    for fqn, md in ours.state_dict_metadata.items():
        other = theirs.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata) and isinstance(other, TensorStorageMetadata)
        assert len(md.chunks) == len(other.chunks) and list(md.chunks) == other.chunks
        assert [md.chunks[i] for i in range(len(md.chunks))] == other.chunks
    back = pickle.loads(pickle.dumps(ours, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == theirs and back.planner_data == theirs.planner_data
    for fqn, md in back.state_dict_metadata.items():
        assert type(md.chunks) is type(ours.state_dict_metadata[fqn].chunks)  # type: ignore[union-attr]
    return ours, theirs


def chunks_of(md: Metadata) -> dict[str, object]:
    return {fqn: v.chunks for fqn, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


RULE_CASES = {
    "FSDP dim 0, even": ({"w": ((64, 7), split((64, 7), 0, 8))}, 8, 0),
    "FSDP dim 0, uneven, empty trailing shards": ({"w": ((5, 3), split((5, 3), 0, 8))}, 8, 0),
    "FSDP dim 0, short last shard": ({"w": ((17, 4), split((17, 4), 0, 8))}, 8, 0),
    "FSDP dim 1": ({"w": ((6, 20), split((6, 20), 1, 8))}, 8, 1),
    "FSDP dim 1, empty trailing shards": ({"w": ((3, 5, 2), split((3, 5, 2), 1, 8))}, 8, 1),
    "FSDP dim 2 of 3": ({"w": ((2, 3, 11), split((2, 3, 11), 2, 4))}, 4, 2),
    "1-d, uneven": ({"b": ((10,), split((10,), 0, 4))}, 4, 0),
    "HSDP 4-way shard x 2 replicas": ({"w": ((30, 4), split((30, 4), 0, 4))}, 8, 0),
    "HSDP 2-way shard x 4 replicas, dim 1": ({"w": ((4, 9), split((4, 9), 1, 2))}, 8, 1),
    "replicated everywhere": ({"w": ((3, 3), split((3, 3), 0, 1))}, 5, 0),
}


@pytest.mark.parametrize("lowest", [False, True], ids=["balanced", "lowest rank"])
@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_rule_shardings_get_rule_chunks(name: str, lowest: bool) -> None:
    tensors, ranks, dim = RULE_CASES[name]
    ours, theirs = ours_and_torchs(plans_of(tensors, ranks), lowest)
    for fqn, chunks in chunks_of(ours).items():
        n = len(chunks_of(theirs)[fqn])  # type: ignore[arg-type]
        assert type(chunks) is RuleChunks
        assert (chunks.dim, chunks.n, chunks.size) == (dim, n, tensors[fqn][0])
        assert len(pickle.dumps(chunks)) < 200  # three values, not n objects


def test_fsdp_empty_trailing_shards_are_deduplicated_into_the_rule() -> None:
    """8 ranks on 3 rows: torch keeps the three rows and one of the five empty shards (same index)."""
    ours, theirs = ours_and_torchs(plans_of({"w": ((3, 2), split((3, 2), 0, 8))}, 8))
    chunks = chunks_of(ours)["w"]
    assert type(chunks) is RuleChunks and len(chunks) == 4
    assert list(chunks)[-1] == ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([0, 2]))


LIST_CASES = {
    "2-D grid": ({"w": ((8, 6), grid((8, 6), 2, 3))}, 6),
    "uneven custom split": ({"w": ((8, 2), rows((8, 2), [3, 4]))}, 3),
    "rule-like split, one chunk one row off": ({"w": ((16, 2), rows((16, 2), [4, 8, 13]))}, 4),
    "rule split in another order": ({"w": ((8, 2), [split((8, 2), 0, 4)[i] for i in (1, 0, 2, 3)])}, 4),
}


@pytest.mark.parametrize("name", sorted(LIST_CASES))
def test_other_shardings_keep_a_list(name: str) -> None:
    tensors, ranks = LIST_CASES[name]
    plans = plans_of({**tensors, "fsdp": ((9, 3), split((9, 3), 0, ranks))}, ranks)  # beside a rule tensor
    ours, _ = ours_and_torchs(plans)
    assert type(chunks_of(ours)["w"]) is list
    assert type(chunks_of(ours)["fsdp"]) is RuleChunks


def test_hsdp_mixed_when_balancing_breaks_the_order() -> None:
    """Replicas balanced by bytes can keep a tensor's chunks out of split order; torch's metadata lists
    them in that order, so that tensor keeps a list; the others still get the rule."""
    shapes = [(f"t{i}", (s, 7)) for i, s in enumerate([1, 3, 5, 16, 64, 5, 3, 1, 16])]
    plans = plans_of({fqn: (size, split(size, 0, 3)) for fqn, size in shapes}, 6)
    ours, _ = ours_and_torchs(plans)
    kinds = {type(c) for c in chunks_of(ours).values()}
    assert kinds == {RuleChunks, list}


def test_plans_that_do_not_tile_are_still_refused() -> None:
    """Overlaps, gaps and a split along one dim that is not whole along the others are never a rule:
    they are checked (and refused) as before."""
    for boxes in (
        [([0, 0], [5, 4]), ([4, 0], [4, 4])],
        [([0, 0], [3, 4]), ([4, 0], [4, 4])],
        [([0, 0], [4, 2]), ([4, 0], [4, 2])],
        [([0, 2], [4, 2]), ([4, 2], [4, 2])],
        [([0, 0], [4, 4]), ([4, 0], [4, 2])],
        [([0, 0], [4, 4]), ([4, 2], [4, 2])],
    ):
        plans = plans_of({"w": ((8, 4), boxes)}, 2)
        with pytest.raises(CheckpointFormatError, match="do not tile"):
            ScalableSavePlanner(enable_plan_caching=False).create_global_plan(packed(plans))


def test_plan_cache_reuses_the_rule_metadata() -> None:
    """torch's plan caching: a repeated save (empty plans) and a changed one give torch's metadata."""
    tensors = {"w": ((17, 4), split((17, 4), 0, 4)), "v": ((4, 10), split((4, 10), 1, 4))}
    planner = ScalableSavePlanner()
    planner._cached_plans_key = f"rule-chunks-{uuid.uuid4()}"
    first = planner.create_global_plan(packed(plans_of(tensors, 4)))[1]
    again = planner.create_global_plan([SavePlan([], usable=False)] * 4)[1]
    theirs = DefaultSavePlanner().create_global_plan(plans_of(tensors, 4))[1]
    assert first == theirs and again == theirs
    assert all(type(c) is RuleChunks for c in chunks_of(again).values())
    changed = {"w": ((17, 4), rows((17, 4), [5, 9, 13])), "v": tensors["v"]}
    new = planner.create_global_plan(packed(plans_of(changed, 4)))[1]
    assert new == DefaultSavePlanner().create_global_plan(plans_of(changed, 4))[1]
    assert type(chunks_of(new)["w"]) is list and type(chunks_of(new)["v"]) is RuleChunks


def _arrays(boxes: list[Box], dims: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([b[0] for b in boxes], np.int64).reshape(len(boxes), dims),
        np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), dims),
    )


def test_rule_dim_agrees_with_the_compact_encoder() -> None:
    """``rule_dim`` on arrays decides as ``compact_chunks.chunk_rule`` on objects, on rule splits, their
    near misses and random boxes (the writer's compact format then stores the same rule)."""
    rng = random.Random(14)
    sizes = [(0,), (1,), (7,), (0, 3), (3, 0), (1, 1), (5, 3), (2, 9), (4, 4, 2), (1, 6, 1)]
    cases: list[tuple[tuple[int, ...], list[Box]]] = []
    for size in sizes:
        for dim, n in itertools.product(range(len(size)), (1, 2, 3, 4, 7)):
            boxes = split(size, dim, n)
            cases.append((size, boxes))
            for _ in range(3):  # one number off by one, or two chunks swapped
                bad = [([*o], [*s]) for o, s in boxes]
                k, j = rng.randrange(n), rng.randrange(len(size))
                bad[k][rng.randrange(2)][j] += rng.choice((-1, 1))
                cases.append((size, bad))
                if n > 1:
                    swapped = list(boxes)
                    swapped[0], swapped[-1] = swapped[-1], swapped[0]
                    cases.append((size, swapped))
        for _ in range(5):
            cases.append(
                (
                    size,
                    [
                        ([rng.randrange(d + 1) for d in size], [rng.randrange(d + 1) for d in size])
                        for _ in range(rng.randrange(1, 4))
                    ],
                )
            )
    decided = set()
    for size, boxes in cases:
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        want = chunk_rule(torch.Size(size), chunks)
        got = rule_dim(size, *_arrays(boxes, len(size)))
        assert got == (None if want is None else want["dim"]), (size, boxes)
        if got is not None:
            assert RuleChunks(torch.Size(size), got, len(boxes)) == chunks
        decided.add(got is None)
    assert decided == {True, False}
    scalar = np.zeros((1, 0), np.int64)
    assert (
        rule_dim((), scalar, scalar)
        == -1
        == chunk_rule(torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])["dim"]
    )
    assert rule_dim((), np.zeros((2, 0), np.int64), np.zeros((2, 0), np.int64)) is None


# --- real processes: dcp.save with RuleChunks in the global metadata, stored in the stock format as lists ----

E2E = {"rows": ((7, 3), 0), "cols": ((2, 5), 1), "tiny": ((1, 4), 0)}  # 3 ranks: short and empty trailing shards


def e2e_state(mesh: object, rank: int, world: int, zeros: bool = False) -> dict[str, object]:
    sd: dict[str, object] = {}
    for name, (shape, dim) in E2E.items():
        g = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) / 3 + len(name)
        pieces = torch.tensor_split(g, [min(i * -(-shape[dim] // world), shape[dim]) for i in range(1, world)], dim)
        local = torch.zeros_like(pieces[rank]) if zeros else pieces[rank].clone()
        sd[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=g.shape, stride=g.stride())
    return sd


def e2e_job(rank: int, world: int, env: dict[str, str], uri: str) -> list[str]:
    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    kinds = []
    for fmt in ("dcp", "compact"):
        md = dcp.save(
            e2e_state(mesh, rank, world),
            planner=ScalableSavePlanner(),
            storage_writer=S3StorageWriter(f"{uri}/{fmt}", metadata_format=fmt),
        )
        kinds += [type(v.chunks).__name__ for v in md.state_dict_metadata.values()]  # as dcp.save hands it out
        out = e2e_state(mesh, rank, world, zeros=True)
        dcp.load(out, storage_reader=S3StorageReader(f"{uri}/{fmt}"))
        want = e2e_state(mesh, rank, world)
        assert all(torch.equal(out[k].to_local(), want[k].to_local()) for k in E2E), fmt  # type: ignore[attr-defined]
    return kinds


@pytest.mark.multiproc
def test_save_with_rule_chunks_stores_torchs_metadata(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/rule"
    for kinds in run_ranks(e2e_job, 3, s3_env.env(), uri, timeout=300):
        assert kinds == ["RuleChunks"] * 6  # on every rank, after torch's broadcast of the metadata
    stock = pickle.loads(s3_env.client().get_object(Bucket=bucket, Key="rule/dcp/.metadata")["Body"].read())
    compact = S3StorageReader(f"{uri}/compact").read_metadata()
    for md in (stock, compact):
        assert list(md.state_dict_metadata) == list(E2E)
        for name, (shape, dim) in E2E.items():
            chunks = md.state_dict_metadata[name].chunks
            assert list(chunks) == list(RuleChunks(torch.Size(shape), dim, len(chunks)))
    assert all(type(v.chunks) is list for v in stock.state_dict_metadata.values())  # torch's format, any reader
    assert [len(v.chunks) for v in stock.state_dict_metadata.values()] == [3, 3, 2]  # tiny: one empty shard kept
