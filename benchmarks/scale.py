"""What a checkpoint costs at 8 to 16,384 ranks: a simulation, no server.

    python -m benchmarks.scale                         # Llama-70B-like, FSDP over all ranks
    python -m benchmarks.scale --model llama-7b --rank-gbps 0.5
    python -m benchmarks.scale --ranks 8,64,512 --plan-max-ranks 512
    python -m benchmarks.scale --key-prefixes 1,16,256    # the key layouts compared (the default)
    python -m benchmarks.scale --before-after             # + issue 14's table before/after, FSDP and HSDP
    python -m benchmarks.scale --metadata-gets per-rank   # loads as before share_metadata (every rank GETs .metadata)

Model: FSDP2-style training state — every parameter, AdamW ``exp_avg`` and
``exp_avg_sq`` sharded on dim 0 over all ranks (``torch.chunk`` rule, so small
tensors leave trailing ranks with empty shards, which DCP still records), plus
one replicated ``step`` scalar per parameter (deduplicated by DCP). ``--bytes-per-param``
12 = fp32 param + two fp32 moments. dcp_s3 defaults: one data object per rank,
16 MiB parts (doubled while an object would need more than 10,000), 16 MiB ranged
GETs, ``.metadata`` written once.

Columns, per checkpoint:
* objects; save requests (PUT-class: PUT, CreateMultipartUpload, UploadPart,
  Complete — S3 allows ~3,500/s per prefix) and load requests (GET-class:
  ranged GETs plus the ``.metadata`` GET: one per load with ``S3StorageReader``'s default
  ``share_metadata=True``, one per rank with ``--metadata-gets per-rank`` — ~5,500/s per prefix); the rates
  assume every rank moves data at ``--rank-gbps`` and all keys share one prefix
  (DCP's layout); "min s" is the shortest save/load the per-prefix limit allows.
* the same rates on the busiest prefix with ``S3StorageWriter(key_prefixes=N)`` for each N of
  ``--key-prefixes``: rank r's objects under ``p-<hex of r % N>/``, so the busiest prefix carries
  ceil(ranks / N) ranks' data requests, assuming S3 has split the checkpoint's key range into one
  partition per ``p-<h>`` (it does so gradually under load, or on request). ``.metadata`` stays one
  key: its PUT and its GETs on load land on one partition whatever N. N = 1 is the
  flat layout (every request on one prefix). Then the largest job (ranks) whose busiest prefix
  stays under both 3,500 PUT/s and 5,500 GET/s, for each N, found by trying every rank count.
* ``.metadata`` size: a real ``Metadata`` with dcp_s3's ``ItemLocation`` entries is
  built and pickled while it has at most ``--metadata-max-entries`` chunks, and
  extrapolated linearly in chunks beyond (marked ~). Every rank GETs it on load.
* coordinator planning: torch's ``DefaultSavePlanner.create_global_plan`` timed on
  synthetic per-rank ``SavePlan``s for up to ``--plan-max-ranks`` ranks, once per
  distinct tensor shape (its cost depends on shape and rank count only) and summed
  over the model's tensors; larger rank counts are extrapolated (marked ~).
* request cost at S3 list prices: PUT-class $0.005 / 1,000, GET-class $0.0004 / 1,000.
"""

from __future__ import annotations

import argparse
import gc
import math
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, scale_ranks  # noqa: E402
from benchmarks.scale_models import MODELS, ModelShape, measure_metadata, shard_rows, sharded_tensors  # noqa: E402
from dcp_s3._layout import rank_prefix  # noqa: E402

PUT_LIMIT = 3500  # requests / s / prefix (S3 guidance)
GET_LIMIT = 5500
PUT_PRICE = 0.005 / 1000  # $ per request, S3 Standard list price
GET_PRICE = 0.0004 / 1000
MAX_PARTS = 10_000
MiB = common.MiB


