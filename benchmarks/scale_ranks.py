"""Issue 14's table, before and after, for FSDP and HSDP layouts (used by ``benchmarks.scale``).

    python -m benchmarks.scale_ranks                       # Llama-70B-like, 1,024 / 4,096 / 16,384 ranks
    python -m benchmarks.scale_ranks --plan-max-ranks 2048 --after-max-ranks 2048  # quicker

Layouts: **FSDP** (every tensor sharded on dim 0 over all ranks) and **HSDP** (8-way shard
x ranks/8 replicas: rank r holds shard r % 8). Every figure is computed with the real code:

* ``.metadata`` bytes and unpickle time: ``benchmarks.scale_models.measure_metadata`` (a real
  ``Metadata`` with dcp_s3 entries, pickled and loaded; linear extrapolation in chunks
  above ``--metadata-max-entries``, marked ~). Unchanged by this work (same format).
* ``.metadata`` bytes GET from S3 on one load: before, every rank GETs it; after
  (``S3StorageReader(share_metadata=True)``, the default), one GET, broadcast in the job.
* coordinator planning, first save, before: ``create_global_plan`` of torch's
  ``DefaultSavePlanner`` on synthetic per-rank plans, timed per distinct tensor shape
  (``--plan-per-shape`` tensors of it, every rank's items) and summed over the model;
  above ``--plan-max-ranks`` extrapolated per shape with the growth exponent of the last
  two measured counts (at least 1; marked ~). Plus the plans gathered to rank 0 as torch
  pickles them: one full rank's plan pickled and unpickled, x ranks.
* the same, after: ``ScalableSavePlanner`` on the whole model (``time_after``): every rank's
  plan packed and pickled as its ``create_local_plan`` sends it, then timed as the
  coordinator runs them: unpickling the gathered plans, ``create_global_plan``, pickling
  the global plans for the scatter. Measured up to ``--after-max-ranks``, above it
  extrapolated from the last two measured counts (exponent at least 1; marked ~).
* coordinator planning, repeated save (same structure): before, the default planner
  redoes the first-save work; after, plan caching: every rank sends an empty plan and the
  coordinator reuses the cached global plan and metadata. Timed at every rank count
  (real ``create_global_plan`` call, no extrapolation).
* the end of the save (write results gathered for ``finish``, ``.metadata`` encoded, the
  metadata broadcast to every rank): ``benchmarks.scale_finish`` (retired; at commit 679e524).
* HSDP load bytes from S3: before, every replica reads its shard: replicas x stored; after
  (``S3StorageReader(replica_group=...)``), the stored bytes once (the real-process test
  measures <= 1.1x including coalescing gaps).
"""

from __future__ import annotations

import argparse
import gc
import math
import pickle
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.scale_models import MODELS, ModelShape, measure_metadata, shard_rows, sharded_tensors  # noqa: E402

HSDP_SHARD = 8
MEASURED = (1024, 2048)  # planning is always timed at these (when <= --plan-max-ranks): the growth exponent


def plans(tensors: list[tuple[str, tuple[int, ...]]], ranks: int, shard: int, only: int | None = None) -> list[Any]:
    """Per-rank ``SavePlan``s: rank r writes chunk ``r % shard`` of every tensor (dim 0, torch.chunk rule);
    with ``only``, just that rank's plan."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    mappings = {fqn: tuple(fqn.split(".")) for fqn, _ in tensors}
    items_of_shard = []
    for s in range(shard):
        if only is not None and s != only % shard:
            items_of_shard.append([])
            continue
        items = []
        for fqn, shape in tensors:
            off, rows = shard_rows(shape[0], shard, s)
            offsets = torch.Size([off] + [0] * (len(shape) - 1))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *shape[1:]]))
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(shape)),
                )
            )
        items_of_shard.append(items)
    ranks_wanted = range(ranks) if only is None else [only]
    return [SavePlan(list(items_of_shard[r % shard]), planner_data=mappings) for r in ranks_wanted]


def _fresh(planner_cls: type) -> Any:
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        cache.clear()
    return planner_cls()


def time_first(
    planner_cls: type, tensors: list[tuple[str, tuple[int, ...]]], ranks: int, shard: int, repeat: int = 1
) -> float:
    """Best-of seconds of a first save's ``create_global_plan``."""
    best = math.inf
    for _ in range(repeat):
        all_plans = plans(tensors, ranks, shard)
        planner = _fresh(planner_cls)
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            planner.create_global_plan(all_plans)
            best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
        del all_plans, planner
        gc.collect()
    return best


