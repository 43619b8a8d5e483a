"""One rank of ``benchmarks.hf``: builds the FSDP2 model, runs one load or export between two barriers, prints
``RESULT {json}`` (see ``benchmarks.hf`` for what each method does and what is measured)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from typing import Any

from benchmarks import common
from benchmarks.hf import INDEX, local_expected, model_shapes

PHASES: dict[str, float] = {}
#: dcp_s3's read_timeout here (its default is 20 s; boto3's, which the other methods use, 60 s): on this shared
#: 2-core machine the server has taken more than 20 s to answer one 64 MiB part, and every retry failed.
READ_TIMEOUT = 120.0


class SocketBytes:
    """Bytes this process receives on Python sockets (``socket.socket.recv``/``recv_into``, patched at the class:
    urllib3/botocore's and so boto3's and dcp_s3's HTTP reads; gloo's C++ sockets are not counted)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        counter = self
        recv_into, recv = socket.socket.recv_into, socket.socket.recv

        def counted_recv_into(sock: socket.socket, buffer: Any, *args: Any) -> int:
            n = recv_into(sock, buffer, *args)
            with counter._lock:
                counter.count += n
            return n

        def counted_recv(sock: socket.socket, *args: Any) -> bytes:
            data = recv(sock, *args)
            with counter._lock:
                counter.count += len(data)
            return data

        socket.socket.recv_into = counted_recv_into  # type: ignore[method-assign]
        socket.socket.recv = counted_recv  # type: ignore[method-assign]


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def _boto3() -> Any:
    import boto3

    return boto3.client("s3")


def _timed_writer(**kwargs: Any) -> Any:
    """dcp_s3's export writer, with the time of its phases recorded in PHASES (write_data per rank; compose of
    each shard, index, on the coordinator)."""
    import dcp_s3._dcp.hf_writer as hfw
    from dcp_s3 import S3HuggingFaceStorageWriter

    real_compose = hfw.compose

    def compose(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_compose(*a, **k)
        finally:
            PHASES["compose"] = PHASES.get("compose", 0.0) + time.perf_counter() - t

    hfw.compose = compose

    class Timed(S3HuggingFaceStorageWriter):
        def _write_all(self, plan: Any, planner: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._write_all(plan, planner)
            finally:
                PHASES["write_data"] = time.perf_counter() - t

        def _finish(self, metadata: Any, results: Any) -> None:
            t = time.perf_counter()
            try:
                super()._finish(metadata, results)
            finally:
                PHASES["finish"] = time.perf_counter() - t

    return Timed(**kwargs)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    # Imported before the timed region, for every method alike (dcp_s3's, boto3's and safetensors' import
    # time is a process's once, not a load's).
    import boto3  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.default_planner  # noqa: F401

    import dcp_s3  # noqa: F401
    import dcp_s3._dcp.hf_writer  # noqa: F401

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes, _ = model_shapes(spec["size_mib"])
    from benchmarks.hf import build_fsdp_model

    model = build_fsdp_model(shapes)
    sd = model.state_dict()
    needed = sum(v.to_local().nbytes for v in sd.values())
    uri = f"s3://{spec['bucket']}/{spec['prefix']}"
    local = os.path.join(tempfile_root(), f"dcp-s3-bench-hf-{spec['bucket']}-{spec['prefix']}")
    method, op = spec["method"], spec["op"]
    downloaded = 0
    out: dict[str, Any] = {"ok": True, "rank": rank, "needed_bytes": needed, "disk_bytes": 0}
    if op == "export":
        with torch.no_grad():
            for name, shape in shapes:
                want = local_expected(name, shape, rank, world)
                got = sd[name].to_local()
                if want is not None and got.numel():
                    got.copy_(want)
    received = SocketBytes()
    dist.barrier()
    received.count = 0
    with common.PeakRSS() as rss:
        t0 = time.perf_counter()
        if op == "load" and method == "dcp_s3":
            from dcp_s3 import S3HuggingFaceStorageReader

            dcp.load(
                sd,
                storage_reader=S3HuggingFaceStorageReader(
                    uri, endpoint_url=spec["endpoint_url"], read_timeout=READ_TIMEOUT
                ),
            )
        elif op == "load" and method == "torch_s3fs":
            dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(uri))
        elif op == "load" and method == "download_then_load":
            if rank == 0:
                os.makedirs(local, exist_ok=True)
                s3 = _boto3()
                index = json.loads(s3.get_object(Bucket=spec["bucket"], Key=f"{spec['prefix']}/{INDEX}")["Body"].read())
                s3.download_file(spec["bucket"], f"{spec['prefix']}/{INDEX}", os.path.join(local, INDEX))
                for name in sorted(set(index["weight_map"].values())):
                    s3.download_file(spec["bucket"], f"{spec['prefix']}/{name}", os.path.join(local, name))
                out["disk_bytes"] = _du(local)
            PHASES["download"] = time.perf_counter() - t0
            downloaded = received.count
            dist.barrier()
            dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(local))
        elif op == "export" and method == "dcp_s3":
            writer = _timed_writer(
                path=uri,
                endpoint_url=spec["endpoint_url"],
                read_timeout=READ_TIMEOUT,
                max_shard_size=_shard_bytes(spec, shapes),
            )
            dcp.save(sd, storage_writer=writer)
        elif op == "export" and method == "consolidate_then_upload":
            writer = dcp.HuggingFaceStorageWriter(
                path=local, save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=spec["map"]
            )
            dcp.save(sd, storage_writer=writer)
            PHASES["save_and_consolidate"] = time.perf_counter() - t0
            if rank == 0:
                out["disk_bytes"] = _du(local)
                t1 = time.perf_counter()
                s3 = _boto3()
                for name in sorted(os.listdir(local)):
                    if os.path.isfile(os.path.join(local, name)):
                        s3.upload_file(os.path.join(local, name), spec["bucket"], f"{spec['prefix']}/{name}")
                PHASES["upload"] = time.perf_counter() - t1
        else:
            raise SystemExit(f"unknown {op} method {method!r}")
        dist.barrier()
        seconds = time.perf_counter() - t0
    read = downloaded if method == "download_then_load" else received.count
    out.update(seconds=seconds, read_bytes=read, rss_growth=rss.growth, phases=dict(PHASES))
    if op == "load":
        for name, shape in shapes[:: max(1, len(shapes) // 5)] + [shapes[-1]]:
            want = local_expected(name, shape, rank, world)
            if want is not None and not torch.equal(sd[name].to_local(), want):
                raise SystemExit(f"rank {rank}: {name} loaded wrong")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local, ignore_errors=True)
    dist.destroy_process_group()
    return out


def tempfile_root() -> str:
    import tempfile

    return os.environ.get("DCP_S3_BENCH_LOCAL_DIR") or tempfile.gettempdir()


def _shard_bytes(spec: dict[str, Any], shapes: list) -> int:
    """The dcp_s3 writer's max_shard_size that gives the same files as ``spec['map']`` (the greedy split)."""
    total = sum(int(torch_numel(s)) * 2 for _, s in shapes)
    return -(-total // spec["shards"])


def torch_numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def main(spec: dict[str, Any]) -> int:
    try:
        result = run(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
