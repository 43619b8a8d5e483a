"""Model shapes of the scale benchmarks, and the ``.metadata`` each sharding of them makes.

Shared by :mod:`benchmarks.scale` and :mod:`benchmarks.scale_ranks`.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    d: int
    layers: int
    ffn: int
    vocab: int
    kv: int  # k/v projection output width (GQA)

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (self.vocab, self.d))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (self.d, self.d)),
                (p + "self_attn.k_proj.weight", (self.kv, self.d)),
                (p + "self_attn.v_proj.weight", (self.kv, self.d)),
                (p + "self_attn.o_proj.weight", (self.d, self.d)),
                (p + "mlp.gate_proj.weight", (self.ffn, self.d)),
                (p + "mlp.up_proj.weight", (self.ffn, self.d)),
                (p + "mlp.down_proj.weight", (self.d, self.ffn)),
                (p + "input_layernorm.weight", (self.d,)),
                (p + "post_attention_layernorm.weight", (self.d,)),
            ]
        out += [("norm.weight", (self.d,)), ("lm_head.weight", (self.vocab, self.d))]
        return out


MODELS = {
    "llama-7b": ModelShape("llama-7b", 4096, 32, 11008, 32000, 4096),
    "llama-70b": ModelShape("llama-70b", 8192, 80, 28672, 32000, 1024),
    "llama-405b": ModelShape("llama-405b", 16384, 126, 53248, 128256, 1024),
}


def sharded_tensors(model: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, global shape) of every dim-0-sharded tensor of the training state."""
    out = []
    for name, shape in model.params():
        out.append((f"model.{name}", shape))
        out.append((f"optim.state.{name}.exp_avg", shape))
        out.append((f"optim.state.{name}.exp_avg_sq", shape))
    return out


def shard_rows(dim0: int, ranks: int, r: int) -> tuple[int, int]:
    """(offset, rows) of rank ``r``'s shard under ``torch.chunk`` (FSDP2's rule)."""
    c = -(-dim0 // ranks)
    lo = min(r * c, dim0)
    return lo, min(lo + c, dim0) - lo


def build_metadata(model: ModelShape, ranks: int) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_s3._layout import ItemLocation

    props = TensorProperties(dtype=torch.float32)
    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    file_pos = [0] * ranks
    header = 420  # torch.save zip header of one tensor, roughly
    for fqn, shape in sharded_tensors(model):
        row = math.prod(shape[1:]) * 4
        chunks = []
        for r in range(ranks):
            off, rows = shard_rows(shape[0], ranks, r)
            offsets = torch.Size([off] + [0] * (len(shape) - 1))
            sizes = torch.Size([rows, *shape[1:]])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            length = header + rows * row + 200
            storage[MetadataIndex(fqn, offsets, r)] = ItemLocation(
                f"__{r}_0.distcp", file_pos[r], length, payload_offset=header
            )
            file_pos[r] += length
        sd_md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=chunks)
    for name, _ in model.params():  # replicated AdamW step scalars: one copy each
        fqn = f"optim.state.{name}.step"
        sd_md[fqn] = TensorStorageMetadata(
            properties=props, size=torch.Size([]), chunks=[ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
        )
        storage[MetadataIndex(fqn, torch.Size([]), 0)] = ItemLocation(
            "__0_0.distcp", file_pos[0], 600, payload_offset=420
        )
        file_pos[0] += 600
    sd_md["optim.param_groups"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.param_groups")] = ItemLocation("__0_0.distcp", file_pos[0], 900)
    planner_data = {fqn: tuple(fqn.split(".")) for fqn in sd_md}
    return Metadata(state_dict_metadata=sd_md, planner_data=planner_data, storage_data=storage)


def chunk_count(model: ModelShape, ranks: int) -> int:
    return len(sharded_tensors(model)) * ranks + len(model.params()) + 1


def measure_metadata(model: ModelShape, ranks_list: list[int], max_entries: int) -> dict[int, dict[str, Any]]:
    from dcp_s3._metadata.formats import dump_metadata, load_metadata

    out: dict[int, dict[str, Any]] = {}
    per_entry: float | None = None
    load_per_entry: float | None = None
    for n in ranks_list:
        entries = chunk_count(model, n)
        if entries <= max_entries:
            md = build_metadata(model, n)
            blob = dump_metadata(md)
            del md
            gc.collect()
            t0 = time.perf_counter()
            load_metadata(blob, "s3://sim/.metadata")
            load_s = time.perf_counter() - t0
            per_entry, load_per_entry = len(blob) / entries, load_s / entries
            out[n] = {"bytes": len(blob), "entries": entries, "load_s": load_s, "measured": True}
            del blob
            gc.collect()
        else:
            assert per_entry is not None and load_per_entry is not None, "raise --metadata-max-entries"
            out[n] = {
                "bytes": per_entry * entries,
                "entries": entries,
                "load_s": load_per_entry * entries,
                "measured": False,
            }
    return out


# ---------------------------------------------------------------------------------------------
# Coordinator planning
# ---------------------------------------------------------------------------------------------
