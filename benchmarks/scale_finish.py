"""The end of every save at thousands of ranks, before and after packed write results (issue 14).

    python -m benchmarks.scale_finish                                # Llama-70B-like, 1,024 / 4,096 / 16,384 ranks
    python -m benchmarks.scale_finish --ranks 256,1024 --before-max-ranks 256   # quicker

After the ranks have written, ``dcp.save`` (torch's ``_DistWrapper.all_reduce``) gathers every
rank's write results to the coordinator, which calls ``S3StorageWriter.finish`` (build the
storage entries, encode ``.metadata``, PUT it), then **broadcasts the committed ``Metadata`` to
every rank**, each of which unpickles it before ``dcp.save`` returns. This runs on every save,
the repeated ones included. Timed here with the real code on the compact format (what
``metadata_format="auto"`` writes at this size), FSDP (every tensor sharded on dim 0 over all
ranks) and HSDP (8-way shard x ranks/8 replicas, each chunk written by one replica):

* **before** (dcp_s3 until this change): each rank sends a ``list[WriteResult]``; rank 0
  unpickles them, builds the ``storage_data`` dict, encodes it entry by entry
  (``dump_compact(metadata)``); the broadcast pickles the ``Metadata`` with its chunk lists and
  the dict (one object per chunk and per entry) and every rank unpickles that. Measured up to
  ``--before-max-ranks`` on real objects, above it extrapolated linearly in entries (marked ~);
  the gathered results as one full rank's list pickled and unpickled, x ranks.
* **after**: each rank sends ``PackedResults`` (arrays); rank 0 unpickles every rank's (all of
  them, for real), encodes the columns from the arrays (``dump_compact(metadata, results)``) and
  swaps in the lazy view of the committed bytes, which the broadcast pickles as those bytes.
  The chunk lists are the planner's ``RuleChunks`` (``dcp_s3.planners.vector``). Measured at every rank
  count.

The PUT itself and the S3 side are not included (the same bytes before and after).
"""

from __future__ import annotations

import argparse
import gc
import math
import pickle
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.scale_models import MODELS, ModelShape, shard_rows, sharded_tensors  # noqa: E402
from benchmarks.scale_ranks import exponent  # noqa: E402

HSDP_SHARD = 8
FRAME = 4 << 20
TOKEN = "0123456789abcdef"


def layout(model: ModelShape, ranks: int, hsdp: bool) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """(sharded tensors, chunks per tensor)."""
    return sharded_tensors(model), HSDP_SHARD if hsdp else ranks


