"""Per-rank ``.metadata`` work on load at 1,024 / 4,096 / 16,384 ranks: stock pickle vs compact.

    python -m benchmarks.scale_metadata                    # Llama-70B-like, FSDP and HSDP 8-way
    python -m benchmarks.scale_metadata --ranks 1024,4096  # quicker

Model and layout as ``benchmarks.scale`` (FSDP2 training state: parameters and two AdamW
moments sharded on dim 0 over all ranks with torch.chunk's rule, one replicated ``step``
per parameter, ``param_groups`` as a byte item; one data object per rank, every item with
dcp_s3's payload offset and a CRC32C). HSDP 8-way: 8 shards, so its metadata is the FSDP
metadata of 8 ranks whatever the job size, and each rank reads one shard.

Per rank, what a load costs before any data moves:

* ``.metadata`` bytes, stock pickle and compact. Stock: a real ``Metadata`` (``scale_models.build_metadata``
  plus CRCs) pickled at ``--stock-ranks`` (small) rank counts, extrapolated linearly in chunks
  (~): bytes and both unpicklers' seconds grow with chunks (see ``benchmarks/results/scale.md``).
  Compact: the real file, built at every rank count (``compact_fsdp`` writes the same bytes as
  ``layout.dump_metadata(..., "compact")`` would for that ``Metadata``; checked at 8 ranks).
* decode: the C unpickler (``pickle.loads``, unsafe on untrusted bytes), dcp_s3's restricted
  unpickler + checks (``dcp_s3.metadata.formats.load_metadata``, the stock path), and ``dcp_s3.metadata.formats.load_metadata`` on
  the compact file (measured).
* local plan of one rank (the middle one): torch's ``create_read_items_for_chunk_list`` — the
  core of ``DefaultLoadPlanner.create_local_plan`` — over every tensor on stock (list) chunks,
  timed once per distinct shape and multiplied by the tensors of that shape; and
  ``dcp_s3.planners.load.read_items_for_chunks`` (``ScalableLoadPlanner``) on the compact metadata,
  every tensor (measured). Also torch's function on the compact (lazy) chunks, per shape.
* reader set-up: ``S3StorageReader.set_up_storage_reader`` before (a dict over every chunk: the
  loop timed on one tensor's chunks per shape, times the tensors) and now (on the compact
  metadata, measured), plus the reader's lookups of this rank's items (storage entry and chunk).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import struct
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.scale_models import MODELS, ModelShape, build_metadata, sharded_tensors  # noqa: E402

HEADER, TRAILER, STEP_LEN, GROUPS_LEN = 420, 200, 600, 900  # as benchmarks.scale_models.build_metadata
HSDP_SHARD = 8
GOAL_S = 5.0


def crc_of(t: Any, r: Any) -> Any:
    """A stand-in CRC32C for item (tensor t, rank r): what a real save records, 4 random-looking bytes."""
    return (np.int64(t) * 2654435761 + np.int64(r) * 40503 + 12345) & 0xFFFFFFFF


def stock_metadata(model: ModelShape, ranks: int) -> Any:
    """``scale_models.build_metadata`` with the CRC32C every dcp_s3 tensor and byte item carries."""
    md = build_metadata(model, ranks)
    names = {fqn: t for t, fqn in enumerate(md.state_dict_metadata)}
    for index, info in md.storage_data.items():
        info.crc32c = int(crc_of(names[index.fqn], index.index or 0))
    return md


def compact_fsdp(model: ModelShape, ranks: int) -> bytes:
    """The compact ``.metadata`` of ``stock_metadata(model, ranks)``, built from arrays (no per-chunk objects)."""
    from dcp_s3.metadata.compact import FORMAT_VERSION, FRAME_COLUMNS, MAGIC, STORAGE_COLUMNS, _Arrays, tag

    tensors = sharded_tensors(model)
    params = model.params()
    arrays = _Arrays()
    props = {
        "dtype": "float32",
        "layout": "strided",
        "memory_format": "contiguous_format",
        "requires_grad": False,
        "pin_memory": False,
    }
    entries: list[dict[str, Any]] = [
        {"fqn": fqn, **props, "size": list(shape), "rule": {"dim": 0, "n": ranks}, "stored": "all"}
        for fqn, shape in tensors
    ]
    entries += [
        {"fqn": f"optim.state.{name}.step", **props, "size": [], "rule": {"dim": -1, "n": 1}, "stored": "all"}
        for name, _ in params
    ]
    entries.append({"fqn": "optim.param_groups", "bytes": 1})
    dim0 = np.array([shape[0] for _, shape in tensors], dtype=np.int64)[:, None]
    row = np.array([math.prod(shape[1:]) * 4 for _, shape in tensors], dtype=np.int64)[:, None]
    step = -(-dim0 // ranks)
    lo = np.minimum(np.arange(ranks, dtype=np.int64)[None, :] * step, dim0)
    rows = np.minimum(lo + step, dim0) - lo
    lengths = HEADER + rows * row + TRAILER
    del lo, rows
    offsets = np.cumsum(lengths, axis=0) - lengths
    end0 = int(offsets[-1, 0] + lengths[-1, 0])
    n_t, n_p = len(tensors), len(params)
    tail = np.arange(n_p + 1, dtype=np.int64)
    cols = {
        "kind": np.ones(n_t * ranks + n_p + 1, dtype=np.int64),
        "object": np.concatenate((np.tile(np.arange(ranks, dtype=np.int64), n_t), np.zeros(n_p + 1, np.int64))),
        "offset": np.concatenate((offsets.ravel(), end0 + STEP_LEN * tail)),
        "length": np.concatenate((lengths.ravel(), np.full(n_p, STEP_LEN), [GROUPS_LEN])),
        "transform": np.full(n_t * ranks + n_p + 1, -1, dtype=np.int64),
        "payload": np.concatenate((np.full(n_t * ranks + n_p, HEADER), [-1])),
        "crc": np.concatenate(
            (
                crc_of(np.arange(n_t)[:, None], np.arange(ranks)[None, :]).ravel(),
                crc_of(n_t + np.arange(n_p), 0),
                [crc_of(n_t + n_p, 0)],
            )
        ),
        "frame": np.full(n_t * ranks + n_p + 1, -1, dtype=np.int64),
        "hint": np.concatenate((np.tile(np.arange(ranks, dtype=np.int64), n_t), np.zeros(n_p, np.int64), [-1])),
    }
    del offsets, lengths
    planner = {e["fqn"]: tuple(e["fqn"].split(".")) for e in entries}
    empty = np.zeros(0, dtype=np.int64)
    header: dict[str, Any] = {
        "format": "dcp_s3.compact",
        "version": FORMAT_VERSION,
        "metadata_version": None,
        "planner_data": tag(planner),
        "storage_meta": None,
        "entries": entries,
        "chunk_offsets": arrays.add("chunk_offsets", empty.astype(np.uint64)),
        "chunk_sizes": arrays.add("chunk_sizes", empty.astype(np.uint64)),
        "stored_chunks": arrays.add("stored_chunks", empty.astype(np.uint32)),
        "storage": {
            "count": n_t * ranks + n_p + 1,
            "objects": [f"__{r}_0.distcp" for r in range(ranks)],
            "transforms": [],
            "columns": {c: arrays.column(f"s.{c}", cols.pop(c)) for c in STORAGE_COLUMNS},
            "frames": {
                "count": 0,
                "codecs": [],
                "columns": {c: {"c": 0} for c in FRAME_COLUMNS},
                "ends": arrays.add("f.ends", empty),
                "crcs": arrays.add("f.crcs", empty.astype("<u4")),
                "raw": arrays.add("f.raw", empty.astype("<u1")),
            },
        },
    }
    header["arrays"] = arrays.table
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, b"\0" * (-len(head) % 8), *arrays.parts])


def timed(fn: Any, repeat: int = 1) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure_stock(model: ModelShape, ranks_list: list[int]) -> dict[str, float]:
    """Per-chunk bytes and seconds of the stock format (fit through the measured rank counts)."""
    from dcp_s3.metadata.formats import dump_metadata, load_metadata

    points = []
    for n in ranks_list:
        md = stock_metadata(model, n)
        chunks = len(md.storage_data)
        blob = dump_metadata(md, "dcp")
        del md
        c_s, _ = timed(lambda blob=blob: pickle.loads(blob))
        r_s, _ = timed(lambda blob=blob: load_metadata(blob, "sim"))
        points.append((chunks, len(blob), c_s, r_s))
        print(
            f"  stock at {n} ranks: {chunks:,} entries, {len(blob) / 1e6:.1f} MB, C unpickle {c_s:.2f} s, "
            f"restricted {r_s:.2f} s",
            flush=True,
        )
    (c0, *v0), (c1, *v1) = points[0], points[-1]
    slopes = [(b - a) / (c1 - c0) for a, b in zip(v0, v1)]
    return {
        "entries": [p[0] for p in points],
        "bytes_per_entry": slopes[0],
        "c_s_per_entry": slopes[1],
        "restricted_s_per_entry": slopes[2],
        "base": dict(zip(("bytes", "c_s", "restricted_s"), v0)),
        "base_entries": c0,
        "measured": [dict(zip(("entries", "bytes", "c_s", "restricted_s"), p)) for p in points],
    }


def stock_at(stock: dict[str, Any], entries: int) -> dict[str, float]:
    d = entries - stock["base_entries"]
    return {k: stock["base"][k] + stock[f"{k}_per_entry"] * d for k in ("bytes", "c_s", "restricted_s")}


def local_boxes(model: ModelShape, ranks: int, r: int) -> list[tuple[str, list[int], list[int]]]:
    """(fqn, offsets, sizes) of rank ``r``'s local shard of every sharded tensor (FSDP, torch.chunk rule)."""
    from benchmarks.scale_models import shard_rows

    out = []
    for fqn, shape in sharded_tensors(model):
        lo, rows = shard_rows(shape[0], ranks, r)
        out.append((fqn, [lo] + [0] * (len(shape) - 1), [rows, *shape[1:]]))
    return out


