"""The byte plan of a Hugging Face export (``dcp_s3._dcp.hf_export_plan``), checked by building the files
it describes from each rank's piece bytes in memory and reading them with the released ``safetensors``:
whole-row chunks are one span each, column chunks one run per row, and a plan that covers a tensor twice
or not at all is refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_s3._dcp.hf_export_plan import ExportPlan, plan_export
from dcp_s3.errors import ConfigError


def _item(name: str, full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(name, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=full.dtype),
            size=full.shape,
        ),
    )


def _chunk(full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    out = full
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        out = out.narrow(d, o, s)
    return out.contiguous()


def _build(plan: ExportPlan, full: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Each rank's piece as its chunks' bytes in the planned order, then each file from its pieces."""
    objects = {}
    for rank in plan.ranks:
        chunks = []
        for name, offsets in rank.order:
            t = full[name]
            sizes = next(s for o, s in _CHUNKS[name] if o == offsets)
            chunks.append(_chunk(t, offsets, sizes).view(-1).view(torch.uint8).numpy().tobytes())
        objects[rank.name] = b"".join(chunks)
        assert len(objects[rank.name]) == rank.size
    return {
        name: b"".join(p if isinstance(p, bytes) else objects[p.key][p.start : p.end] for p in pieces)
        for name, pieces in plan.files
    }


_CHUNKS: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}


def _plans(full: dict[str, torch.Tensor], layout: dict[str, list[list[tuple[tuple[int, ...], tuple[int, ...]]]]]):
    _CHUNKS.clear()
    plans = [SavePlan([]), SavePlan([])]
    for name, per_rank in layout.items():
        for rank, chunks in enumerate(per_rank):
            for offsets, sizes in chunks:
                _CHUNKS.setdefault(name, []).append((offsets, sizes))
                plans[rank].items.append(_item(name, full[name], offsets, sizes))
    return plans


def test_row_and_column_chunks_build_the_full_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    full = {
        "rows": torch.randn(6, 5, generator=g),
        "cols": torch.randn(4, 6, generator=g).bfloat16(),
        "cube": torch.arange(2 * 3 * 4, dtype=torch.int64).reshape(2, 3, 4),
        "rep": torch.tensor([7.0]),
    }
    layout = {
        "rows": [[((0, 0), (3, 5))], [((3, 0), (3, 5))]],  # Shard(0)
        "cols": [[((0, 0), (4, 3))], [((0, 3), (4, 3))]],  # Shard(1): one run per row
        "cube": [[((0, 0, 0), (2, 3, 2))], [((0, 0, 2), (2, 3, 2))]],  # Shard(2)
        "rep": [[((0,), (1,))], []],  # replicated, deduplicated to rank 0
    }
    plan = plan_export(_plans(full, layout), 1 << 30, "stage")
    (name, pieces), *_ = plan.files
    assert name == "model-00001-of-00001.safetensors"
    rows_spans = [p for p in pieces[1:3]]
    assert [p.key for p in rows_spans] == ["stage/rank-00000", "stage/rank-00001"]  # one span per rank
    got = load(_build(plan, full)[name])
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    assert plan.weight_map == dict.fromkeys(full, name)
    assert plan.total_size == sum(v.nbytes for v in full.values())


def test_files_split_at_max_shard_size() -> None:
    full = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    layout = {k: [[((0,), (256,))], []] for k in full}
    plan = plan_export(_plans(full, layout), 2048, "stage")
    assert [n for n, _ in plan.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    files = _build(plan, full)
    for name in files:
        for k, v in load(files[name]).items():
            assert plan.weight_map[k] == name and torch.equal(v, full[k])


@pytest.mark.parametrize(
    "layout",
    [
        [[((0, 0), (3, 5))], []],  # rows 3-5 missing
        [[((0, 0), (4, 5))], [((3, 0), (3, 5))]],  # row 3 twice
    ],
)
def test_a_tensor_covered_twice_or_not_at_all_is_refused(layout: list) -> None:
    full = {"a": torch.ones(1), "w": torch.randn(6, 5)}
    with pytest.raises(ConfigError, match="'w'"):
        plan_export(_plans(full, {"a": [[((0,), (1,))], []], "w": layout}), 1 << 30, "stage")


def test_byte_items_are_refused() -> None:
    plan = SavePlan([WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)])
    with pytest.raises(ConfigError, match="'step'"):
        plan_export([plan], 1 << 30, "stage")
