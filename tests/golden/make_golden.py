"""Write one golden set: the checkpoints a given dcp_s3 version writes, for tests/test_golden.py.

Run it with THAT version's code on the path, never with the code under test::

    git -C <repo> worktree add --detach /tmp/old-0.3.0 <commit that set 0.3.0>
    PYTHONPATH=/tmp/old-0.3.0 python tests/golden/make_golden.py --label 0.3.0 --commit <commit>
    git -C <repo> worktree remove /tmp/old-0.3.0

It starts a throw-away S3 server on 127.0.0.1 (SeaweedFS ``weed mini``, or ``--server moto``)
through that version's ``dcp_s3._local_server``, writes every kind of checkpoint the version
supports (found by looking at its API: compression, key prefixes, compact metadata, local
directories, the Checkpointer), downloads every object of the bucket byte-for-byte into
``tests/golden/<label>/s3/<bucket>/<key>``, writes the local-directory checkpoints under
``tests/golden/<label>/local/`` and describes them all in ``tests/golden/<label>/manifest.json``.
The values come from ``golden_state.py`` (deterministic, independent of dcp_s3). Add the new
set to tests/golden/README.md; tests/test_golden.py picks up every manifest by itself.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# An editable install of another checkout (setuptools' __editable__ finder, last on sys.meta_path)
# would quietly supply the modules an old version lacks: only the PYTHONPATH copy may be imported.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

import golden_state  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

BUCKET = "golden"


def _check_imports(root: Path) -> None:
    """Every dcp_s3 module this process imported comes from ``root`` (the version being written)."""
    for name, module in list(sys.modules.items()):
        if name == "dcp_s3" or name.startswith("dcp_s3."):
            path = Path(getattr(module, "__file__", "") or "").resolve()
            if root not in path.parents:
                raise RuntimeError(f"{name} was imported from {path}, not from {root}")


def _features() -> dict[str, bool]:
    import dcp_s3
    from dcp_s3 import S3StorageWriter

    params = inspect.signature(S3StorageWriter.__init__).parameters
    with tempfile.TemporaryDirectory(prefix="golden-probe-") as probe:
        try:  # does S3StorageWriter take a local directory? (asked by behaviour: modules may move)
            S3StorageWriter(probe)
            local_s3_writer = True
        except dcp_s3.DcpS3Error:
            local_s3_writer = False
    try:
        from dcp_s3.local_writer import SafeFileSystemWriter  # noqa: F401

        safe_fs_writer = True
    except ImportError:
        safe_fs_writer = False
    return {
        "compression": "compression" in params,
        "key_prefixes": "key_prefixes" in params,
        "metadata_format": "metadata_format" in params,
        "local_s3_writer": local_s3_writer,
        "safe_fs_writer": safe_fs_writer,
        "checkpointer": hasattr(dcp_s3, "Checkpointer"),
    }


def _variants(f: dict[str, bool]) -> list[tuple[str, dict[str, Any]]]:
    """(name, S3StorageWriter options) of the plain DCP checkpoints this version can write."""
    out: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    spread: dict[str, Any] = {"files_per_rank": 2}
    if f["key_prefixes"]:
        spread["key_prefixes"] = 4
    out.append(("spread", spread))
    if f["compression"]:
        out.append(("zstd", {"compression": "zstd"}))
    if f["metadata_format"]:
        out.append(("compact", {"metadata_format": "compact"}))
        out.append(("compact-zstd", {"metadata_format": "compact", "compression": "zstd", "key_prefixes": 4}))
    return out


def _entry(
    name: str, where: str, path: str, kind: str, options: dict[str, Any], state: str = "plain"
) -> dict[str, Any]:
    compressed = options.get("compression") is not None
    compact = options.get("metadata_format") == "compact"
    return {
        "name": name,
        "where": where,
        "path": path,
        "kind": kind,
        "state": state,
        "writer_options": options,
        "compressed": compressed,
        "metadata": "compact" if compact else "stock",
        # torch's own FileSystemReader can read it (once downloaded): stock pickle, no dcp_s3 codec.
        "torch_reader": kind == "dcp" and not compressed and not compact,
    }


def _save_plain(uri: str, options: dict[str, Any]) -> None:
    from dcp_s3 import S3StorageWriter

    dcp.save(golden_state.plain_state(), storage_writer=S3StorageWriter(uri, **options))


def _save_floats(uri: str, options: dict[str, Any]) -> None:
    from dcp_s3 import S3StorageWriter

    dcp.save(golden_state.float_state(), storage_writer=S3StorageWriter(uri, **options))


def _block_variants(f: dict[str, bool]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("blocks", {})]
    if f["metadata_format"]:
        out.append(("compact-blocks", {"metadata_format": "compact"}))
    return out


def _save_blocks(uri: str, options: dict[str, Any], block_size: int) -> None:
    """``float_state()`` saved raw, each tensor's payload checksummed in blocks of ``block_size`` bytes (the
    writer's ``BLOCK_SIZE``, set for this save only)."""
    from dcp_s3 import S3StorageWriter
    from dcp_s3._dcp import data_objects

    default = data_objects.BLOCK_SIZE
    data_objects.BLOCK_SIZE = block_size
    try:
        dcp.save(golden_state.float_state(), storage_writer=S3StorageWriter(uri, **options))
    finally:
        data_objects.BLOCK_SIZE = default


