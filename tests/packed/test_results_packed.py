"""Write results gathered as arrays (``PackedResults``) and the compact ``.metadata`` encoded from them:
the same results after a pickle round trip, and the same bytes as encoding the ``storage_data`` dict."""

from __future__ import annotations

import copy
import math
import pickle
import re
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from dcp_s3._codec import CODEC_NAME, CODEC_VERSION, GROUP_FLOAT, FrameIndex
from dcp_s3._layout import CODEC_DESCRIPTOR, ItemLocation
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.compact_chunks import RuleChunks
from dcp_s3._metadata.compact_write import dump_compact
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._packed.results import PackedResults
from dcp_s3._torch_compat import _StorageInfo
from dcp_s3.errors import ConfigError
from tests.metadata.test_metadata_compact import fsdp_chunks, hand_built

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

S = torch.Size


def per_rank(md: Metadata) -> list[list[WriteResult]]:
    """``md.storage_data`` as the write results of the ranks named in its object names (``__<r>_``)."""
    ranks: dict[int, list[WriteResult]] = {}
    for index, info in md.storage_data.items():
        match = re.search(r"__(\d+)_", info.relative_path)
        assert match
        ranks.setdefault(int(match.group(1)), []).append(WriteResult(index, info.length, info))
    return [ranks.get(r, []) for r in range(max(ranks) + 1)]