def fit_part(part: int, size: int) -> int:
    while -(-size // part) > MAX_PARTS:
        part *= 2
    return part


@dataclass(frozen=True)
class Requests:
    """One checkpoint's S3 requests at ``ranks`` ranks, every rank moving its share in ``seconds``."""

    ranks: int
    object_bytes: float
    part_bytes: int
    puts_per_rank: int  # PUT-class requests of one rank's data objects
    gets_per_rank: int  # ranged GETs of one rank's share on load (without .metadata)
    seconds: float  # save time = load time at --rank-gbps
    metadata_gets: int  # .metadata GETs on one load: 1 (S3StorageReader's default) or one per rank (before)

    @classmethod
    def of(cls, total: float, ranks: int, args: argparse.Namespace) -> Requests:
        per_rank = total / ranks
        per_obj = per_rank / args.files_per_rank
        part = fit_part(args.part_mib * MiB, int(per_obj))
        put_per_obj = 1 if per_obj <= part else 2 + math.ceil(per_obj / part)  # PUT, or Create + parts + Complete
        return cls(
            ranks,
            per_obj,
            part,
            args.files_per_rank * put_per_obj,
            math.ceil(per_rank / (args.range_mib * MiB)),
            per_rank / (args.rank_gbps * 1e9),
            ranks if args.metadata_gets == "per-rank" else 1,
        )

    @property
    def save_puts(self) -> int:
        return self.ranks * self.puts_per_rank + 1  # + .metadata

    @property
    def load_gets(self) -> int:
        return self.ranks * self.gets_per_rank + self.metadata_gets

    def busiest_prefix(self, prefixes: int) -> dict[str, float]:
        """PUT/s and GET/s of the busiest prefix with ``key_prefixes=prefixes``, and what each is made of."""
        if prefixes == 1:  # flat: data and .metadata share one prefix
            return {
                "put_per_s": self.save_puts / self.seconds,
                "get_per_s": self.load_gets / self.seconds,
                "data_put_per_s": self.save_puts / self.seconds,
                "data_get_per_s": self.load_gets / self.seconds,
                "metadata_get_per_s": self.metadata_gets / self.seconds,
            }
        ranks = -(-self.ranks // prefixes)  # ranks whose objects share the busiest p-<h>
        data_put, data_get = ranks * self.puts_per_rank / self.seconds, ranks * self.gets_per_rank / self.seconds
        meta_put, meta_get = 1 / self.seconds, self.metadata_gets / self.seconds
        return {
            "put_per_s": max(data_put, meta_put),
            "get_per_s": max(data_get, meta_get),
            "data_put_per_s": data_put,
            "data_get_per_s": data_get,
            "metadata_get_per_s": meta_get,
        }


def largest_job(
    total: float, args: argparse.Namespace, prefixes: int, *, data_only: bool = False, max_ranks: int = 1 << 20
) -> tuple[int, str]:
    """(largest rank count such that every job up to it stays under both limits, the limit that binds)."""
    for n in range(1, max_ranks + 1):
        rates = Requests.of(total, n, args).busiest_prefix(prefixes)
        put = rates["data_put_per_s"] if data_only else rates["put_per_s"]
        get = rates["data_get_per_s"] if data_only else rates["get_per_s"]
        if put > PUT_LIMIT or get > GET_LIMIT:
            if put / PUT_LIMIT >= get / GET_LIMIT:
                return n - 1, "PUT/s"
            meta = not data_only and prefixes > 1 and rates["metadata_get_per_s"] >= rates["data_get_per_s"]
            return n - 1, ".metadata GET/s" if meta else "GET/s"
    return max_ranks, "none"


# ---------------------------------------------------------------------------------------------
# .metadata
# ---------------------------------------------------------------------------------------------
def synthetic_plans(tensors: list[tuple[str, tuple[int, ...]]], ranks: int) -> list[Any]:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    mappings = {fqn: tuple(fqn.split(".")) for fqn, _ in tensors}
    plans = []
    for r in range(ranks):
        items = []
        for fqn, shape in tensors:
            off, rows = shard_rows(shape[0], ranks, r)
            offsets = torch.Size([off] + [0] * (len(shape) - 1))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *shape[1:]]))
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(shape)),
                )
            )
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def time_global_plan(tensors: list[tuple[str, tuple[int, ...]]], ranks: int, repeat: int = 2) -> tuple[float, int]:
    """Seconds of ``DefaultSavePlanner.create_global_plan`` (+ dcp_s3's prepare_global_plan naming) and
    the pickled size of one rank's plan (what the coordinator gathers from every rank)."""
    import dataclasses

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    best = math.inf
    plan_bytes = 0
    for _ in range(repeat):  # best of ``repeat``: the machine is shared, the planner is deterministic
        plans = synthetic_plans(tensors, ranks)
        plan_bytes = len(pickle.dumps(plans[0], protocol=pickle.HIGHEST_PROTOCOL))
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            global_plan, _ = DefaultSavePlanner().create_global_plan(plans)
            [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(global_plan)]
            best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
        del plans, global_plan
        gc.collect()
    return best, plan_bytes