def _save_step(root: str) -> None:
    from dcp_s3 import Checkpointer

    model, opt, sched = golden_state.training_objects()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Checkpointer(root).save({"model": model}, {"model": opt}, {"model": sched}, iteration=golden_state.ITERATION)


def _save_resaved_step(root: str) -> bool:
    """The step saved twice at the same iteration (first other values, then the golden ones), as a
    resumed job re-saves it. True if the version then names the parts from the marker (``part_dirs``:
    a re-save all or nothing); else nothing new is written (the re-save replaced the parts in place)."""
    from dcp_s3 import Checkpointer, load_object

    first = golden_state.training_objects(filled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Checkpointer(root).save(
            {"model": first[0]}, {"model": first[1]}, {"model": first[2]}, iteration=golden_state.ITERATION
        )
        _save_step(root)
    return "part_dirs" in load_object(f"{root}/{golden_state.ITERATION:07d}.pth")


def _shard_worker(rank: int, world_size: int, uri: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_s3 import S3StorageWriter

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in golden_state.shard_state().items()}
        dcp.save(state, storage_writer=S3StorageWriter(uri, **options))
        import dcp_s3

        _check_imports(Path(dcp_s3.__file__).resolve().parent.parent)
    finally:
        dist.destroy_process_group()


def _save_sharded(uri: str, options: dict[str, Any]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--shard-worker", str(rank), "--uri", uri, "--options", json.dumps(options)],
                env=env,
            )
        )
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        raise RuntimeError(f"sharded save failed: exit codes {codes}")