def measure_compact(model: ModelShape, ranks: int, shards: int) -> dict[str, Any]:
    """Compact file of ``shards``-way sharding; one rank's decode, local plan, reader set-up and lookups."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from dcp_s3 import S3StorageReader
    from dcp_s3.metadata.formats import load_metadata
    from dcp_s3.planners.load import read_items_for_chunks
    from dcp_s3.untrusted.metadata_check import offsets_key

    build_s, blob = timed(lambda: compact_fsdp(model, shards))
    decode_s, md = timed(lambda: load_metadata(blob, "s3://sim/.metadata"), repeat=3)
    rank = (ranks // 2) % shards
    boxes = local_boxes(model, shards, rank)
    sizes = {fqn: shape for fqn, shape in sharded_tensors(model)}

    def plan() -> list[Any]:
        items = []
        for fqn, off, sz in boxes:
            items += read_items_for_chunks(
                fqn, md.state_dict_metadata[fqn].chunks, [ChunkStorageMetadata(torch.Size(off), torch.Size(sz))]
            )
        return items

    plan_s, items = timed(plan, repeat=3)
    reader = S3StorageReader("s3://sim/ckpt")
    setup_s, _ = timed(lambda: reader.set_up_storage_reader(md, False), repeat=3)

    def lookups() -> None:
        for item in items:
            reader.storage_data[item.storage_index]
            reader._chunks.find(item.storage_index.fqn, item.storage_index.offset or ())

    lookup_s, _ = timed(lookups)
    # Before: torch's local plan and the old set-up loop over list chunks, per distinct shape x its tensors.
    shapes = Counter(tuple(shape) for shape in sizes.values())
    default_s = default_lazy_s = old_setup_s = 0.0
    for shape, count in shapes.items():
        fqn, off, sz = next(b for b in boxes if tuple(sizes[b[0]]) == shape)
        lazy = md.state_dict_metadata[fqn]
        listed = TensorStorageMetadata(lazy.properties, lazy.size, list(lazy.chunks))
        local = [ChunkStorageMetadata(torch.Size(off), torch.Size(sz))]
        t, _ = timed(lambda: create_read_items_for_chunk_list(fqn, listed, local), repeat=3)
        default_s += t * count
        t, _ = timed(lambda: create_read_items_for_chunk_list(fqn, lazy, local), repeat=3)
        default_lazy_s += t * count

        def old_loop() -> None:
            table = {}
            for chunk in listed.chunks:
                table[(fqn, offsets_key(chunk.offsets))] = (chunk.sizes, listed.properties.dtype)

        t, _ = timed(old_loop, repeat=3)
        old_setup_s += t * count
    storage = md.storage_data
    return {
        "shards": shards,
        "compact_bytes": len(blob),
        "build_s": build_s,
        "entries": len(storage),
        "decode_s": decode_s,
        "plan_s": plan_s,
        "items": len(items),
        "setup_s": setup_s,
        "lookup_s": lookup_s,
        "default_plan_s": default_s,
        "default_plan_on_compact_s": default_lazy_s,
        "old_setup_s": old_setup_s,
        "check_item": storage[MetadataIndex(boxes[0][0], torch.Size(boxes[0][1]))] is not None,
    }


def check_builder(model: ModelShape, ranks: int) -> None:
    """``compact_fsdp`` describes exactly ``stock_metadata`` (so its sizes and timings are the real ones)."""
    from dcp_s3.metadata.formats import dump_metadata, load_metadata

    md = stock_metadata(model, ranks)
    built = load_metadata(compact_fsdp(model, ranks), "built")
    assert built == md, "compact_fsdp differs from the stock metadata"
    assert load_metadata(dump_metadata(md, "compact"), "dumped") == md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--stock-ranks", default="8,64", help="rank counts at which the stock pickle is built and timed")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "scale_metadata.json")
    args = ap.parse_args(argv)
    model = MODELS[args.model]
    ranks_list = sorted({int(x) for x in args.ranks.split(",")})
    print(f"{model.name}: {len(sharded_tensors(model))} sharded tensors; checking the compact builder ...", flush=True)
    check_builder(model, 8)
    stock = measure_stock(model, sorted({int(x) for x in args.stock_ranks.split(",")}))
    layouts: dict[str, list[dict[str, Any]]] = {"FSDP": [], f"HSDP {HSDP_SHARD}-way shard": []}
    hsdp: dict[str, Any] | None = None
    for n in ranks_list:
        print(f"  compact at {n} ranks ...", flush=True)
        rec = measure_compact(model, n, n)
        rec.update(ranks=n, stock=stock_at(stock, rec["entries"]), stock_measured=rec["entries"] in stock["entries"])
        layouts["FSDP"].append(rec)
        print(
            f"    {rec['compact_bytes'] / 1e6:.1f} MB, decode {rec['decode_s']:.3f} s, plan {rec['plan_s']:.3f} s "
            f"(torch's {rec['default_plan_s']:.1f} s), set-up {rec['setup_s'] * 1e3:.2f} ms",
            flush=True,
        )
        gc.collect()
        if hsdp is None:
            hsdp = measure_compact(model, n, HSDP_SHARD)
            hsdp.update(stock=stock_at(stock, hsdp["entries"]), stock_measured=hsdp["entries"] in stock["entries"])
        layouts[f"HSDP {HSDP_SHARD}-way shard"].append({**hsdp, "ranks": n})
    text = report(model, layouts)
    print(text)
    common.write_json(
        args.out,
        {
            "machine": common.machine_info(),
            "model": model.name,
            "stock_fit": stock,
            "layouts": layouts,
            "goal_s": GOAL_S,
        },
    )
    args.out.with_suffix(".md").write_text(text + "\n")
    return 0


def report(model: ModelShape, layouts: dict[str, list[dict[str, Any]]]) -> str:
    out = []
    for name, recs in layouts.items():
        rows = []
        for r in recs:
            s = r["stock"]
            approx = "" if r.get("stock_measured") else "~"
            rows.append(
                [
                    f"{r['ranks']:,}",
                    f"{approx}{s['bytes'] / 1e6:,.1f} → {r['compact_bytes'] / 1e6:,.1f}",
                    f"{approx}{s['c_s']:,.2f} / {approx}{s['restricted_s']:,.2f} → {r['decode_s']:.3f}",
                    f"{r['default_plan_s']:,.2f} → {r['plan_s']:.3f}",
                    f"{r['default_plan_on_compact_s']:,.2f}",
                    f"{r['old_setup_s']:,.2f} → {r['setup_s'] * 1e3:.2f} ms + {r['lookup_s']:.3f}",
                    f"{approx}{s['restricted_s'] + r['default_plan_s'] + r['old_setup_s']:,.1f} → "
                    f"{r['decode_s'] + r['plan_s'] + r['setup_s'] + r['lookup_s']:.2f}",
                ]
            )
        out.append(f"**{name}** ({model.name}; stock pickle → compact, per rank):\n")
        out.append(
            common.markdown_table(
                [
                    "ranks",
                    ".metadata MB",
                    "decode s: C unpickler / restricted → compact",
                    "local plan s: DefaultLoadPlanner → ScalableLoadPlanner",
                    "DefaultLoadPlanner on compact s",
                    "set_up_storage_reader s → now (+ item lookups s)",
                    f"metadata work s (goal ≤ {GOAL_S:g})",
                ],
                rows,
            )
        )
        out.append("")
    out.append(
        "~ = extrapolated linearly in storage entries from the stock pickle built and timed at the "
        "--stock-ranks counts (the C unpickler is not safe on untrusted bytes; dcp_s3 uses the restricted one). "
        "Every compact figure is measured on the real file at that rank count. DefaultLoadPlanner and the old "
        "set-up loop: torch's code timed once per distinct tensor shape on a list of that many chunks, times the "
        "tensors of that shape. Metadata work = decode (restricted / compact) + local plan + reader set-up and "
        "lookups of one rank, single-threaded."
    )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
