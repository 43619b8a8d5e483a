"""dcp_s3.integrations.nemo_automodel with ``is_async=True``: NeMo AutoModel 0.7.0's own async save (its
``Checkpointer._do_save`` route: ``dcp.async_save`` with a ``DefaultStager``, a gloo group per part, torch's
checkpoint process) through dcp_s3's writer, committed only after every rank's upload completed.

Real parts: NeMo's ``Checkpointer`` and ``CheckpointLifecycle`` called as its recipes call them
(``BaseRecipe.save_checkpoint``: ``async_wait`` and ``complete_pending`` before each save, ``defer_publication``
after it; ``maybe_wait_for_staging`` before the optimizer step, as ``train_ft`` does; ``finalize`` at the end), an
FSDP2 model on two gloo ranks, SeaweedFS, the fault proxy. Two launches of two processes each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import full, run_ranks
from fault_proxy import FaultProxy, Rule
from objects import object_keys
from test_nemo_automodel import _diff, _packed, _parts, _retained, _train, _unpacked

from dcp_s3.errors import CheckpointNotFoundError, S3TransferError

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

RUN = "run"
UPLOAD_WAIT_S = 60.0  # the deadline of each wait for an upload (async_upload_timeout_s)
STALL_S = 2.0


def _state(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": full(t["model"].state_dict()),
        "optim": full(t["optim"].state_dict()),
        "sched": t["sched"].state_dict(),
    }


def _begin(t: dict[str, Any], path: str) -> None:
    """``BaseRecipe.save_checkpoint`` up to its publication, with ``is_async``."""
    ckpt = t["ckpt"]
    ckpt.async_wait()  # the previous save's upload ...
    ckpt.lifecycle.complete_pending()  # ... and its commit
    ckpt.lifecycle.reserve(path)
    ckpt.save_model(t["model"], path)
    ckpt.save_optimizer(t["optim"], t["model"], path, t["sched"])
    ckpt.save_config({"step": path}, path)


def _not_loadable(t: dict[str, Any], path: str) -> str:
    """What a load of ``path`` meets now (it must be refused: no commit yet)."""
    try:
        t["ckpt"].load_model(t["model"], os.path.join(path, "model"))
    except CheckpointNotFoundError as exc:
        return str(exc)
    return "loaded"


def _async_run(rank: int, world: int, config: dict[str, Any], proxy_url: str) -> bytes:
    os.environ.pop("AWS_ENDPOINT_URL", None)
    t = _parts(rank, world, {**config, "is_async": True, "endpoint_url": proxy_url})
    root, ckpt = config["checkpoint_dir"], t["ckpt"]
    out: dict[str, Any] = {"stager": type(ckpt._model_ctx.stager).__name__}
    for step in (1, 2):
        _train(t)
        path = f"{root}/epoch_0_step_{step}"
        _begin(t, path)
        ckpt.lifecycle.defer_publication(path, best_val_metric=None, metric_key=None)
        out[f"saved_{step}"] = _state(t)
        out[f"future_{step}"] = ckpt._model_ctx.future is not None and ckpt._optim_ctx.future is not None
        # before the upload was waited for and the commit written: the previous step is the latest
        out[f"latest_during_{step}"] = ckpt.latest_checkpoint()
        out[f"load_during_{step}"] = _not_loadable(t, path)
        ckpt.maybe_wait_for_staging()  # train_ft's train step, before optimizer.step()
        _train(t)  # the weights change while the upload runs
    # a loop of one's own: publish right after the save, no async_wait: the commit waits for the uploads (each PUT
    # of this save is held STALL_S by the proxy, so they are still running when publish is called)
    path = f"{root}/epoch_0_step_3"
    _begin(t, path)
    out["saved_3"] = _state(t)
    ckpt.maybe_wait_for_staging()
    _train(t)
    out["after_3"] = _state(t)
    ckpt.lifecycle.publish(path, best_val_metric=None, metric_key=None)
    out["latest_3"] = ckpt.latest_checkpoint()
    ckpt.finalize()  # NeMo's end of training: async_wait, complete_pending, close
    return _packed(out)


def _resume_then_fail(rank: int, world: int, config: dict[str, Any], proxy_url: str) -> bytes:
    os.environ.pop("AWS_ENDPOINT_URL", None)
    t = _parts(rank, world, config)  # a fresh group, a sync checkpointer, other weights: the load restores them
    torch.manual_seed(99)
    for p in t["model"].parameters():
        torch.nn.init.normal_(p.data)
    latest = t["ckpt"].latest_checkpoint()
    t["ckpt"].load_model(t["model"], os.path.join(latest, "model"))
    t["ckpt"].load_optimizer(t["optim"], t["model"], latest, t["sched"])
    out: dict[str, Any] = {"latest": latest, "resumed": _state(t)}
    t["ckpt"].close()

    # every upload of a DCP data object fails: async_wait and the commit raise on every rank, nothing committed
    failing = _parts(rank, world, {**config, "is_async": True, "endpoint_url": proxy_url})
    path = f"{config['checkpoint_dir']}/epoch_0_step_4"
    _begin(failing, path)
    failing["ckpt"].lifecycle.defer_publication(path, best_val_metric=None, metric_key=None)
    for name, call in (
        ("async_wait", failing["ckpt"].async_wait),
        ("commit", failing["ckpt"].lifecycle.complete_pending),
    ):
        try:
            call()
            out[name] = None
        except S3TransferError as exc:
            out[name] = str(exc)
    out["latest_after_failure"] = failing["ckpt"].latest_checkpoint()
    failing["ckpt"].close()
    return _packed(out)


@pytest.mark.multiproc
def test_async_save_commits_after_every_upload(seaweed: Any, bucket: str, tmp_path: Path) -> None:
    """Three async saves (NeMo's recipe order twice, then a publish right after the save), weights changed as soon as
    staging completed; each commit appears only after the uploads; retention keeps two by ownership; fresh processes
    resume the newest bit-exact with the SAVED values; a save whose uploads fail is committed nowhere and fails on
    every rank within the deadline."""
    from dcp_s3._dcp import open_store

    root = f"s3://{bucket}/{RUN}"
    store = open_store(root)
    store.write("epoch_0_step_0/save.0123456789abcdef/model/__0_0.distcp", b"partial")  # a crash's leftovers
    store.write("notes/epoch_0_step_9/readme.txt", b"mine")  # a name NeMo's scheme does not make
    config = {
        "checkpoint_dir": root,
        "max_recent_checkpoints": 2,
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region, "retry_attempts": 1},
        "async_upload_timeout_s": UPLOAD_WAIT_S,
    }
    stall = Rule({"PutObject"}, "stall", key_contains=f"{RUN}/epoch_0_step_3/", stall_s=STALL_S)
    with FaultProxy(seaweed.endpoint_url, [stall]) as proxy:
        first = _unpacked(run_ranks(_async_run, 2, config, proxy.url, timeout=300))
        assert proxy.injected("stall") > 0
    for out in first:
        assert out["stager"] == "DefaultStager" and out["future_1"] and out["future_2"]
        assert out["latest_during_1"] is None
        assert out["latest_during_2"] == f"{root}/epoch_0_step_1"
        for step in (1, 2):
            assert "no committed checkpoint there" in out[f"load_during_{step}"], out[f"load_during_{step}"]
        assert out["latest_3"] == f"{root}/epoch_0_step_3"

    _retained(seaweed.client(), bucket)

    rule = Rule({"PutObject", "CreateMultipartUpload", "UploadPart"}, "500", key_contains=".distcp")
    with FaultProxy(seaweed.endpoint_url, [rule]) as proxy:
        second = _unpacked(run_ranks(_resume_then_fail, 2, config, proxy.url, timeout=300))
        assert proxy.injected("500") > 0
    for rank, out in enumerate(second):
        assert out["latest"] == f"{root}/epoch_0_step_3"
        assert not _diff(out["resumed"], first[rank]["saved_3"]), _diff(out["resumed"], first[rank]["saved_3"])
        assert out["async_wait"] and "async save not committed" in out["async_wait"], out
        assert out["commit"] and "not committed, nothing written" in out["commit"], out
        assert out["latest_after_failure"] == f"{root}/epoch_0_step_3"
    # the saved values, not the ones the weights had when the upload ran
    assert all(_diff(out["after_3"]["model"], out["saved_3"]["model"]) for out in first)
    keys = object_keys(seaweed.client(), bucket)
    assert not [k for k in keys if k.startswith(f"{RUN}/epoch_0_step_4/") and k.endswith("dcp_s3_commit.json")]


def _stalled_then_next(rank: int, world: int, config: dict[str, Any], proxy_url: str) -> bytes:
    os.environ.pop("AWS_ENDPOINT_URL", None)
    t = _parts(rank, world, {**config, "is_async": True, "endpoint_url": proxy_url})
    root, ckpt = config["checkpoint_dir"], t["ckpt"]
    out: dict[str, Any] = {}
    _train(t)
    path = f"{root}/epoch_0_step_1"  # its uploads are held by the proxy far past async_upload_timeout_s
    ckpt.lifecycle.reserve(path)
    ckpt.save_model(t["model"], path)
    ckpt.save_optimizer(
        t["optim"], t["model"], path, t["sched"]
    )  # on main: NeMo's lock, until the model's upload ended
    ckpt.lifecycle.defer_publication(path, best_val_metric=None, metric_key=None)
    for name, call in (("async_wait", ckpt.async_wait), ("commit", ckpt.lifecycle.complete_pending)):
        try:
            call()
            out[name] = None
        except S3TransferError as exc:
            out[name] = str(exc)
    _train(t)
    path = f"{root}/epoch_0_step_2"  # not held: saved and committed while step 1's requests are still held
    _begin(t, path)
    ckpt.lifecycle.publish(path, best_val_metric=None, metric_key=None)
    out["latest"] = ckpt.latest_checkpoint()
    ckpt.close()
    return _packed(out)


@pytest.mark.multiproc
def test_an_upload_past_its_deadline_does_not_hold_the_training_thread(seaweed: Any, bucket: str) -> None:
    """NeMo 0.7.0 holds one lock while an async save's upload runs and takes it again in the next ``async_save``
    (``_nemo_initialize_checkpoint_process``): an upload held by the network held the training thread with it.
    Each upload now fails at ``async_upload_timeout_s``: the saves after it start, step 1 is committed nowhere,
    step 2 is. (On main the first ``save_optimizer`` waits until the proxy lets step 1's requests go: the run
    outlives its hang guard.)"""
    root = f"s3://{bucket}/{RUN}"
    config = {
        "checkpoint_dir": root,
        "endpoint_url": seaweed.endpoint_url,
        # a held request is not cut for minutes (on main the 20 s read_timeout and its retries bounded the wait)
        "storage_options": {"region": seaweed.region, "retry_attempts": 1, "read_timeout": 600.0},
        "async_upload_timeout_s": 4.0,
    }
    held = Rule({"PutObject", "CreateMultipartUpload", "UploadPart"}, "stall", key_contains=f"{RUN}/epoch_0_step_1/")
    held.stall_s = 240.0
    with FaultProxy(seaweed.endpoint_url, [held]) as proxy:
        results = _unpacked(run_ranks(_stalled_then_next, 2, config, proxy.url, timeout=150))
        assert proxy.injected("stall") > 0
    for out in results:
        assert out["async_wait"] and "async save not committed" in out["async_wait"], out
        assert out["commit"] and "not committed" in out["commit"], out
        assert out["latest"] == f"{root}/epoch_0_step_2"
    keys = object_keys(seaweed.client(), bucket)
    assert not [k for k in keys if k.startswith(f"{RUN}/epoch_0_step_1/") and k.endswith("dcp_s3_commit.json")]
