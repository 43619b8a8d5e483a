"""Hugging Face safetensors in S3, both ways (issue 52): a sharded HF model loaded into 2 gloo ranks' FSDP2 shards,
and a 2-rank FSDP2 checkpoint exported to HF shards, each against what a user does without dcp_s3.

    python -m benchmarks.hf                              # ~10 min here: 1 GiB model, 2 reps, SeaweedFS on tmpfs
    python -m benchmarks.hf --size-mib 256 --reps 1 --only export

LOAD (a Llama-like bf16 model of ``--size-mib``, in ``model-0000i-of-0000N.safetensors`` shards + index, as
``save_pretrained`` writes, put on the server; every rank builds it on ``meta``, ``fully_shard``s each layer and the
root on CPU, and loads its DTensor shards):

* ``dcp_s3``: ``dcp.load(sd, storage_reader=dcp_s3.S3HuggingFaceStorageReader("s3://..."))``;
* ``torch_s3fs``: torch's ``HuggingFaceStorageReader("s3://...")`` over fsspec/s3fs: not possible with torch 2.13
  (``UNSUPPORTED`` says why; the row records the reason);
* ``download_then_load``: rank 0 downloads every file with boto3 ``download_file`` (default TransferConfig) to a
  local folder (one copy per node), then every rank loads it with torch's ``HuggingFaceStorageReader``.

EXPORT (the same model, its FSDP2 shards filled on the 2 ranks):

* ``dcp_s3``: ``dcp.save(sd, storage_writer=dcp_s3.S3HuggingFaceStorageWriter("s3://...", max_shard_size=...))``;
* ``consolidate_then_upload``: ``dcp.save`` with torch's ``HuggingFaceStorageWriter(local, save_distributed=True,
  enable_consolidation=True, fqn_to_index_mapping=<the same shards>)`` (its defaults: one thread), then rank 0
  uploads the consolidated files and the index with boto3 ``upload_file`` (default TransferConfig).

Columns, per rank: wall time of the timed region (both ranks start it after a barrier and end it at a barrier),
bytes read: client side, the bytes the rank receives on its Python sockets over the region (HTTP headers too; for
``download_then_load`` the download phase only, the rest is local file reads), against the bytes of the rank's
shards (its DTensors' local tensors); peak RSS growth (sampled + ``ru_maxrss``); local disk: bytes of the local folder at its fullest. For the
dcp_s3 export, the phases: ``write_data`` (every rank's piece upload), and the coordinator's compose of each shard
and index. Results: ``results/hf.{json,md}``. The machine is shared (2 cores): compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

MiB = 1 << 20
LOADS = ("dcp_s3", "torch_s3fs", "download_then_load")
EXPORTS = ("dcp_s3", "consolidate_then_upload")
INDEX = "model.safetensors.index.json"
#: Rows that cannot run, and why (recorded in the results, not measured).
UNSUPPORTED = {
    ("load", "torch_s3fs"): (
        "torch 2.13's HuggingFaceStorageReader is a FileSystemReader: it lists the path with the local file system "
        "and opens each shard with safetensors.safe_open(filename), which takes a local file name only, so no "
        "fsspec/s3fs path reaches it (dcp.load fails: 'No such file or directory: s3:/bucket/prefix')"
    ),
}


# ------------------------------------------------------------------------------------------------------------
# The model: a Llama-like decoder in bf16, its names as transformers writes them.
# ------------------------------------------------------------------------------------------------------------
def model_shapes(size_mib: int) -> tuple[list[tuple[str, tuple[int, ...]]], str]:
    """(name, shape) of every weight of a Llama-like bf16 model of about ``size_mib`` MiB, and a description."""
    target = size_mib * MiB // 2
    for d in (2048, 1024, 512, 256, 128):
        vocab = 32000 if d >= 1024 else 16 * d
        ffn = d * 11 // 4
        per_layer = 4 * d * d + 3 * d * ffn + 2 * d
        layers = round((target - 2 * vocab * d) / per_layer)
        if layers >= 2:
            break
    layers = max(1, layers)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (d,))]
        shapes += [(p + f"self_attn.{n}_proj.weight", (d, d)) for n in "qkvo"]
        shapes += [(p + "post_attention_layernorm.weight", (d,))]
        shapes += [(p + "mlp.gate_proj.weight", (ffn, d)), (p + "mlp.up_proj.weight", (ffn, d))]
        shapes += [(p + "mlp.down_proj.weight", (d, ffn))]
    shapes += [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    n = sum(_numel(s) for _, s in shapes)
    return shapes, f"Llama-like bf16, d={d}, ffn={ffn}, {layers} layers, vocab {vocab}: {n / 1e6:.0f}M params"


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def shard_map(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> dict[str, int]:
    """save_pretrained's greedy split: name → file index (1-based), a new file where the next tensor would pass."""
    out: dict[str, int] = {}
    index, used = 1, 0
    for name, shape in shapes:
        n = _numel(shape) * 2
        if used and used + n > shard_bytes:
            index, used = index + 1, 0
        out[name] = index
        used += n
    return out