def writer_of(t: int, s: int, ranks: int, hsdp: bool) -> int:
    """The rank that writes chunk ``s`` of tensor ``t``: FSDP its shard's rank; HSDP one replica,
    round robin over the replicas by tensor (torch's dedup balances them by bytes)."""
    return (t % (ranks // HSDP_SHARD)) * HSDP_SHARD + s if hsdp else s


def state_metadata(model: ModelShape, ranks: int, hsdp: bool, lazy: bool) -> Any:
    """The planner's ``Metadata`` (no storage entries): ``RuleChunks`` (``lazy``) or lists."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_s3.metadata.compact_chunks import RuleChunks

    tensors, n = layout(model, ranks, hsdp)
    props = TensorProperties(dtype=torch.float32)
    state: dict[str, Any] = {}
    for fqn, shape in tensors:
        size = torch.Size(shape)
        chunks: Any = RuleChunks(size, 0, n)
        if not lazy:
            chunks = [ChunkStorageMetadata(c.offsets, c.sizes) for c in chunks]
        state[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=chunks)
    md = Metadata(state_dict_metadata=state, planner_data={fqn: tuple(fqn.split(".")) for fqn in state})
    md.version = "1.0.0"
    return md


def rank_rows(model: ModelShape, ranks: int, hsdp: bool, rank: int) -> list[tuple[str, int, int, int]]:
    """(fqn, dim-0 offset, item length, crc) of what ``rank`` writes."""
    tensors, n = layout(model, ranks, hsdp)
    out, pos = [], 0
    for t, (fqn, shape) in enumerate(tensors):
        s = rank % HSDP_SHARD if hsdp else rank
        if writer_of(t, s, ranks, hsdp) != rank:
            continue
        off, rows = shard_rows(shape[0], n, s)
        if rows == 0 and off == shape[0] and s > 0 and shard_rows(shape[0], n, s - 1)[0] == off:
            continue  # empty trailing shards: torch's dedup keeps the first
        length = rows * math.prod(shape[1:]) * 4 + 1100
        out.append((fqn, off, length, (rank * 2654435761 + pos) % (1 << 32)))
        pos += length
    return out


def packed_results(model: ModelShape, ranks: int, hsdp: bool, rank: int, compressed: bool = False) -> Any:
    """What ``write_data`` returns on ``rank``, built as its arrays (``PackedResults.pack`` would build the
    same); ``compressed``: every item zstd frames of 4 MiB (one frame index each, frame CRCs recorded)."""
    import hashlib

    import numpy as np

    from dcp_s3.codec import CODEC_NAME, CODEC_VERSION, GROUP_FLOAT
    from dcp_s3.codec.frame_table import FIELDS as FRAME_FIELDS
    from dcp_s3.codec.frame_table import FrameTable
    from dcp_s3.packed.results import FIELDS, PackedResults

    rows = rank_rows(model, ranks, hsdp, rank)
    if not rows:
        return []
    frames = None
    if compressed:  # raw bytes = item length - 1100; frames of 4 MiB stored at ~80%
        raw = np.array([r[2] - 1100 for r in rows], np.int64)
        count = -(-raw // FRAME)
        table = np.zeros((len(rows), len(FRAME_FIELDS)), np.int64)
        table[:, 1:] = [CODEC_VERSION, 4, GROUP_FLOAT, 0, FRAME, 0, 1]
        table[:, 4], table[:, 6] = raw, count
        total = int(count.sum())
        ends = np.arange(1, total + 1, dtype=np.int64) * (FRAME * 4 // 5)  # per item, restarted below
        starts = np.repeat(np.concatenate(([0], np.cumsum(count)[:-1])), count)
        ends -= starts * (FRAME * 4 // 5)
        frames = (
            np.arange(len(rows)),
            FrameTable(
                [CODEC_NAME],
                table,
                ends,
                np.arange(total, dtype=np.uint32),
                np.zeros(int(((count + 7) // 8).sum()), np.uint8),
            ),
        )
    names = [r[0] for r in rows]
    blob = "\0".join(names).encode()
    lengths = np.array([r[2] for r in rows], np.int64)
    fields = np.zeros((len(rows), len(FIELDS)), np.int64)
    fields[:, 1] = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    fields[:, 2] = fields[:, 3] = lengths
    fields[:, 4] = 0 if compressed else -1
    fields[:, 5] = -1 if compressed else 1088
    fields[:, 6] = [r[3] for r in rows]
    offsets = np.zeros((len(rows), 2), np.int64)
    offsets[:, 0] = [r[1] for r in rows]
    ndim = np.array([2] * len(rows), np.int64)
    ndim[[i for i, n in enumerate(names) if "norm" in n]] = 1
    offsets[ndim == 1, 1] = -1
    return PackedResults(
        (
            blob,
            hashlib.blake2b(blob, digest_size=16).digest(),
            ndim,
            [f"p-{rank % 256:02x}/__{rank}_0.{TOKEN}.distcp"],
            [["dcp_s3.zstd/1"]] if compressed else [],
            np.arange(len(rows), dtype=np.int32),
            offsets,
            fields,
            frames,
            [],
        )
    )


def time_after(model: ModelShape, ranks: int, hsdp: bool, compressed: bool = False) -> dict[str, float]:
    """Every rank's packed results pickled (rank-local, not timed), then the coordinator timed: unpickle
    them all, encode ``.metadata`` from the arrays, turn the metadata into the committed bytes' view; then
    the broadcast: pickle that metadata, and one rank's unpickling of it."""
    from dcp_s3.metadata.compact_write import dump_compact
    from dcp_s3.metadata.formats import load_metadata

    blobs = [pickle.dumps(packed_results(model, ranks, hsdp, r, compressed)) for r in range(ranks)]
    md = state_metadata(model, ranks, hsdp, lazy=True)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        results = [pickle.loads(b) for b in blobs]
        t1 = time.perf_counter()
        body = dump_compact(md, results)
        view = load_metadata(body, "s3://bucket/ckpt/.metadata")
        md.state_dict_metadata, md.storage_data = view.state_dict_metadata, view.storage_data
        t2 = time.perf_counter()
        broadcast = time_broadcast(md)
    finally:
        gc.enable()
    return {
        "entries": float(len(md.storage_data)),
        "gathered_bytes": float(sum(map(len, blobs))),
        "gathered_unpickle_s": t1 - t0,
        "encode_s": t2 - t1,
        "metadata_bytes": float(len(body)),
        **broadcast,
    }


def time_broadcast(md: Any) -> dict[str, float]:
    """torch's broadcast of the committed metadata: rank 0 pickles it, every rank unpickles it."""
    t0 = time.perf_counter()
    wire = pickle.dumps(md)
    t1 = time.perf_counter()
    pickle.loads(wire)
    return {
        "broadcast_bytes": float(len(wire)),
        "broadcast_pickle_s": t1 - t0,
        "broadcast_unpickle_s": time.perf_counter() - t1,
    }


def time_before(model: ModelShape, ranks: int, hsdp: bool, compressed: bool = False) -> dict[str, float]:
    """The same steps on objects, as dcp_s3 ran them before this change."""
    from dcp_s3.metadata.compact_write import dump_compact

    lists = [packed_results(model, ranks, hsdp, r, compressed) for r in range(ranks)]
    lists = [list(p) for p in lists]  # the WriteResult objects a rank built
    full = max(lists, key=len)
    one = pickle.dumps(full)  # per item, what every rank's list costs (all ranks' items: the storage entries)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        pickle.loads(one)
        one_unpickle = time.perf_counter() - t0
        md = state_metadata(model, ranks, hsdp, lazy=False)
        t1 = time.perf_counter()
        md.storage_data = {wr.index: wr.storage_data for per_rank in lists for wr in per_rank}
        body = dump_compact(md)
        t2 = time.perf_counter()
        broadcast = time_broadcast(md)
    finally:
        gc.enable()
    per_item = len(md.storage_data) / len(full)
    return {
        "entries": float(len(md.storage_data)),
        "gathered_bytes": len(one) * per_item,
        "gathered_unpickle_s": one_unpickle * per_item,
        "encode_s": t2 - t1,
        "metadata_bytes": float(len(body)),
        **broadcast,
    }


def entries(model: ModelShape, ranks: int, hsdp: bool) -> int:
    tensors, n = layout(model, ranks, hsdp)
    return sum(len({shard_rows(shape[0], n, s)[0] for s in range(n)}) for _, shape in tensors)


def measure(
    model: ModelShape, ranks_list: list[int], before_max: int, hsdp: bool, compressed: bool
) -> list[dict[str, Any]]:
    out = []
    measured_before: dict[int, dict[str, float]] = {}
    for n in ranks_list:
        print(f"  {'HSDP' if hsdp else 'FSDP'} {n} ranks: after...", flush=True)
        after = time_after(model, n, hsdp, compressed)
        gc.collect()
        if n <= before_max:
            print(f"  {'HSDP' if hsdp else 'FSDP'} {n} ranks: before...", flush=True)
            before, extrapolated = time_before(model, n, hsdp, compressed), False
            measured_before[n] = before
        else:
            base_n = max(measured_before)
            base = measured_before[base_n]
            scale = entries(model, n, hsdp) / base["entries"]
            before = {k: v * scale for k, v in base.items()}
            extrapolated = True
        gc.collect()
        out.append({"ranks": n, "before": before, "after": after, "before_extrapolated": extrapolated})
    return out


def _total(r: dict[str, float]) -> float:
    """Serial seconds from the last rank's results reaching rank 0 to every rank having the metadata."""
    return r["gathered_unpickle_s"] + r["encode_s"] + r["broadcast_pickle_s"] + r["broadcast_unpickle_s"]


def report(model: ModelShape, ranks_list: list[int], before_max: int, compressed: bool) -> tuple[str, dict[str, Any]]:
    sections, records = [], {}
    layouts = [("FSDP", False, False), (f"HSDP {HSDP_SHARD}-way shard", True, False)]
    if compressed:
        layouts.append(("FSDP, compression='zstd'", False, True))
    for name, hsdp, zstd in layouts:
        recs = measure(model, ranks_list, before_max, hsdp, zstd)
        rows = []
        for rec in recs:
            b, a, t = rec["before"], rec["after"], "~" if rec["before_extrapolated"] else ""
            rows.append(
                [
                    f"{rec['ranks']:,}",
                    f"{int(a['entries']):,}",
                    f"{t}{b['gathered_bytes'] / 1e9:,.2f} → {a['gathered_bytes'] / 1e9:,.3f}",
                    f"{t}{b['gathered_unpickle_s']:,.1f} → {a['gathered_unpickle_s']:,.2f}",
                    f"{t}{b['encode_s']:,.1f} → {a['encode_s']:,.2f}",
                    f"{t}{b['broadcast_bytes'] / 1e6:,.0f} → {a['broadcast_bytes'] / 1e6:,.1f}",
                    f"{t}{b['broadcast_pickle_s']:,.1f} → {a['broadcast_pickle_s']:,.3f}",
                    f"{t}{b['broadcast_unpickle_s']:,.1f} → {a['broadcast_unpickle_s']:,.3f}",
                    f"{t}{_total(b):,.0f} → {_total(a):,.1f}",
                ]
            )
        xs = [r["ranks"] for r in recs]
        rows.append(
            [
                "growth exponent (last two)",
                "",
                *(
                    f"{exponent(xs, [r['before'][k] for r in recs])} → {exponent(xs, [r['after'][k] for r in recs])}"
                    for k in (
                        "gathered_bytes",
                        "gathered_unpickle_s",
                        "encode_s",
                        "broadcast_bytes",
                        "broadcast_pickle_s",
                        "broadcast_unpickle_s",
                    )
                ),
                f"{exponent(xs, [_total(r['before']) for r in recs])} → {exponent(xs, [_total(r['after']) for r in recs])}",
            ]
        )
        table = common.markdown_table(
            [
                "ranks",
                "storage entries",
                "results gathered to rank 0, GB",
                "rank 0 unpickles them, s",
                "rank 0 builds + encodes .metadata, s",
                "metadata broadcast to every rank, MB",
                "rank 0 pickles it, s",
                "each rank unpickles it, s",
                "end of save, serial s",
            ],
            rows,
        )
        sections.append(f"**{name}** ({model.name}; before → after):\n\n{table}")
        records[name] = recs
    text = "\n\n".join(sections) + (
        "\n\n~ = extrapolated linearly in entries from the largest measured count (see the module doc). 'End of "
        "save, serial' = unpickling the gathered results + building and encoding .metadata + pickling the metadata "
        "for torch's broadcast + one rank unpickling it: what every rank waits for after the last write, on every "
        "save (the PUT and the network not included)."
    )
    return text, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument(
        "--before-max-ranks",
        type=int,
        default=1024,
        help="largest rank count at which the object-per-item path is run for real",
    )
    ap.add_argument("--compressed", action="store_true", help="also FSDP with every item zstd-compressed")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "scale_finish.json")
    args = ap.parse_args(argv)
    ranks_list = sorted({int(x) for x in args.ranks.split(",")})
    t0 = time.time()
    text, records = report(MODELS[args.model], ranks_list, args.before_max_ranks, args.compressed)
    print()
    print(text)
    common.write_json(
        args.out,
        {
            "benchmark": "scale_finish",
            "model": args.model,
            "args": vars(args) | {"out": str(args.out)},
            "machine": common.machine_info(),
            "records": records,
            "tables_markdown": text,
        },
    )
    args.out.with_suffix(".md").write_text(text + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