def gathered(tensors: list[tuple[str, tuple[int, ...]]], ranks: int, shard: int) -> dict[str, float]:
    """What travels to the coordinator besides the planning itself, per rank (unchanged by this work:
    torch's pickled ``SavePlan`` and dcp_s3's ``WriteResult`` list): pickled bytes and the
    coordinator's unpickle seconds, for one full rank (rank ``ranks // 2``: a middle shard)."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_s3._layout import ItemLocation

    plan = plans(tensors, ranks, shard, only=ranks // 2)[0]
    out: dict[str, float] = {}
    results, offset = [], 0
    for item in plan.items:
        assert item.type == WriteItemType.SHARD and item.tensor_data is not None
        length = math.prod(item.tensor_data.chunk.sizes) * 4 + 1100  # raw bytes + torch.save envelope
        where = ItemLocation(
            relative_path="p-3f/__5_0_0123456789abcdef.distcp",
            offset=offset,
            length=length,
            payload_offset=1088,
            crc32c=0x12345678,
        )
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=where))
        offset += length
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    pickle.dumps(plan)
    out["plan_pickle_s"] = time.perf_counter() - t0  # ~ the scatter's pickling of its global plan
    for key, obj in (("plan", plan), ("results", results)):
        blob = pickle.dumps(obj)  # gather_object pickles with the default protocol
        best = math.inf
        gc.disable()
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                pickle.loads(blob)
                best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
        out[f"{key}_bytes"], out[f"{key}_unpickle_s"] = len(blob), best
    return out


def time_after(tensors: list[tuple[str, tuple[int, ...]]], ranks: int, shard: int) -> dict[str, float]:
    """A first save's coordinator with ``ScalableSavePlanner`` on the whole model: every rank's plan
    packed and pickled as ``create_local_plan`` sends it (rank-local work, not timed), then, timed as
    the coordinator runs them: unpickling the gathered plans, ``create_global_plan``, pickling the
    global plans for the scatter."""
    from dcp_s3._planners.scale import ScalableSavePlanner, packed_plan

    per_shard: dict[int, bytes] = {}
    blobs = []
    for r in range(ranks):
        s = r % shard
        if s not in per_shard or shard == ranks:
            per_shard = {s: pickle.dumps(packed_plan(plans(tensors, ranks, shard, only=r)[0]))}
        blobs.append(per_shard[s])
    planner = _fresh(ScalableSavePlanner)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        wire = [pickle.loads(b) for b in blobs]
        t1 = time.perf_counter()
        global_plans, _ = planner.create_global_plan(wire)
        t2 = time.perf_counter()
        scatter = sum(len(pickle.dumps(p)) for p in global_plans)
        t3 = time.perf_counter()
    finally:
        gc.enable()
    out = {
        "unpickle_s": t1 - t0,
        "plan_s": t2 - t1,
        "scatter_s": t3 - t2,
        "gathered_bytes": float(sum(map(len, blobs))),
        "scatter_bytes": float(scatter),
    }
    del wire, global_plans, blobs, planner
    gc.collect()
    return out


def time_repeat(ranks: int) -> tuple[float, int]:
    """Seconds of the coordinator's step on a repeated save with plan caching, and one empty plan's bytes."""
    from torch.distributed.checkpoint.planner import SavePlan

    from dcp_s3._planners.scale import ScalableSavePlanner

    planner = _fresh(ScalableSavePlanner)
    planner.create_global_plan(plans([("t", (8, 8))], ranks, min(ranks, 8)))  # fills the cache
    empty = [SavePlan([], usable=False) for _ in range(ranks)]
    t0 = time.perf_counter()
    planner.create_global_plan(empty)
    return time.perf_counter() - t0, len(pickle.dumps(empty[0], protocol=pickle.HIGHEST_PROTOCOL))


def planning(
    model: ModelShape,
    ranks_list: list[int],
    max_ranks: int,
    after_max_ranks: int,
    per_shape: int,
    hsdp: bool,
    repeat: int = 1,
) -> dict[int, dict[str, Any]]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tensors = sharded_tensors(model)
    shapes = Counter(shape for _, shape in tensors)
    before: dict[int, dict[tuple[int, ...], float]] = {}
    after: dict[int, dict[str, float]] = {}
    for n in sorted({*(r for r in ranks_list if r <= max_ranks), *(r for r in MEASURED if r <= max_ranks)}):
        shard = HSDP_SHARD if hsdp else n
        before[n] = {
            shape: time_first(DefaultSavePlanner, [(f"t{i}", shape) for i in range(per_shape)], n, shard, repeat)
            / per_shape
            for shape in shapes
        }
        print(f"  {'HSDP' if hsdp else 'FSDP'} {n:,} ranks: before {_sum(before[n], shapes):.1f} s", flush=True)
    for n in sorted({*(r for r in ranks_list if r <= after_max_ranks), *(r for r in MEASURED if r <= after_max_ranks)}):
        after[n] = time_after(tensors, n, HSDP_SHARD if hsdp else n)
        print(f"  {'HSDP' if hsdp else 'FSDP'} {n:,} ranks: after {after[n]}", flush=True)
    out = {}
    for n in ranks_list:
        row: dict[str, Any] = {}
        per, row["before_extrapolated"] = _per_shape(before, shapes, n)
        row["before"] = _sum(per, shapes)
        row["after_extrapolated"] = n not in after
        for key, value in _extrapolate(after, n).items():
            row[f"after_{key}"] = value
        row["after"] = row["after_plan_s"]
        row |= gathered(tensors, n, HSDP_SHARD if hsdp else n)
        row["repeat_s"], row["empty_plan_bytes"] = time_repeat(n)
        out[n] = row
    return out


def _extrapolate(measured: dict[int, dict[str, float]], n: int) -> dict[str, float]:
    """Measured figures at ``n``, or the last measured ones grown with the exponent of the last two
    measured counts (at least 1: linear)."""
    if n in measured:
        return measured[n]
    a, b = sorted(measured)[-2:]
    out = {}
    for key, tb in measured[b].items():
        ta = measured[a][key]
        k = math.log(max(tb, 1e-9) / max(ta, 1e-9)) / math.log(b / a)
        out[key] = tb * (n / b) ** max(k, 1.0)
    return out


def _sum(per: dict[tuple[int, ...], float], shapes: Counter[tuple[int, ...]]) -> float:
    return sum(per[s] * c for s, c in shapes.items())


def _per_shape(
    measured: dict[int, dict[tuple[int, ...], float]], shapes: Counter[tuple[int, ...]], n: int
) -> tuple[dict[tuple[int, ...], float], bool]:
    if n in measured:
        return measured[n], False
    a, b = sorted(measured)[-2:]
    per = {}
    for shape in shapes:
        ta, tb = measured[a][shape], measured[b][shape]
        k = math.log(max(tb, 1e-9) / max(ta, 1e-9)) / math.log(b / a)
        per[shape] = tb * (n / b) ** max(k, 1.0)
    return per, True


def exponent(xs: list[int], ys: list[float]) -> str:
    if len(xs) < 2 or ys[-2] <= 0 or ys[-1] <= 0:
        return "—"
    return f"{math.log(ys[-1] / ys[-2]) / math.log(xs[-1] / xs[-2]):.2f}"


def report(model: ModelShape, ranks_list: list[int], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    total = sum(math.prod(s) for _, s in model.params()) * args.bytes_per_param
    meta = measure_metadata(model, sorted({128, *ranks_list}), args.metadata_max_entries)  # 128: built for real
    per_entry = {n: meta[n]["bytes"] / meta[n]["entries"] for n in meta}
    unpickle_per_entry = {n: meta[n]["load_s"] / meta[n]["entries"] for n in meta}
    sections, records = [], {}
    for layout, hsdp in (("FSDP", False), (f"HSDP {HSDP_SHARD}-way shard", True)):
        plan = planning(
            model, ranks_list, args.plan_max_ranks, args.after_max_ranks, args.plan_per_shape, hsdp, args.plan_repeat
        )
        rows, recs = [], []
        for n in ranks_list:
            if hsdp:  # chunks: every tensor in HSDP_SHARD pieces, whatever the rank count
                entries = len(sharded_tensors(model)) * HSDP_SHARD + len(model.params()) + 1
                md_bytes, md_s, md_tilde = per_entry[n] * entries, unpickle_per_entry[n] * entries, "~"
            else:
                md_bytes, md_s = meta[n]["bytes"], meta[n]["load_s"]
                md_tilde = "" if meta[n]["measured"] else "~"
            p = plan[n]
            replicas = n // HSDP_SHARD if hsdp else 1
            before_total = p["before"] + (p["plan_unpickle_s"] + p["plan_pickle_s"]) * n
            after_total = p["after_unpickle_s"] + p["after_plan_s"] + p["after_scatter_s"]
            rec = {
                "ranks": n,
                "metadata_bytes": md_bytes,
                "unpickle_s": md_s,
                "metadata_get_bytes_before": md_bytes * n,
                "metadata_get_bytes_after": md_bytes,
                "plan_first_s_before": p["before"],
                "plan_first_s_after": p["after"],
                "plan_first_extrapolated_before": p["before_extrapolated"],
                "plan_first_extrapolated_after": p["after_extrapolated"],
                "gathered_bytes_before": p["plan_bytes"] * n,
                "gathered_bytes_after": p["after_gathered_bytes"],
                "gathered_unpickle_s_before": p["plan_unpickle_s"] * n,
                "gathered_unpickle_s_after": p["after_unpickle_s"],
                "scatter_pickle_s_before": p["plan_pickle_s"] * n,
                "scatter_pickle_s_after": p["after_scatter_s"],
                "scatter_bytes_after": p["after_scatter_bytes"],
                "first_save_rank0_s_before": before_total,
                "first_save_rank0_s_after": after_total,
                "plan_repeat_s_before": p["before"],
                "plan_repeat_s_after": p["repeat_s"],
                "gathered_bytes_repeat_after": p["empty_plan_bytes"] * n,
                "results_bytes": p["results_bytes"] * n,
                "results_unpickle_s": p["results_unpickle_s"] * n,
                "load_s3_bytes_before": total * replicas,
                "load_s3_bytes_after": total,
            }
            recs.append(rec)
            tb = "~" if p["before_extrapolated"] else ""
            ta = "~" if p["after_extrapolated"] else ""
            rows.append(
                [
                    f"{n:,}",
                    f"{md_tilde}{md_bytes / 1e6:,.1f}",
                    f"{md_tilde}{md_s:,.2f}",
                    f"{md_tilde}{md_bytes * n / 1e9:,.1f} → {md_bytes / 1e9:,.3f}",
                    f"{tb}{p['before']:,.1f} → {ta}{p['after']:,.1f}",
                    f"{p['plan_bytes'] * n / 1e9:,.2f} → {ta}{p['after_gathered_bytes'] / 1e9:,.2f}",
                    f"{p['plan_unpickle_s'] * n:,.1f} → {ta}{p['after_unpickle_s']:,.1f}",
                    f"{tb}{before_total:,.0f} → {ta}{after_total:,.1f}",
                    f"{tb}{p['before']:,.1f} → {p['repeat_s']:.4f}",
                    f"{total * replicas / 1e9:,.0f} → {total / 1e9:,.0f}",
                ]
            )
        growth = (
            ["growth exponent (last two)"]
            + [exponent(ranks_list, [r[k] for r in recs]) for k in ("metadata_bytes", "unpickle_s")]
            + [
                f"{exponent(ranks_list, [r[k + '_before'] for r in recs])} → {exponent(ranks_list, [r[k + '_after'] for r in recs])}"
                for k in (
                    "metadata_get_bytes",
                    "plan_first_s",
                    "gathered_bytes",
                    "gathered_unpickle_s",
                    "first_save_rank0_s",
                    "plan_repeat_s",
                )
            ]
            + [
                f"{exponent(ranks_list, [r['load_s3_bytes_before'] for r in recs])} → "
                f"{exponent(ranks_list, [r['load_s3_bytes_after'] for r in recs])}",
            ]
        )
        rows.append(growth)
        table = common.markdown_table(
            [
                "ranks",
                ".metadata MB",
                "unpickle s (each rank)",
                "GB of .metadata GET on one load",
                "coordinator plan s, first save",
                "plans gathered to rank 0, GB",
                "rank 0 unpickles them, s",
                "first save at rank 0, s (unpickle + plan + scatter)",
                "coordinator plan s, repeated save",
                "GB read from S3 by one load",
            ],
            rows,
        )
        sections.append(f"**{layout}** ({model.name}, {total / 1e9:,.0f} GB; before → after):\n\n{table}")
        records[layout] = recs
    text = "\n\n".join(sections) + (
        "\n\n~ = extrapolated (see the module doc). Before = torch's DefaultSavePlanner (plans as torch pickles "
        "them: one full rank's plan pickled and unpickled, x ranks); after = ScalableSavePlanner on the whole "
        "model (packed plans, every rank's unpickled by the coordinator). 'First save at rank 0' = unpickling the "
        "gathered plans + create_global_plan + pickling the global plans for the scatter: what the coordinator "
        "does serially before any rank writes. Repeated-save planning before = the first-save work, which the "
        "default planner redoes; after = plan caching, timed at every rank count. The end of the save (write "
        "results gathered, .metadata encoded, metadata broadcast): benchmarks.scale_finish, at commit 679e524."
    )
    return text, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    ap.add_argument("--bytes-per-param", type=float, default=12.0)
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--metadata-max-entries", type=int, default=300_000)
    ap.add_argument("--plan-max-ranks", type=int, default=4096)
    ap.add_argument("--plan-per-shape", type=int, default=1)
    ap.add_argument("--plan-repeat", type=int, default=1, help="best of this many timed planning runs")
    ap.add_argument(
        "--after-max-ranks",
        type=int,
        default=2048,
        help="largest rank count at which ScalableSavePlanner's coordinator runs on the whole model",
    )
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "scale_ranks.json")
    args = ap.parse_args(argv)
    ranks_list = sorted({int(x) for x in args.ranks.split(",")})
    t0 = time.time()
    text, records = report(MODELS[args.model], ranks_list, args)
    print()
    print(text)
    common.write_json(
        args.out,
        {
            "benchmark": "scale_ranks",
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