def fill(name: str, shape: tuple[int, ...]) -> Any:
    """The tensor's values: the same in the parent and every rank (seeded by its name)."""
    import torch

    g = torch.Generator().manual_seed(sum(name.encode()) * 7919 + len(name))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def build_fsdp_model(shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
    """A module tree with these parameter names, on ``meta``, ``fully_shard`` per layer and at the root, then
    materialised on CPU (empty)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        root = nn.Module()
        for name, shape in shapes:
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=torch.bfloat16)))
    for layer in root.model.layers.children():
        fully_shard(layer)
    fully_shard(root)
    root.to_empty(device="cpu")
    return root


def local_expected(name: str, shape: tuple[int, ...], rank: int, world: int) -> Any:
    import torch

    return torch.chunk(fill(name, shape), world, dim=0)[rank] if rank < shape[0] else None


# ------------------------------------------------------------------------------------------------------------
# Parent: server, model upload, rank pairs, tables.
# ------------------------------------------------------------------------------------------------------------
def _client(server: Any) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
    )


def put_model(client: Any, bucket: str, prefix: str, shapes: list, mapping: dict[str, int], work: str) -> int:
    """Write the model as save_pretrained would (shards + index) and upload it; returns the tensor bytes."""
    from safetensors.torch import save_file

    files = max(mapping.values())
    names = {i: f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)}
    total = 0
    for i in range(1, files + 1):
        tensors = {n: fill(n, s) for n, s in shapes if mapping[n] == i}
        total += sum(t.nbytes for t in tensors.values())
        path = os.path.join(work, names[i])
        save_file(tensors, path, metadata={"format": "pt"})
        del tensors
        client.upload_file(path, bucket, f"{prefix}/{names[i]}")
        os.unlink(path)
    index = {"metadata": {"total_size": total}, "weight_map": {n: names[mapping[n]] for n, _ in shapes}}
    client.put_object(Bucket=bucket, Key=f"{prefix}/{INDEX}", Body=json.dumps(index).encode())
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    spec: dict[str, Any], env: dict[str, str], world: int = 2, timeout: float = 1200, profile: str | None = None
) -> list[dict]:
    """One process per rank (gloo), each ``python -m benchmarks.hf_child SPEC``; their RESULT dicts. ``profile``:
    a folder where each rank runs under ``py-spy record --nonblocking`` (collapsed stacks per rank and row)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        child_env = dict(os.environ, **env)
        child_env.update(
            RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
        )
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.REPO_ROOT), child_env.get("PYTHONPATH")]))
        child_env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        spy: list[str] = []
        if profile:
            svg = os.path.join(profile, f"{spec['op']}-{spec['method']}-{spec['prefix']}-rank{rank}.txt")
            spy = [
                "py-spy",
                "record",
                "--nonblocking",
                "--threads",
                "--rate",
                "100",
                "--format",
                "raw",
                "-o",
                svg,
                "--",
            ]
        procs.append(
            subprocess.Popen(
                [*spy, sys.executable, "-m", "benchmarks.hf_child", json.dumps(spec)],
                cwd=common.REPO_ROOT,
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return [{"ok": False, "rank": rank, "error": f"timed out after {timeout}s"}]
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
        if line is None:
            tail = " | ".join((err or out).strip().splitlines()[-12:])
            results.append({"ok": False, "rank": rank, "error": f"exit {proc.returncode}: {tail}"})
        else:
            results.append(json.loads(line[len("RESULT ") :]))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=4, help="about this many shard files")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--server", default="seaweedfs_shm", help="benchmarks.servers kind")
    ap.add_argument("--only", default="load,export", help="load, export or both")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--exports", default=",".join(EXPORTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf.json"))
    ap.add_argument("--profile", help="a folder: run every rank under py-spy record (collapsed stacks, --format raw)")
    args = ap.parse_args(argv)
    shapes, desc = model_shapes(args.size_mib)
    total = sum(_numel(s) for _, s in shapes) * 2
    mapping = shard_map(shapes, -(-total // args.shards))
    from benchmarks import servers

    server = servers.start(args.server)
    payload: dict[str, Any] = {"machine": common.machine_info(), "args": vars(args), "model": desc, "rows": []}
    try:
        env = server.env()
        client = _client(server)
        bucket = common.new_bucket_name("hf")
        client.create_bucket(Bucket=bucket)
        with tempfile.TemporaryDirectory(prefix="dcp-s3-bench-hf-") as work:
            put_model(client, bucket, "model", shapes, mapping, work)
        print(f"{desc}; {total / MiB:.0f} MiB in {max(mapping.values())} shards on {args.server}", flush=True)
        base = {"bucket": bucket, "endpoint_url": server.endpoint_url, "size_mib": args.size_mib, "map": mapping}
        base["shards"] = args.shards
        ops = args.only.split(",")
        for rep in range(args.reps):
            if "load" in ops:
                for method in args.loads.split(","):
                    if ("load", method) in UNSUPPORTED:
                        continue
                    rows = run_ranks(
                        {**base, "op": "load", "method": method, "prefix": "model"}, env, profile=args.profile
                    )
                    _record(payload, "load", method, rep, rows)
            if "export" in ops:
                for method in args.exports.split(","):
                    prefix = f"export-{method}-{rep}"
                    rows = run_ranks(
                        {**base, "op": "export", "method": method, "prefix": prefix}, env, profile=args.profile
                    )
                    if all(r.get("ok") for r in rows):
                        rows[0]["index_names"] = _check_export(client, bucket, prefix, len(shapes))
                    _record(payload, "export", method, rep, rows)
    finally:
        server.stop()
    payload["tensor_bytes"] = total
    out = Path(args.out)
    common.write_json(out, payload)
    md = render(payload)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(r["ok"] for r in payload["rows"]) else 1


def _check_export(client: Any, bucket: str, prefix: str, expected: int) -> int:
    """The export's index names every tensor (else the row fails); its count."""
    index = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/{INDEX}")["Body"].read())
    names = len(index["weight_map"])
    if names != expected:
        raise SystemExit(f"{prefix}: the index names {names} tensors, not {expected}")
    return names


def _record(payload: dict, op: str, method: str, rep: int, ranks: list[dict]) -> None:
    ok = all(r.get("ok") for r in ranks)
    row = {"op": op, "method": method, "rep": rep, "ok": ok, "ranks": ranks}
    payload["rows"].append(row)
    if ok:
        t = max(r["seconds"] for r in ranks)
        print(f"{op} {method} rep {rep}: {t:.2f} s", flush=True)
    else:
        print(f"{op} {method} rep {rep}: FAILED {[r.get('error') for r in ranks]}", flush=True)


def render(payload: dict) -> str:
    m = payload["machine"]
    lines = [
        f"# benchmarks.hf ({m.get('time')}, {m.get('cpus')} cores, torch {m.get('torch')}, server "
        f"{payload['args']['server']}, load average at start {m.get('loadavg_at_start')})",
        "",
        f"Model: {payload['model']}, {payload['tensor_bytes'] / MiB:.0f} MiB of tensors. 2 gloo ranks, FSDP2 "
        "(fully_shard on CPU). Median over reps; per-rank columns as rank0 / rank1. Bytes read: client-side "
        "bytes received on the rank's Python sockets over the timed region (HTTP headers included; "
        "download_then_load: the download only, by rank 0).",
        "",
    ]
    for op, methods in (("load", LOADS), ("export", EXPORTS)):
        rows = [r for r in payload["rows"] if r["op"] == op]
        if not rows:
            continue
        base = _median_time(rows, methods[0])
        table = []
        for method in methods:
            mine = [r for r in rows if r["method"] == method]
            if (op, method) in UNSUPPORTED:
                table.append([method, "not possible: " + UNSUPPORTED[(op, method)]])
                continue
            if not mine:
                continue
            good = [r for r in mine if r["ok"]]
            if not good:
                table.append([method, "failed: " + str(mine[0]["ranks"][0].get("error", ""))[:120]])
                continue
            t = _median_time(rows, method)
            cells = [method, common.fmt(t), f"{t / base:.2f}" if base and t else "—"]
            if op == "load":
                cells.append(_per_rank(good, lambda r: r["read_bytes"] / MiB, 0))
                cells.append(_per_rank(good, lambda r: r["read_bytes"] / max(1, r["needed_bytes"]), 2))
            cells.append(_per_rank(good, lambda r: r["rss_growth"] / MiB, 0))
            cells.append(common.fmt(common.median([max(x["disk_bytes"] for x in r["ranks"]) / MiB for r in good]), 0))
            if op == "export":
                cells.append(_phases(good))
            table.append(cells)
        headers = ["method", "time s", "x dcp_s3"]
        if op == "load":
            headers += ["read MiB", "read / needed"]
        headers += ["peak RSS growth MiB", "local disk MiB"]
        if op == "export":
            headers += ["phases (median s)"]
        lines += [f"## {op.upper()}", "", common.markdown_table(headers, table), ""]
    return "\n".join(lines)


def _median_time(rows: list[dict], method: str) -> float | None:
    return common.median([max(x["seconds"] for x in r["ranks"]) for r in rows if r["method"] == method and r["ok"]])


def _per_rank(rows: list[dict], value: Any, digits: int) -> str:
    return " / ".join(common.fmt(common.median([value(r["ranks"][k]) for r in rows]), digits) for k in (0, 1))


def _phases(rows: list[dict]) -> str:
    keys = list(rows[0]["ranks"][0].get("phases", {}))
    return ", ".join(f"{k} {common.fmt(common.median([r['ranks'][0]['phases'][k] for r in rows]))}" for k in keys)


if __name__ == "__main__":
    raise SystemExit(main())
