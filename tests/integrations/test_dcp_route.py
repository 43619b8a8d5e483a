"""dcp_s3.integrations.dcp_route: plain dcp.save/load/async_save given only an s3:// id use dcp_s3.

Every check is made on the bucket (dcp_s3's data objects carry a per-save token, torch's writers
write ``__0_0.distcp``): a successful load alone would not show where the bytes went. Marked
``torch_range``: the route replaces a private torch function, so CI runs it on 2.7.1 and 2.15.0 too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from objects import TOKEN, object_keys
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from dcp_s3 import StorageOptions
from dcp_s3._torch_compat import async_save, get_storage_setup, storage_setup_sites
from dcp_s3.errors import ConfigError, DcpS3Error, TorchCompatibilityError
from dcp_s3.integrations import dcp_route

pytestmark = [pytest.mark.torch_range, pytest.mark.filterwarnings("ignore::UserWarning")]

TORCH_ASYNC_SAVE = state_dict_saver.async_save  # torch's own (no route is on when tests are collected)
DCP_S3_DATA = re.compile(rf"__\d+_\d+\.{TOKEN}\.distcp$")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def _zeros() -> dict[str, Any]:
    return {"w": torch.zeros(64, 8), "b": torch.zeros(8), "step": 0}


def _options(server: Any) -> StorageOptions:
    return StorageOptions(endpoint_url=server.endpoint_url, region=server.region)


def _assert_dcp_s3_checkpoint(client: Any, bucket: str, prefix: str) -> None:
    keys = object_keys(client, bucket, prefix + "/")
    assert f"{prefix}/.metadata" in keys, keys
    data = [k for k in keys if k.endswith(".distcp")]
    assert data and all(DCP_S3_DATA.search(k) for k in data), keys


def _assert_torch_hooks() -> None:
    """No route left behind: torch's own functions are back in place."""
    from torch.distributed.checkpoint import _storage_utils

    for module in (state_dict_saver, state_dict_loader):
        assert get_storage_setup(module) is _storage_utils._storage_setup
    assert dcp.async_save is state_dict_saver.async_save is TORCH_ASYNC_SAVE


# -- on two gloo ranks -----------------------------------------------------------------------------


def _ranks_route(rank: int, world: int, endpoint: str, bucket: str, local: str) -> dict[str, Any]:
    os.environ.pop("AWS_ENDPOINT_URL", None)  # the route's options are the only way to the server
    options = StorageOptions(endpoint_url=endpoint)
    state = _state(0)  # the same on both ranks (replicated: torch's planner picks which rank writes each)
    out: dict[str, Any] = {}
    with dcp_route.s3_route(options):
        dcp.save(state, checkpoint_id=f"s3://{bucket}/sync")
        future = async_save(_state(10), checkpoint_id=f"s3://{bucket}/async", no_dist=False)
    future.result()  # started inside the block, finished after it: still through dcp_s3
    dcp_route.enable(options)
    try:
        loaded = _zeros()
        dcp.load(loaded, checkpoint_id=f"s3://{bucket}/sync")
        out["sync_equal"] = all(torch.equal(loaded[k], _state(0)[k]) for k in ("w", "b"))
        loaded = _zeros()
        dcp.load(loaded, checkpoint_id=f"s3://{bucket}/async")
        out["async_equal"] = all(torch.equal(loaded[k], _state(10)[k]) for k in ("w", "b"))
        dcp.save(state, checkpoint_id=os.path.join(local, "ckpt"))  # a local id: torch's FileSystemWriter
    finally:
        dcp_route.disable()
    try:
        dcp.save(state, checkpoint_id=f"s3://{bucket}/outside")
        out["outside"] = "saved"
    except DcpS3Error as exc:
        out["outside"] = f"dcp_s3: {exc}"
    except (Exception, CheckpointException) as exc:  # torch's fsspec route: ImportError without s3fs, else
        out["outside"] = type(exc).__name__  # s3fs's failure (no endpoint) in DCP's CheckpointException
    _assert_torch_hooks()
    return out