def measure_planning(
    model: ModelShape, ranks_list: list[int], max_ranks: int, per_shape: int
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Coordinator planning time for the whole model, per rank count.

    The planner's cost per tensor depends on the tensor's shape and the rank count, not
    on its name, so each distinct shape is timed once (``per_shape`` tensors of it, all
    ranks' items) and multiplied by how many tensors have that shape; the merge of every
    rank's ``planner_data`` (one dict per rank, all keys) is timed on its own. Rank counts
    above ``max_ranks`` are extrapolated per shape with the growth exponent of the last
    two measured counts.
    """
    from collections import ChainMap, Counter

    tensors = sharded_tensors(model)
    shapes = Counter(shape for _, shape in tensors)
    mappings = {fqn: tuple(fqn.split(".")) for fqn, _ in tensors}
    mappings.update({f"optim.state.{n}.step": ("optim", "state", n, "step") for n, _ in model.params()})
    measured: dict[int, dict[tuple[int, ...], float]] = {}
    item_bytes: dict[tuple[int, ...], float] = {}
    merge_s: dict[int, float] = {}
    for n in ranks_list:
        if n > max_ranks:
            continue
        measured[n] = {}
        for shape in shapes:
            batch = [(f"t{i}", shape) for i in range(per_shape)]
            secs, plan_bytes = time_global_plan(batch, n)
            measured[n][shape] = secs / per_shape
            item_bytes[shape] = plan_bytes / per_shape
        t0 = time.perf_counter()
        dict(ChainMap(*([mappings] * n)))
        merge_s[n] = time.perf_counter() - t0
    out: dict[int, dict[str, Any]] = {}
    done = sorted(measured)
    for n in ranks_list:
        if n in measured:
            per = measured[n]
            merge = merge_s[n]
            extrapolated = False
        elif len(done) >= 2:
            a, b = done[-2], done[-1]
            per = {}
            for shape in shapes:
                ta, tb = measured[a][shape], measured[b][shape]
                k = math.log(max(tb, 1e-9) / max(ta, 1e-9)) / math.log(b / a)
                per[shape] = tb * (n / b) ** max(k, 1.0)
            merge = merge_s[b] * n / b
            extrapolated = True
        else:
            continue
        total = sum(per[shape] * count for shape, count in shapes.items()) + merge
        worst = max(shapes, key=lambda sh: per[sh] * shapes[sh])
        out[n] = {
            "s": total,
            "extrapolated": extrapolated,
            "merge_s": merge,
            "per_shape_s": {str(sh): per[sh] for sh in shapes},
            "worst_shape": str(worst),
            "worst_share": per[worst] * shapes[worst] / total,
            "plan_bytes": sum(item_bytes[sh] * c for sh, c in shapes.items()),
        }
    notes = []
    if len(done) >= 2:
        first, a, b = done[0], done[-2], done[-1]
        for shape in sorted(shapes, key=lambda sh: -measured[b][sh]):
            t0, ta, tb = measured[first][shape], measured[a][shape], measured[b][shape]
            k = math.log(max(tb, 1e-9) / max(ta, 1e-9)) / math.log(b / a)
            notes.append(
                f"shape {shape} x{shapes[shape]} tensors: {1000 * t0:.1f} ms at {first} ranks, "
                f"{1000 * ta:.1f} ms at {a}, {1000 * tb:.1f} ms at {b} per tensor "
                f"(~ranks^{k:.2f} between the last two)"
            )
    return out, notes


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    ap.add_argument("--bytes-per-param", type=float, default=12.0)
    ap.add_argument("--ranks", default="8,32,128,512,1024,2048,4096,8192,16384")
    ap.add_argument(
        "--rank-gbps",
        type=float,
        default=0.25,
        help="assumed S3 throughput per rank, GB/s (0.25 = 2 GB/s per 8-GPU node)",
    )
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--range-mib", type=int, default=16)
    ap.add_argument("--files-per-rank", type=int, default=1)
    ap.add_argument(
        "--key-prefixes",
        default="1,16,256",
        help="S3StorageWriter(key_prefixes=N) values to compare (1 = the flat layout)",
    )
    ap.add_argument(
        "--metadata-gets",
        choices=("once", "per-rank"),
        default="once",
        help=".metadata GETs per load: once (S3StorageReader(share_metadata=True), the default) or "
        "per-rank (share_metadata=False, and dcp_s3 before it)",
    )
    ap.add_argument("--metadata-max-entries", type=int, default=300_000)
    ap.add_argument("--plan-max-ranks", type=int, default=4096)
    ap.add_argument(
        "--plan-per-shape", type=int, default=2, help="tensors per distinct shape in each timed planning run"
    )
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "scale.json")
    ap.add_argument(
        "--before-after",
        action="store_true",
        help="also issue 14's before/after table, FSDP and HSDP (benchmarks.scale_ranks; minutes)",
    )
    args = ap.parse_args(argv)

    model = MODELS[args.model]
    ranks_list = sorted({int(x) for x in args.ranks.split(",")})
    prefix_list = sorted({int(x) for x in args.key_prefixes.split(",")} | {1})
    n_params = sum(math.prod(s) for _, s in model.params())
    total = n_params * args.bytes_per_param
    print(
        f"{model.name}: {n_params / 1e9:.1f}B params, {len(sharded_tensors(model))} sharded tensors; "
        f"checkpoint {total / 1e9:.0f} GB at {args.bytes_per_param:g} B/param; "
        f"{args.rank_gbps:g} GB/s per rank; parts {args.part_mib} MiB, ranged GETs {args.range_mib} MiB",
        flush=True,
    )

    t0 = time.time()
    print("building and pickling .metadata ...", flush=True)
    meta = measure_metadata(model, ranks_list, args.metadata_max_entries)
    print(f"  ({time.time() - t0:.0f} s) timing the coordinator's global plan ...", flush=True)
    plan, plan_notes = measure_planning(model, ranks_list, args.plan_max_ranks, args.plan_per_shape)
    print(f"  ({time.time() - t0:.0f} s)", flush=True)

    rows_req, rows_meta, rows_prefix, records = [], [], [], []
    for n in ranks_list:
        req = Requests.of(total, n, args)
        per_obj, part = req.object_bytes, req.part_bytes
        objects = n * args.files_per_rank + 1
        save_put = req.save_puts
        save_get = 2  # HEAD bucket + HEAD .metadata (GET-class)
        load_get = req.load_gets
        t_save = req.seconds
        put_rate, get_rate = save_put / t_save, load_get / t_save
        per_prefix = {p: req.busiest_prefix(p) for p in prefix_list}
        md = meta[n]
        cost_save = save_put * PUT_PRICE + save_get * GET_PRICE
        cost_load = load_get * GET_PRICE
        pl = plan.get(n)
        rec = {
            "ranks": n,
            "objects": objects,
            "object_mib": per_obj / MiB,
            "part_mib": part / MiB,
            "save_put_requests": save_put,
            "load_get_requests": load_get,
            "save_s_bandwidth": t_save,
            "put_per_s": put_rate,
            "get_per_s": get_rate,
            "min_save_s_at_limit": save_put / PUT_LIMIT,
            "min_load_s_at_limit": load_get / GET_LIMIT,
            "busiest_prefix_by_key_prefixes": per_prefix,
            "metadata_bytes": md["bytes"],
            "metadata_measured": md["measured"],
            "metadata_chunks": md["entries"],
            "metadata_unpickle_s": md["load_s"],
            "metadata_bytes_fetched_on_load": md["bytes"] * req.metadata_gets,
            "plan_s": pl["s"] if pl else None,
            "plan_extrapolated": pl["extrapolated"] if pl else None,
            "plan_worst_shape": pl["worst_shape"] if pl else None,
            "plan_worst_share": pl["worst_share"] if pl else None,
            "plan_gather_bytes": pl["plan_bytes"] * n if pl else None,
            "cost_save_usd": cost_save,
            "cost_load_usd": cost_load,
        }
        records.append(rec)
        tilde = "" if md["measured"] else "~"
        rows_req.append(
            [
                f"{n:,}",
                f"{objects:,}",
                f"{per_obj / MiB:,.0f}",
                f"{save_put:,}",
                f"{t_save:,.1f}",
                f"{put_rate:,.0f}",
                f"{put_rate / PUT_LIMIT:.2f}x",
                f"{save_put / PUT_LIMIT:,.1f}",
                f"{load_get:,}",
                f"{get_rate:,.0f}",
                f"{get_rate / GET_LIMIT:.2f}x",
                f"${cost_save:.3f}",
                f"${cost_load:.4f}",
            ]
        )
        rows_meta.append(
            [
                f"{n:,}",
                f"{md['entries']:,}",
                f"{tilde}{md['bytes'] / 1e6:,.1f}",
                f"{tilde}{md['load_s']:.2f}",
                f"{tilde}{md['bytes'] * req.metadata_gets / 1e9:,.1f}",
                ("~" if pl and pl["extrapolated"] else "") + common.fmt(pl["s"] if pl else None, 1),
                f"{pl['worst_shape']} {100 * pl['worst_share']:.0f}%" if pl else "—",
                common.fmt(pl["plan_bytes"] * n / 1e6 if pl else None, 1),
            ]
        )
        rows_prefix.append(
            [f"{n:,}"]
            + [
                f"{r[k]:,.0f} ({r[k] / limit:.2f}x)"
                for r in per_prefix.values()
                for k, limit in (("put_per_s", PUT_LIMIT), ("get_per_s", GET_LIMIT))
            ]
        )
    largest = {}
    for p in prefix_list:
        n_max, bound = largest_job(total, args, p)
        n_data, bound_data = largest_job(total, args, p, data_only=True)
        largest[p] = {"ranks": n_max, "bound_by": bound, "ranks_data_objects_only": n_data, "data_bound_by": bound_data}
    rows_largest = [
        [
            f"{p:,}" + (" (flat)" if p == 1 else ""),
            f"{v['ranks']:,}",
            v["bound_by"],
            f"{v['ranks_data_objects_only']:,} ({v['data_bound_by']})" if p > 1 else "same",
        ]
        for p, v in largest.items()
    ]
    widest = max(prefix_list)
    extra = len(rank_prefix(0, widest)) - len(rank_prefix(0))
    per_entry = meta[ranks_list[0]]["bytes"] / meta[ranks_list[0]]["entries"]
    t1 = common.markdown_table(
        [
            "ranks",
            "objects",
            "MiB / object",
            "save PUT-class req",
            f"save s at {args.rank_gbps:g} GB/s/rank",
            "PUT/s per prefix",
            "x 3,500 limit",
            "min save s at limit",
            "load GET req",
            "GET/s per prefix",
            "x 5,500 limit",
            "$ / save",
            "$ / load",
        ],
        rows_req,
    )
    t2 = common.markdown_table(
        [
            "ranks",
            ".metadata chunks",
            ".metadata MB",
            "unpickle s (each rank)",
            "GB of .metadata GETs on load",
            "coordinator plan s",
            "largest share of plan time",
            "plans gathered, MB",
        ],
        rows_meta,
    )
    t3 = common.markdown_table(
        ["ranks"] + [f"{what} N={p:,}" for p in prefix_list for what in ("PUT/s", "GET/s")], rows_prefix
    )
    t4 = common.markdown_table(["key_prefixes N", "largest job, ranks", "bound by", "data objects alone"], rows_largest)
    text = (
        f"{model.name}, {total / 1e9:,.0f} GB checkpoint, FSDP over all ranks, one prefix, dcp_s3 defaults.\n\n"
        f"{t1}\n\n{t2}\n\n"
        f"Requests per second on the busiest prefix with S3StorageWriter(key_prefixes=N) (x = share of "
        f"S3's {PUT_LIMIT:,} PUT/s or {GET_LIMIT:,} GET/s per prefix), assuming one S3 partition per "
        f"p-<h> directory; .metadata is one key in every layout:\n\n{t3}\n\n"
        f"Largest job that stays under {PUT_LIMIT:,} PUT/s and {GET_LIMIT:,} GET/s on every prefix, at "
        f"{args.rank_gbps:g} GB/s per rank, loading on as many ranks as saved (every rank count tried; "
        f"'data objects alone' leaves out the .metadata key):\n\n{t4}\n\n"
        f"The p-<h> directories add {extra} bytes to each .metadata chunk entry at N={widest:,} "
        f"(~{100 * extra / per_entry:.0f}% of the {per_entry:.0f} bytes per entry measured at "
        f"{ranks_list[0]:,} ranks).\n\n~ = extrapolated (.metadata: linearly in chunks from the largest one built; planning: "
        f"per tensor shape, with the growth exponent of the last two measured rank counts).\n"
        "Coordinator planning (torch DefaultSavePlanner.create_global_plan), per tensor:\n"
        + "\n".join(f"- {note}" for note in plan_notes)
    )
    print()
    print(text)
    if args.before_after:
        print("\nissue 14's table, before and after ...", flush=True)
        ba_args = argparse.Namespace(
            bytes_per_param=args.bytes_per_param,
            metadata_max_entries=args.metadata_max_entries,
            plan_max_ranks=args.plan_max_ranks,
            plan_per_shape=1,
            after_max_ranks=min(args.plan_max_ranks, 4096),
            plan_repeat=1,
        )
        ba_text, _ = scale_ranks.report(model, [n for n in ranks_list if n >= 1024] or ranks_list, ba_args)
        print(ba_text)
        text += "\n\nBefore and after (benchmarks.scale_ranks):\n\n" + ba_text
    common.write_json(
        args.out,
        {
            "benchmark": "scale",
            "model": model.name,
            "params": n_params,
            "checkpoint_bytes": total,
            "args": vars(args) | {"out": str(args.out)},
            "machine": common.machine_info(),
            "records": records,
            "planning_notes": plan_notes,
            "largest_job_under_limits_by_key_prefixes": largest,
            "tables_markdown": text,
        },
    )
    args.out.with_suffix(".md").write_text(text + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