def _download(client: Any, bucket: str, dest: Path) -> int:
    n = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.startswith(".dcp_s3-probe"):
                continue
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            assert len(body) == obj["Size"], key
            target = dest / bucket / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label")
    ap.add_argument("--commit", default="")
    ap.add_argument("--server", default="seaweedfs", choices=["seaweedfs", "moto"])
    ap.add_argument("--out", type=Path, default=None, help="default: tests/golden/<label>")
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="versions with block checksums (ItemLocation.block_size): also write `blocks` and `compact-blocks`, "
        "golden_state.float_state() saved raw with this block size (small, so each tensor spans several blocks)",
    )
    ap.add_argument("--shard-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--uri", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.shard_worker is not None:
        _shard_worker(args.shard_worker, 2, args.uri, json.loads(args.options))
        return
    if not args.label:
        ap.error("--label is required")

    import dcp_s3
    from dcp_s3._local_server import LocalS3Server

    here = Path(dcp_s3.__file__).resolve().parent.parent
    if here == HERE.parent.parent:
        print(
            f"warning: writing with the code of this checkout ({here}); a golden set should come from a release",
            file=sys.stderr,
        )
    out: Path = args.out or HERE / args.label
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    features = _features()
    entries: list[dict[str, Any]] = []

    with LocalS3Server.start(args.server) as server:
        os.environ.update(server.env())
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(name, None)
        scratch = tempfile.mkdtemp(prefix="golden-aws-")
        os.environ["AWS_CONFIG_FILE"] = os.path.join(scratch, "config")
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.path.join(scratch, "credentials")
        server.create_bucket(BUCKET)
        for name, options in _variants(features):
            _save_plain(f"s3://{BUCKET}/ckpt/{name}", options)
            entries.append(_entry(name, "s3", f"ckpt/{name}", "dcp", options))
        if features["compression"]:  # float frames large enough to be grouped and compressed
            _save_floats(f"s3://{BUCKET}/ckpt/zstd-floats", {"compression": "zstd"})
            entries.append(
                _entry("zstd-floats", "s3", "ckpt/zstd-floats", "dcp", {"compression": "zstd"}, state="floats")
            )
        if args.block_size:
            for name, options in _block_variants(features):
                _save_blocks(f"s3://{BUCKET}/ckpt/{name}", options, args.block_size)
                entries.append(_entry(name, "s3", f"ckpt/{name}", "dcp", options, state="floats"))
                entries[-1]["block_size"] = args.block_size
        # 2 gloo ranks, each saving its row block of DTensors (Shard(0)), in 2 key prefixes where supported.
        sharded = {"key_prefixes": 2} if features["key_prefixes"] else {}
        _save_sharded(f"s3://{BUCKET}/ckpt/sharded", sharded)
        entries.append(_entry("sharded", "s3", "ckpt/sharded", "dcp", {**sharded, "ranks": 2}, state="shard"))
        if features["checkpointer"]:
            _save_step(f"s3://{BUCKET}/run")
            entries.append(_entry("step", "s3", "run", "step", {}))
            if _save_resaved_step(f"s3://{BUCKET}/resaved"):
                entries.append(_entry("resaved", "s3", "resaved", "step", {}))
            else:
                client = server.client()
                for obj in client.list_objects_v2(Bucket=BUCKET, Prefix="resaved/").get("Contents", []):
                    client.delete_object(Bucket=BUCKET, Key=obj["Key"])
        n = _download(server.client(), BUCKET, out / "s3")
        shutil.rmtree(scratch, ignore_errors=True)

    local = out / "local"
    if features["local_s3_writer"]:
        for name, options in _variants(features):
            _save_plain(str(local / name), options)
            entries.append(_entry(name, "local", f"local/{name}", "dcp", options))
        if features["compression"]:
            _save_floats(str(local / "zstd-floats"), {"compression": "zstd"})
            entries.append(
                _entry("zstd-floats", "local", "local/zstd-floats", "dcp", {"compression": "zstd"}, state="floats")
            )
        if args.block_size:
            for name, options in _block_variants(features):
                _save_blocks(str(local / name), options, args.block_size)
                entries.append(_entry(name, "local", f"local/{name}", "dcp", options, state="floats"))
                entries[-1]["block_size"] = args.block_size
    elif features["safe_fs_writer"]:
        from dcp_s3.local_writer import SafeFileSystemWriter

        dcp.save(golden_state.plain_state(), storage_writer=SafeFileSystemWriter(str(local / "plain")))
        entries.append(_entry("plain", "local", "local/plain", "dcp", {"writer": "SafeFileSystemWriter"}))
    if features["checkpointer"] and (features["local_s3_writer"] or features["safe_fs_writer"]):
        _save_step(str(local / "run"))
        entries.append(_entry("step", "local", "local/run", "step", {}))
        if _save_resaved_step(str(local / "resaved")):
            entries.append(_entry("resaved", "local", "local/resaved", "step", {}))
        else:
            shutil.rmtree(local / "resaved")

    _check_imports(here)
    manifest = {
        "label": args.label,
        "commit": args.commit,
        "version": getattr(dcp_s3, "__version__", "?"),
        "torch": torch.__version__,
        "server": args.server,
        "bucket": BUCKET,
        "features": features,
        "s3_objects": n,
        "checkpoints": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(entries)} checkpoints ({n} S3 objects) to {out}")


if __name__ == "__main__":
    main()