@pytest.mark.multiproc
def test_route_on_gloo_ranks_lands_in_the_bucket(seaweed: Any, bucket: str, tmp_path: Path) -> None:
    results = run_ranks(_ranks_route, 2, seaweed.endpoint_url, bucket, os.fspath(tmp_path), timeout=120)
    assert all(r["sync_equal"] and r["async_equal"] for r in results), results
    client = seaweed.client()
    _assert_dcp_s3_checkpoint(client, bucket, "sync")
    _assert_dcp_s3_checkpoint(client, bucket, "async")
    assert {k.rpartition("/")[2].split(".")[0] for k in object_keys(client, bucket, "sync/")} >= {"__0_0", "__1_0"}
    # the local id stayed torch's: FileSystemWriter's names, no token, nothing of it in the bucket
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # outside the route an s3:// id is torch's again: dcp_s3 wrote nothing there
    assert all(not r["outside"].startswith("dcp_s3") for r in results), results
    assert not [k for k in object_keys(client, bucket, "outside/") if DCP_S3_DATA.search(k)]


def _process_async_save(rank: int, world: int, endpoint: str, bucket: str) -> bool:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.pop("AWS_ENDPOINT_URL", None)
    with dcp_route.s3_route({"endpoint_url": endpoint}):
        response: Any = dcp.async_save(
            _state(3), checkpoint_id=f"s3://{bucket}/process", async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )
    getattr(response, "upload_completion", response).result(timeout=120)
    _assert_torch_hooks()
    return True


@pytest.mark.multiproc
def test_an_async_save_uploaded_by_torchs_process_goes_through_dcp_s3(seaweed: Any, bucket: str) -> None:
    """torch's upload process has no route: the writer is made by the wrapped async_save, in the caller,
    and handed to it (without that, the process would pick fsspec for the id)."""
    assert run_ranks(_process_async_save, 1, seaweed.endpoint_url, bucket, timeout=180) == [True]
    _assert_dcp_s3_checkpoint(seaweed.client(), bucket, "process")


# -- in this process ---------------------------------------------------------------------------------


def test_nested_blocks_use_the_innermost_options_and_restore_torch(seaweed: Any, bucket: str) -> None:
    outer = _options(seaweed)
    inner = outer.replace(compression="zstd")
    with dcp_route.s3_route(outer) as got_outer:
        assert got_outer is outer and dcp_route.active_options() is outer
        with dcp_route.s3_route(inner):
            assert dcp_route.active_options() is inner
            dcp.save(_state(1), checkpoint_id=f"s3://{bucket}/inner", no_dist=True)
        assert dcp_route.active_options() is outer
    assert dcp_route.active_options() is None
    _assert_torch_hooks()
    _assert_dcp_s3_checkpoint(seaweed.client(), bucket, "inner")
    loaded = _zeros()
    dcp.load(loaded, storage_reader=outer.reader(f"s3://{bucket}/inner"), no_dist=True)
    assert torch.equal(loaded["w"], _state(1)["w"])
    # the inner block's compression was used: the stored items say so
    metadata = outer.reader(f"s3://{bucket}/inner").read_metadata()
    assert any(getattr(info, "transform_descriptors", None) for info in metadata.storage_data.values())