def fsdp(ranks: int, compressed: bool = False, blocks: int | None = None) -> Metadata:
    """An FSDP-like metadata: every tensor torch.chunk-split over ``ranks`` (some on dim 1, some uneven
    with empty trailing chunks), every chunk stored by its rank (``blocks``: raw items checksummed in blocks
    of that many bytes, format ``dcp_s3/2``)."""
    shapes = {"emb": ((100, 8), 0), "w": ((64, 64), 0), "norm": ((7,), 0), "cols": ((3, 70), 1), "bias": ((1,), 0)}
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    pos = [0] * ranks
    for fqn, (shape, dim) in shapes.items():
        chunks = fsdp_chunks(shape, ranks, dim)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), S(shape), chunks)
        seen = set()
        for r, c in enumerate(chunks):
            if tuple(c.offsets) in seen:  # empty trailing chunks share offsets: stored once, by the first
                continue
            seen.add(tuple(c.offsets))
            nbytes = c.sizes.numel() * 4
            length = nbytes + 64
            extra: dict[str, Any] = {"payload_offset": 64, "crc32c": (r * 7919 + pos[r]) % (1 << 32)}
            if blocks is not None:
                count = max(1, -(-nbytes // blocks))
                extra["block_size"] = blocks
                extra["block_crc32c"] = (
                    tuple((pos[r] * 31 + i) % (1 << 32) for i in range(count)) if count > 1 else None
                )
            if compressed:
                ends = tuple(range(9, 9 * (-(-nbytes // 64)) + 1, 9))
                extra = {
                    "frames": FrameIndex(CODEC_NAME, CODEC_VERSION, 4, GROUP_FLOAT, nbytes, 64, ends, int(bool(ends))),
                    "frame_crc32c": tuple(range(len(ends))),
                    "crc32c": None,
                }
                length = ends[-1] if ends else 0
            storage[MetadataIndex(fqn, c.offsets, 0)] = ItemLocation(
                f"p-{r % 4}/__{r}_0.0123456789abcdef.distcp",
                pos[r],
                length,
                [CODEC_DESCRIPTOR] if compressed else None,
                **extra,
            )
            pos[r] += length
    return Metadata(state_dict_metadata=state, planner_data={}, storage_data=storage)


def test_pack_round_trips_through_pickle() -> None:
    md = hand_built()
    for results in per_rank(md):
        packed = PackedResults.pack(results)
        again = pickle.loads(pickle.dumps(packed))
        assert list(again) == results and len(again) == len(results)
        assert again == results and again[0] == results[0] and again[-1:] == results[-1:]
    big = per_rank(fsdp(8, compressed=True))
    for results in big:
        packed = PackedResults.pack(results)
        assert isinstance(packed, PackedResults) and not packed.extras
        assert b"FrameIndex" not in pickle.dumps(packed)  # frame indexes travel as arrays too
        again = pickle.loads(pickle.dumps(packed))
        assert list(again) == results
        assert [type(r.storage_data.transform_descriptors) for r in again] == [list] * len(results)


def test_results_that_do_not_fit_ride_along_in_place() -> None:
    rows = [
        WriteResult(MetadataIndex("w", S([i, 0]), i), 10, ItemLocation("__0_0.distcp", 10 * i, 10, crc32c=i))
        for i in range(4)
    ]
    frames = FrameIndex(CODEC_NAME, CODEC_VERSION, 4, GROUP_FLOAT, 8, 4, (3, 9), 0b10)
    odd = [
        WriteResult(MetadataIndex("bytes"), 5, ItemLocation("__0_0.distcp", 40, 5)),  # no offset: a byte item
        WriteResult(MetadataIndex("t", S([0])), 5, _StorageInfo("__0_0.distcp", 45, 5)),  # not ours
        WriteResult(
            MetadataIndex("z", S([0])), 9, ItemLocation("__0_0.distcp", 50, 9, frames=frames, frame_crc32c=(1,))
        ),
    ]  # one CRC for two frames
    results = rows[:2] + odd[:1] + rows[2:] + odd[1:]
    packed = PackedResults.pack(results)
    assert isinstance(packed, PackedResults) and [p for p, _ in packed.extras] == [2, 5, 6]
    assert list(pickle.loads(pickle.dumps(packed))) == results
    assert PackedResults.pack(odd) == odd and type(PackedResults.pack(odd)) is list  # nothing fits: the list


@pytest.mark.parametrize(
    "make",
    [hand_built, lambda: fsdp(16), lambda: fsdp(5, compressed=True), lambda: fsdp(6, blocks=256)],
    ids=["every kind", "fsdp 16 ranks", "fsdp compressed", "fsdp block checksums"],
)
def test_encoding_from_results_gives_the_same_bytes(make: Any) -> None:
    md = make()
    want = dump_compact(md)
    ranks = per_rank(md)
    for packer in (PackedResults.pack, lambda r: r):  # packed, and plain lists as another writer's
        bare = copy.copy(md)
        bare.storage_data = None  # not read: the results are the storage entries
        assert dump_compact(bare, [packer(r) for r in ranks]) == want
    view = load_metadata(want, "x")
    assert dict(view.storage_data.items()) == md.storage_data


def test_rule_chunks_from_the_planner_encode_as_the_list() -> None:
    md = fsdp(12)
    lazy = Metadata(
        {
            k: TensorStorageMetadata(v.properties, v.size, RuleChunks(v.size, 1 if k == "cols" else 0, 12))
            for k, v in md.state_dict_metadata.items()
        },
        {},
        md.storage_data,
    )
    assert dump_compact(lazy) == dump_compact(md)
    assert dump_compact(lazy, [PackedResults.pack(r) for r in per_rank(md)]) == dump_compact(md)


def test_a_later_result_for_the_same_chunk_wins_as_in_a_dict() -> None:
    md = fsdp(4)
    ranks = per_rank(md)
    first = ranks[1][0]
    info = first.storage_data
    again = WriteResult(
        first.index, info.length, ItemLocation("__3_9.0123456789abcdef.distcp", 5, info.length, crc32c=9)
    )
    ranks[3].append(again)
    storage = {r.index: r.storage_data for rank in ranks for r in rank}
    want = dump_compact(Metadata(md.state_dict_metadata, {}, storage))
    assert dump_compact(md, [PackedResults.pack(r) for r in ranks]) == want
    assert load_metadata(want, "x").storage_data[first.index].relative_path == "__3_9.0123456789abcdef.distcp"


@pytest.mark.parametrize("wrong", ["unknown tensor", "between chunks", "past the end", "other dim", "ndim"])
def test_results_the_format_cannot_describe_are_refused_as_from_a_dict(wrong: str) -> None:
    md = fsdp(4)
    ranks = per_rank(md)
    bad = {
        "unknown tensor": MetadataIndex("nope", S([0, 0])),
        "between chunks": MetadataIndex("w", S([3, 0])),
        "past the end": MetadataIndex("w", S([80, 0])),
        "other dim": MetadataIndex("w", S([16, 1])),
        "ndim": MetadataIndex("w", S([16])),
    }[wrong]
    ranks[2] = [WriteResult(bad, 4, ItemLocation("__2_0.0123456789abcdef.distcp", 0, 4)) for _ in range(3)]
    storage = {r.index: r.storage_data for rank in ranks for r in rank}
    with pytest.raises(ConfigError) as from_dict:
        dump_compact(Metadata(md.state_dict_metadata, {}, storage))
    with pytest.raises(ConfigError) as from_results:
        dump_compact(md, [PackedResults.pack(r) for r in ranks])
    assert str(from_results.value) == str(from_dict.value)
    assert bad.fqn in str(from_results.value)


def test_chunks_listed_explicitly_are_found_by_their_offsets() -> None:
    grid = [ChunkStorageMetadata(S([r, c]), S([2, 3])) for r in (0, 2) for c in (0, 3)]
    state = {"grid": TensorStorageMetadata(TensorProperties(dtype=torch.float32), S([4, 6]), grid)}
    storage = {
        MetadataIndex("grid", c.offsets, i): ItemLocation(f"__{i}_0.0123456789abcdef.distcp", 0, 24, crc32c=i)
        for i, c in enumerate(grid)
    }
    md = Metadata(state, {}, storage)
    assert dump_compact(md, [PackedResults.pack(r) for r in per_rank(md)]) == dump_compact(md)


SHAPES = {"emb": (37, 6), "w": (16, 16), "norm": (3,)}


def fsdp_state(mesh: Any, rank: int, world: int, zeros: bool = False) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Any] = {}
    for name, shape in SHAPES.items():
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) / (3 + len(name))
        pieces = list(torch.chunk(full, world))
        local = pieces[rank] if rank < len(pieces) else full[full.shape[0] :]
        local = torch.zeros_like(local) if zeros else local.clone()
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    out["step"] = 0 if zeros else 7
    return out


def compact_save_job(rank: int, world: int, env: dict[str, str], uri: str) -> list[tuple[str, int, int, bool]]:
    """Saves (compact twice: the second from torch's plan cache; then stock) and what each rank got back."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_s3 import S3StorageReader, S3StorageWriter, ScalableLoadPlanner, ScalableSavePlanner

    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    seen = []
    for fmt in ("compact", "compact", "dcp"):
        writer = S3StorageWriter(f"{uri}/{fmt}", metadata_format=fmt)
        md = dcp.save(fsdp_state(mesh, rank, world), storage_writer=writer, planner=ScalableSavePlanner())
        stored = S3StorageReader(f"{uri}/{fmt}").read_metadata()
        same = md.state_dict_metadata == stored.state_dict_metadata and dict(md.storage_data.items()) == dict(
            stored.storage_data.items()
        )
        body = writer._session.object_store.get(writer._session.key(".metadata"))
        seen.append((type(md.storage_data).__name__, len(pickle.dumps(md)), len(body), same))
        out = fsdp_state(mesh, rank, world, zeros=True)
        dcp.load(out, storage_reader=S3StorageReader(f"{uri}/{fmt}"), planner=ScalableLoadPlanner())
        want = fsdp_state(mesh, rank, world)
        assert all(torch.equal(out[k].to_local(), want[k].to_local()) for k in SHAPES) and out["step"] == 7
    return seen


@pytest.mark.multiproc
def test_every_rank_gets_the_committed_compact_metadata_as_its_bytes(bucket: str, s3_env: LocalS3Server) -> None:
    """torch broadcasts the metadata ``finish`` committed to every rank: compact, it travels as the
    committed bytes (not one pickled object per item) and equals what a reader loads."""
    seen = run_ranks(compact_save_job, 4, s3_env.env(), f"s3://{bucket}/packed", timeout=300)
    for rank_seen in seen:
        for kind, pickled, body, same in rank_seen[:2]:
            assert kind == "CompactStorage" and same
            assert pickled < body + 2048  # the bytes, the tensor table and the rules: no per-item objects
        kind, _, _, same = rank_seen[2]
        assert kind == "dict" and same
