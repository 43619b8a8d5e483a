"""Absent is not unavailable, swept over the "which checkpoints are committed / which is the latest" lookups of the
core and of the integrations (issue 50's rule): a server error on the newest checkpoint's commit object raises
``S3TransferError`` naming it; it never makes the lookup answer an older checkpoint (a rollback) or count one fewer
(a retention deleting the wrong one). The Checkpointer's own load: ``tests/checkpointer/test_absent_not_unavailable.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fault_proxy import FaultProxy, Rule

from dcp_s3 import ClientConfig, S3TransferError
from dcp_s3._checkpointer import latest_checkpoint
from dcp_s3._dcp import open_store
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._local_server import LocalS3Server
from dcp_s3.integrations import lightning_io, nemo_commit
from dcp_s3.integrations.trainer_dirs import LocalDirs

#: torch_checkpointing's commit marker (``dcp_s3.integrations.torch_checkpointing.commit.MARKER``; that package
#: imports torch_checkpointing, which the torch-range environments lack).
TC_MARKER = ".dcp_s3-commit"
FAST = ClientConfig(retry_attempts=2, read_timeout=2.0, connect_timeout=2.0)


def _torch_checkpointing(root: str, endpoint: str) -> Any:
    tc_retention = pytest.importorskip("dcp_s3.integrations.torch_checkpointing.retention")  # torch >= 2.11 only
    store = open_store(root, endpoint_url=endpoint, client=FAST)
    return tc_retention.committed_checkpoints(store, root, r"step_[0-9]+", "")


def _options(endpoint: str) -> StorageOptions:
    return StorageOptions.of({"endpoint_url": endpoint, "client": FAST})


def _lightning_list(root: str, endpoint: str) -> Any:
    return lightning_io.list_checkpoints(root, _options(endpoint))


def _lightning_exists(root: str, endpoint: str) -> Any:
    return lightning_io.checkpoint_exists(f"{root}/b.ckpt", _options(endpoint))


def _latest_step(root: str, endpoint: str) -> Any:
    return latest_checkpoint(root, endpoint_url=endpoint, client=FAST)


def _torchtitan(root: str, endpoint: str) -> Any:
    """torchtitan's resume lookup (``S3CheckpointManager._find_load_step``, the manager's own method) on a manager
    holding just what that method reads: building one needs torchtitan's whole job config and model parts."""
    titan = pytest.importorskip("dcp_s3.integrations.torchtitan")
    manager = object.__new__(titan.S3CheckpointManager)
    manager.folder, manager._folder_store, manager._store_lock = "s3://elsewhere/run", None, threading.Lock()
    manager.storage_options = _options(endpoint)
    return manager._find_load_step(root)


def _nemo_names(root: str, endpoint: str) -> Any:
    return nemo_commit.Saves(
        StorageOptions.of({"endpoint_url": endpoint, "client": FAST}), root, "test"
    ).committed_names()


def _nemo_latest(root: str, endpoint: str) -> Any:
    return nemo_commit.Saves(_options(endpoint), root, "test").latest()


def _trainer_rotation(root: str, endpoint: str) -> Any:
    """The transformers Trainer's rotation mirrored to the bucket (``route_fsdp_checkpoints(local_dirs=...)``):
    this process saved ``checkpoint-2``'s shards, the Trainer removed its local directory; whether the S3 copy is
    committed (and so deletable) is asked of the store. An error there must raise, not answer "not committed"."""
    with tempfile.TemporaryDirectory() as out:
        dirs = LocalDirs({out: root}, _options(endpoint))
        part = os.path.join(out, "checkpoint-2", "pytorch_model_fsdp_0")
        os.makedirs(part)
        dirs.record_save(part)
        removed = dirs.present()
        shutil.rmtree(os.path.join(out, "checkpoint-2"))
        return dirs.mirror(removed)


#: lookup -> (objects that commit two checkpoints, the newest one's commit key, the operation that fails on it)
LOOKUPS: dict[str, tuple[Callable[[str, str], Any], list[str], str, str]] = {
    "torch_checkpointing committed (KeepLast)": (
        _torch_checkpointing,
        [f"step_1/{TC_MARKER}", f"step_2/{TC_MARKER}"],
        f"step_2/{TC_MARKER}",
        "HeadObject",
    ),
    "Lightning checkpoints listed (S3ModelCheckpoint's last/rotation)": (
        _lightning_list,
        ["a.ckpt/.metadata", "b.ckpt/.metadata"],
        "b.ckpt/.metadata",
        "HeadObject",
    ),
    "Lightning checkpoint_exists (resume)": (_lightning_exists, ["b.ckpt/.metadata"], "b.ckpt/.metadata", "HeadObject"),
    "dcp_s3._checkpointer.latest_checkpoint": (
        _latest_step,
        ["0000001.pth", "0000001.model_model/.metadata", "0000002.pth", "0000002.model_model/.metadata"],
        "0000002.model_model/.metadata",
        "HeadObject",
    ),
    "torchtitan's latest step (resume)": (
        _torchtitan,
        ["step-10/.metadata", "step-20/.metadata"],
        "step-20/.metadata",
        "HeadObject",
    ),
    "transformers Trainer's rotation mirrored (route_fsdp_checkpoints local_dirs)": (
        _trainer_rotation,
        ["checkpoint-1/pytorch_model_fsdp_0/.metadata", "checkpoint-2/pytorch_model_fsdp_0/.metadata"],
        "checkpoint-2/pytorch_model_fsdp_0/.metadata",
        "HeadObject",
    ),
    "NeMo committed names (max_recent_checkpoints)": (
        _nemo_names,
        [f"epoch_0_step_1/{nemo_commit.COMMIT}", f"epoch_0_step_2/{nemo_commit.COMMIT}"],
        f"epoch_0_step_2/{nemo_commit.COMMIT}",
        "HeadObject",
    ),
    "NeMo latest (resume)": (
        _nemo_latest,
        [f"epoch_0_step_1/{nemo_commit.COMMIT}", f"epoch_0_step_2/{nemo_commit.COMMIT}"],
        f"epoch_0_step_2/{nemo_commit.COMMIT}",
        "GetObject",
    ),
}


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_a_server_error_on_the_newest_commit_raises(lookup: str, s3_env: LocalS3Server, bucket: str) -> None:
    fn, keys, failing, op = LOOKUPS[lookup]
    client = s3_env.client()
    for key in keys:
        client.put_object(Bucket=bucket, Key=f"run/{key}", Body=b"{}")
    rule = Rule({op}, "500", key_contains=f"run/{failing}")
    with FaultProxy(s3_env.endpoint_url, [rule]) as proxy, pytest.raises(S3TransferError) as info:
        fn(f"s3://{bucket}/run", proxy.url)
    assert rule.injected > 0
    assert failing in str(info.value)


def test_the_sweeps_marker_is_torch_checkpointings() -> None:
    commit = pytest.importorskip("dcp_s3.integrations.torch_checkpointing.commit")
    assert commit.MARKER == TC_MARKER