def _in_threads(*targets: Any) -> list[Any]:
    """Run each target in its own thread; what each returned or raised, in order."""
    results: list[Any] = [None] * len(targets)

    def run(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_blocks_of_two_threads_each_keep_their_own_endpoint(seaweed: Any, moto_server: Any, bucket: str) -> None:
    """Thread A in a block for SeaweedFS, thread B in one for moto, open at once: each save lands at its own
    block's endpoint (a process-wide stack sent both to the block opened last)."""
    moto_server.create_bucket(bucket)
    opened, saved = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)

    def save_in_block(options: StorageOptions, name: str, first: bool) -> str:
        if not first:
            opened.wait()  # B's block opens after A's: the innermost of a process-wide stack
        with dcp_route.s3_route(options):
            if first:
                opened.wait()
            saved.wait()  # both blocks open now
            dcp.save(_state(4), checkpoint_id=f"s3://{bucket}/{name}", no_dist=True)
            saved.wait()
        return name

    results = _in_threads(
        lambda: save_in_block(_options(seaweed), "to-seaweed", True),
        lambda: save_in_block(_options(moto_server), "to-moto", False),
    )
    assert results == ["to-seaweed", "to-moto"], results
    _assert_dcp_s3_checkpoint(seaweed.client(), bucket, "to-seaweed")
    _assert_dcp_s3_checkpoint(moto_server.client(), bucket, "to-moto")
    assert object_keys(seaweed.client(), bucket, "to-moto/") == []
    assert object_keys(moto_server.client(), bucket, "to-seaweed/") == []
    _assert_torch_hooks()


def test_a_thread_without_a_block_refuses_when_open_blocks_disagree(
    seaweed: Any, moto_server: Any, bucket: str
) -> None:
    """A thread with no block of its own takes the route of the blocks open elsewhere only when they agree;
    with two different ones open it is refused, naming both endpoints, and nothing is written."""
    alone = lambda: dcp.save(_state(5), checkpoint_id=f"s3://{bucket}/alone", no_dist=True)  # noqa: E731
    moto_server.create_bucket(bucket)
    with dcp_route.s3_route(_options(seaweed)):
        (agreed,) = _in_threads(alone)  # one route open: the thread takes it
        assert agreed is not None and not isinstance(agreed, BaseException), agreed
        with dcp_route.s3_route(_options(moto_server)):
            (refused,) = _in_threads(alone)
    assert isinstance(refused, ConfigError), refused
    assert seaweed.endpoint_url in str(refused) and moto_server.endpoint_url in str(refused)
    _assert_dcp_s3_checkpoint(seaweed.client(), bucket, "alone")
    assert object_keys(moto_server.client(), bucket) == []
    _assert_torch_hooks()


def test_calls_that_name_their_storage_keep_it(seaweed: Any, bucket: str, tmp_path: Path) -> None:
    """A storage_writer given with the call is torch's business, route or not."""
    writer = dcp.FileSystemWriter(os.fspath(tmp_path / "given"))
    with dcp_route.s3_route(_options(seaweed)):
        dcp.save(_state(2), storage_writer=writer, no_dist=True)
    assert sorted(p.name for p in (tmp_path / "given").iterdir()) == [".metadata", "__0_0.distcp"]
    assert object_keys(seaweed.client(), bucket) == []


def test_options_as_a_mapping_are_checked_when_the_route_starts() -> None:
    with pytest.raises(DcpS3Error, match="no_such_option"), dcp_route.s3_route({"no_such_option": 1}):
        pass
    _assert_torch_hooks()


def test_a_torch_without_the_hook_is_a_clear_error() -> None:
    """The check the route runs before it replaces anything, on modules that lack the hook."""
    assert storage_setup_sites() == (state_dict_saver, state_dict_loader)  # this torch has it
    missing = types.ModuleType("torch.distributed.checkpoint.state_dict_saver")
    with pytest.raises(TorchCompatibilityError, match=r"state_dict_saver\._storage_setup.*does not have"):
        storage_setup_sites([missing])
    reshaped = types.ModuleType("torch.distributed.checkpoint.state_dict_loader")
    reshaped._storage_setup = lambda storage, checkpoint_id, reader, planner: None  # type: ignore[attr-defined]
    with pytest.raises(TorchCompatibilityError, match=r"state_dict_loader\._storage_setup.*takes"):
        storage_setup_sites([reshaped])


def test_the_subpackage_and_the_route_import_no_framework() -> None:
    code = (
        "import sys, dcp_s3.integrations, dcp_s3.integrations.dcp_route\n"
        "frameworks = {'torchtitan', 'lightning', 'lightning_fabric', 'pytorch_lightning', 'accelerate', 'transformers'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in frameworks))\n"
    )
    root = str(Path(__file__).resolve().parents[2])  # this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
