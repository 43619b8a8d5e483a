"""dcp_s3.integrations.torchtitan: torchtitan 0.3.0's own CheckpointManager code, through dcp_s3.

Real parts: torchtitan's OptimizersContainer, LRSchedulersContainer and ParallelAwareDataloader
(torchdata's StatefulDataLoader), an FSDP2 model on gloo ranks, SeaweedFS behind a proxy that can
stall one request. Every phase runs in fresh processes; what the bucket holds is listed, and no
checkpoint file may appear on local disk (the dump folder, the working directory, the ranks' TMPDIR).
"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from counting_proxy import CountingProxy, reset
from dist_utils import full, run_ranks
from fault_proxy import FaultProxy, Rule
from objects import object_keys
from torch import nn

from dcp_s3.errors import ConfigError

pytestmark = [pytest.mark.multiproc, pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = "run"  # the checkpoint folder's prefix in the bucket


@pytest.fixture(autouse=True)
def _torchtitan_installed() -> None:
    """No silent skip: the full suite's setup (.ci/run, docs/development.md) installs torchtitan. Checked when a
    test runs, not when the module is collected, so that runs selecting other tests (the torch-range subset on
    torch releases torchtitan does not import on) collect this file."""
    try:
        import torchtitan  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "these tests need torchtitan 0.3.0, installed without its dependencies (it pins another torch): "
            "pip install --no-deps torchtitan==0.3.0, then pip install -e '.[test]' for the few it needs"
        ) from exc


class _Numbers(torch.utils.data.IterableDataset):
    """An endless stream of (x, y) pairs, different on each data-parallel rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Any:
        i = 0
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + i)
            yield torch.randn(8, generator=g), torch.randn(1, generator=g)
            i += 1


class _TrainState:
    """What torchtitan's Trainer saves as ``train_state``: the step (a non-tensor value)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def _trainer(rank: int, world: int, config_kwargs: dict[str, Any], dump: str, sd_adapter: Any = None) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from dcp_s3.integrations.torchtitan import S3CheckpointManager

    torch.manual_seed(0)  # the same initial model everywhere (a fresh start overwrites it on load)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)

    class Loader(ParallelAwareDataloader):
        """torchtitan's dataloader, keeping the state it was given (torchdata's state_dict() of a restored
        loader that has not yielded yet counts the restored batches twice: not what was stored)."""

        loaded: dict[str, Any] | None = None

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = dict(state_dict)
            super().load_state_dict(state_dict)

    dataloader = Loader(_Numbers(rank), dp_rank=rank, dp_world_size=world, batch_size=4)
    train_state = _TrainState()
    config = S3CheckpointManager.Config(enable=True, **config_kwargs)
    manager = config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=sd_adapter,
        base_folder=dump,
    )
    assert type(manager) is S3CheckpointManager  # chosen by the config alone
    return {
        "model": model,
        "optimizers": optimizers,
        "lr": lr_schedulers,
        "data": dataloader,
        "state": train_state,
        "manager": manager,
    }


def _step(t: dict[str, Any]) -> float:
    if "batches" not in t:  # after the load, as torchtitan's Trainer does: iter() applies the loaded state
        t["batches"] = iter(t["data"])
    x, y = t["batch"] = next(t["batches"])
    t["optimizers"].zero_grad()
    loss = nn.functional.mse_loss(t["model"](x), y)
    loss.backward()
    t["optimizers"].step()
    t["lr"].step()
    t["state"].step += 1
    return float(loss.item())


def _snapshot(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": full(t["model"].state_dict()),
        "optim": full(t["optimizers"].state_dict()),
        "lr": t["lr"].state_dict(),
        "data": t["data"].state_dict() if t["data"].loaded is None else t["data"].loaded,
        "step": t["state"].step,
    }


def _packed(out: dict[str, Any]) -> bytes:
    """``out`` as bytes: tensors sent through the result queue as shared memory would need this rank's
    temporary directory (moved to ``tmp``) after the rank has exited."""
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _unpacked(results: list[bytes]) -> list[dict[str, Any]]:
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def _child_env(tmp: str) -> None:
    os.environ.pop("AWS_ENDPOINT_URL", None)  # the config's endpoint_url is the only way to the server
    os.environ["TMPDIR"] = tmp  # anything written to a temporary file lands where the test looks


def _first_run(rank: int, world: int, config_kwargs: dict[str, Any], dump: str, tmp: str) -> bytes:
    _child_env(tmp)
    t = _trainer(rank, world, config_kwargs, dump)
    manager = t["manager"]
    out: dict[str, Any] = {"fresh": manager.load()}
    for step in range(1, 5):
        _step(t)
        manager.save(step)  # interval 2: async saves of steps 2 and 4
    # step-4's .metadata PUT is held by the proxy: its upload is still going on while step 5 trains
    _step(t)
    out["overlapped"] = not manager.save_future.done()
    manager.save(5)
    _step(t)
    manager.save(6)
    manager.maybe_wait_for_saving()
    out["at_6"] = _snapshot(t)
    out["loss_7"] = _step(t)
    out["batch_7"] = t["batch"]
    manager.close()
    return _packed(out)


def _resume(rank: int, world: int, config_kwargs: dict[str, Any], dump: str, tmp: str) -> bytes:
    _child_env(tmp)
    t = _trainer(rank, world, config_kwargs, dump)
    manager = t["manager"]
    out: dict[str, Any] = {"loaded": manager.load()}
    out["at_6"] = _snapshot(t)
    out["loss_7"] = _step(t)
    out["batch_7"] = t["batch"]
    manager.save(7)
    _step(t)
    manager.save(8)
    manager.maybe_wait_for_saving()
    out["at_8"] = _snapshot(t)
    manager.close()
    return _packed(out)


def _resharded(
    rank: int, world: int, run_kwargs: dict[str, Any], seed_kwargs: dict[str, Any], dump: str, tmp: str
) -> bytes:
    _child_env(tmp)
    t = _trainer(rank, world, run_kwargs, dump)
    out = {"loaded": t["manager"].load()}
    out["at_8"] = _snapshot(t)
    t["manager"].close()
    # a new run whose folder is empty starts from another run's step (initial_load_path on S3)
    t = _trainer(rank, world, seed_kwargs, dump)
    out["initial"] = t["manager"].load()
    out["initial_model"] = full(t["model"].state_dict())
    t["manager"].close()
    return _packed(out)


def _counted_load(
    rank: int, world: int, config_kwargs: dict[str, Any], urls: list[str], dump: str, tmp: str
) -> dict[str, int]:
    """Save step 2 (and leave an uncommitted step-3 directory), then resume in a new manager: this rank's
    requests of the resume, by operation (each rank has a counting proxy of its own)."""
    _child_env(tmp)
    config_kwargs = {**config_kwargs, "endpoint_url": urls[rank]}
    t = _trainer(rank, world, config_kwargs, dump)
    _step(t)
    t["manager"].save(2)
    t["manager"].close()
    if rank == 0:  # an upload that never committed: rank 0 tries step 3 first, then takes step 2
        t["manager"].storage_options.store(config_kwargs["folder"]).write("step-3/__0_0.distcp", b"partial")
    t = _trainer(rank, world, config_kwargs, dump)
    torch.distributed.barrier()
    reset(urls[rank])
    assert t["manager"].load() is True
    torch.distributed.barrier()
    ops: dict[str, int] = {}
    for op, _, n, _ in reset(urls[rank]).rows:
        ops[op] = ops.get(op, 0) + n
    t["manager"].close()
    return ops


def test_only_rank_0_lists_and_probes_steps_on_resume(
    seaweed: Any, bucket: str, tmp_path: Path, rank_tmp: Path
) -> None:
    """Step discovery is made once for the job: rank 0 lists the folder and HEADs the steps it tries;
    the other ranks send only the reads of their shards."""
    dump, tmp = tmp_path / "dump", rank_tmp
    dump.mkdir()
    proxies = [CountingProxy(seaweed.endpoint_url) for _ in range(2)]
    for p in proxies:
        p.__enter__()
    try:
        run = {
            "folder": f"s3://{bucket}/{RUN}",
            "interval": 2,
            "async_mode": "disabled",
            "storage_options": {"region": seaweed.region},
        }
        per_rank = run_ranks(_counted_load, 2, run, [p.url for p in proxies], str(dump), str(tmp), timeout=180)
    finally:
        for p in proxies:
            p.__exit__(None, None, None)
    print(per_rank)
    assert per_rank[0].get("ListObjects") == 1 and per_rank[0].get("HeadObject") == 2, per_rank
    assert set(per_rank[1]) == {"GetObjectRange"}, per_rank  # no LIST, no HEAD, not even .metadata


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors bit for bit, with their dtypes); empty when equal."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"[:300]]


def _checkpoint_files(roots: list[Path], since: float) -> list[str]:
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]
            for name in filenames:
                path = os.path.join(dirpath, name)
                if (name == ".metadata" or name.endswith(".distcp")) and os.path.getmtime(path) >= since:
                    found.append(path)
    return found


def _steps_in_bucket(client: Any, bucket: str) -> dict[str, set[str]]:
    steps: dict[str, set[str]] = {}
    for key in object_keys(client, bucket, RUN + "/"):
        step, _, name = key[len(RUN) + 1 :].partition("/")
        steps.setdefault(step, set()).add(re.sub(r"\.[0-9a-f]{16}\.distcp$", ".distcp", name))
    return steps


def test_train_resume_reshard_and_purge_through_dcp_s3(
    seaweed: Any, bucket: str, tmp_path: Path, rank_tmp: Path
) -> None:
    since = time.time() - 1
    dump, tmp = tmp_path / "dump", rank_tmp
    dump.mkdir()
    stall = Rule(ops={"PutObject"}, fault="stall", key_contains="step-4/.metadata", stall_s=3.0, limit=1)
    with FaultProxy(seaweed.endpoint_url, [stall]) as proxy:
        run = {
            "folder": f"s3://{bucket}/{RUN}",
            "interval": 2,
            "keep_latest_k": 2,
            "async_mode": "async",
            "endpoint_url": proxy.url,
            "storage_options": {"region": seaweed.region},
        }
        first = _unpacked(run_ranks(_first_run, 2, run, str(dump), str(tmp), timeout=180))
        assert stall.injected == 1
    assert all(r["fresh"] is False for r in first)
    assert all(r["overlapped"] for r in first), "the async upload did not overlap the next training step"
    client = seaweed.client()
    steps = _steps_in_bucket(client, bucket)
    assert set(steps) == {"step-4", "step-6"}, steps  # keep_latest_k=2 purged step-2
    assert steps["step-6"] == {".metadata", "__0_0.distcp", "__1_0.distcp"}, steps

    run["endpoint_url"] = seaweed.endpoint_url
    second = _unpacked(run_ranks(_resume, 2, run, str(dump), str(tmp), timeout=180))
    for before, after in zip(first, second, strict=True):
        assert after["loaded"] is True
        assert _diff(before["at_6"], after["at_6"]) == []  # model, optimizer, lr scheduler, dataloader, step
        assert _diff(before["batch_7"], after["batch_7"]) == []  # the data stream goes on where it was
        assert before["loss_7"] == after["loss_7"]
    assert set(_steps_in_bucket(client, bucket)) == {"step-6", "step-8"}

    seed = {
        **run,
        "folder": f"s3://{bucket}/seeded",
        "async_mode": "disabled",
        "initial_load_path": f"s3://{bucket}/{RUN}/step-6",
    }
    # torchtitan stores the dataloader per data-parallel rank (dataloader.dp_rank_N): a third rank has none
    resharded = {**run, "exclude_from_loading": ["dataloader"]}
    third = _unpacked(run_ranks(_resharded, 3, resharded, seed, str(dump), str(tmp), timeout=180))
    for r in third:
        assert r["loaded"] is True and r["initial"] is True
        at_8 = {k: v for k, v in second[0]["at_8"].items() if k != "data"}  # 3 ranks: other data streams
        assert _diff({k: r["at_8"][k] for k in at_8}, at_8) == []
        assert _diff(r["initial_model"], first[0]["at_6"]["model"]) == []
    assert object_keys(client, bucket, "seeded/") == []  # nothing saved: only loaded from the other run
    assert _checkpoint_files([dump, tmp, Path.cwd()], since) == []


def _pinned_mem_run(rank: int, world: int, config_kwargs: dict[str, Any], dump: str, tmp: str) -> bytes:
    """Steps 1-6 with async_mode="async_with_pinned_mem" (saves of steps 2, 4 and 6), then a resume in a new
    manager. torchtitan makes its DefaultStager with pinned memory, which needs an accelerator; on CPU the
    test gives it the same stager without pinned memory and non-blocking copies before the first save, so
    torchtitan's own route runs: background staging, then torch's upload process with dcp_s3's writer."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    _child_env(tmp)
    t = _trainer(rank, world, config_kwargs, dump)
    manager = t["manager"]
    manager.stager = DefaultStager(StagingOptions(False, True, True, False))
    out: dict[str, Any] = {}
    for step in range(1, 7):
        _step(t)
        manager.save(step)
        manager.maybe_wait_for_staging()  # as torchtitan's Trainer does before the next optimizer step
    manager.maybe_wait_for_saving()
    out["at_6"] = _snapshot(t)
    manager.close()
    t = _trainer(rank, world, {**config_kwargs, "async_mode": "disabled"}, dump)
    out["loaded"] = t["manager"].load()
    out["resumed"] = _snapshot(t)
    t["manager"].close()
    return _packed(out)


def test_async_with_pinned_mem_saves_through_torchs_upload_process(
    seaweed: Any, bucket: str, tmp_path: Path, rank_tmp: Path
) -> None:
    """torchtitan's async_with_pinned_mem route (AsyncCheckpointerType.PROCESS with its DefaultStager) with
    dcp_s3's writer: each step commits from torch's upload process, the purge keeps the newest two committed
    steps (keep_latest_k=2, torchtitan's least), and a resume loads the last bit-exact. (Refused before; on a
    GPU the device check runs the same call with pinned memory: benchmarks/results/gpu.md, "async_save +
    DefaultStager (process)".)"""
    dump, tmp = tmp_path / "dump", rank_tmp
    dump.mkdir()
    run = {
        "folder": f"s3://{bucket}/{RUN}",
        "interval": 2,
        "keep_latest_k": 2,
        "async_mode": "async_with_pinned_mem",
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region},
    }
    ranks = _unpacked(run_ranks(_pinned_mem_run, 2, run, str(dump), str(tmp), timeout=240))
    for r in ranks:
        assert r["loaded"] is True
        assert _diff(r["at_6"], r["resumed"]) == []  # model, optimizer, lr scheduler, dataloader, step
    steps = _steps_in_bucket(seaweed.client(), bucket)
    assert set(steps) == {"step-4", "step-6"}, steps  # step-2 purged once step-6 committed
    assert steps["step-6"] == {".metadata", "__0_0.distcp", "__1_0.distcp"}, steps


#: The test model's names (``nn.Sequential``) -> its names in the Hugging Face export.
HF_NAMES = {
    "0.weight": "model.up.weight",
    "0.bias": "model.up.bias",
    "2.weight": "lm_head.weight",
    "2.bias": "lm_head.b",
}


def _hf_adapter() -> Any:
    """A state-dict adapter of torchtitan's own protocol (``BaseStateDictAdapter``) for the test model."""
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    class Adapter(BaseStateDictAdapter):
        def __init__(self, model_config: Any = None, hf_assets_path: str | None = None) -> None:
            self.hf_assets_path = hf_assets_path

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return {HF_NAMES[k]: v for k, v in state_dict.items()}

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            native = {v: k for k, v in HF_NAMES.items()}
            return {native[k]: v for k, v in hf_state_dict.items()}

        def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
            raise AssertionError("torchtitan's reader is not used for an s3:// export")

    return Adapter()


def _hf_export() -> dict[str, torch.Tensor]:
    """The export's tensors under their HF names: two in bfloat16 (cast to the model's float32 on load)."""
    g = torch.Generator().manual_seed(7)
    shapes = {"model.up.weight": (32, 8), "model.up.bias": (32,), "lm_head.weight": (1, 32), "lm_head.b": (1,)}
    out = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    out["model.up.weight"] = out["model.up.weight"].to(torch.bfloat16)
    out["lm_head.b"] = out["lm_head.b"].to(torch.bfloat16)
    return out


def _put_hf_export(client: Any, bucket: str, prefix: str, *, index: bool = True) -> None:
    """Two safetensors shards written by the released ``safetensors`` and their index, as ``save_pretrained``
    lays them out."""
    import json

    from safetensors.torch import save

    tensors = _hf_export()
    shards = {
        "model-00001-of-00002.safetensors": ["model.up.weight", "model.up.bias"],
        "model-00002-of-00002.safetensors": ["lm_head.weight", "lm_head.b"],
    }
    for shard, names in shards.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{shard}", Body=save({n: tensors[n] for n in names}))
    if index:
        weight_map = {n: shard for shard, names in shards.items() for n in names}
        body = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        client.put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors.index.json", Body=body)


def _hf_initial_load(rank: int, world: int, config_kwargs: dict[str, Any], torn: str, dump: str, tmp: str) -> bytes:
    from dcp_s3.errors import CheckpointNotFoundError

    _child_env(tmp)
    t = _trainer(rank, world, config_kwargs, dump, sd_adapter=_hf_adapter())
    out: dict[str, Any] = {"loaded": t["manager"].load(), "model": full(t["model"].state_dict())}
    t["manager"].close()
    t = _trainer(rank, world, {**config_kwargs, "initial_load_path": torn}, dump, sd_adapter=_hf_adapter())
    try:
        t["manager"].load()
    except CheckpointNotFoundError as exc:  # rank 0's finding, raised on every rank
        out["torn"] = str(exc)
    t["manager"].close()
    return _packed(out)


def test_an_initial_load_in_hf_reads_an_s3_export_into_fsdp_shards(
    seaweed: Any, bucket: str, tmp_path: Path, rank_tmp: Path
) -> None:
    """``initial_load_in_hf`` from an ``s3://`` ``initial_load_path`` (torchtitan refuses a remote one): 2 FSDP2
    ranks load a ``save_pretrained``-style export (two shards and their index, written by the released
    ``safetensors``) through the model's ``sd_adapter`` with dcp_s3's reader, bit-exact (bfloat16 tensors cast to
    the model's float32); an export whose index is missing is refused as incomplete, on every rank, naming it."""
    dump, tmp = tmp_path / "dump", rank_tmp
    dump.mkdir()
    client = seaweed.client()
    _put_hf_export(client, bucket, "hf")
    _put_hf_export(client, bucket, "torn", index=False)
    run = {
        "folder": f"s3://{bucket}/{RUN}",
        "initial_load_path": f"s3://{bucket}/hf",
        "initial_load_in_hf": True,
        "initial_load_model_only": True,
        "async_mode": "disabled",
        "endpoint_url": seaweed.endpoint_url,
        "storage_options": {"region": seaweed.region},
    }
    ranks = _unpacked(run_ranks(_hf_initial_load, 2, run, f"s3://{bucket}/torn", str(dump), str(tmp), timeout=180))
    expected = {native: _hf_export()[hf].float() for native, hf in HF_NAMES.items()}
    for r in ranks:
        assert r["loaded"] is True
        assert _diff(r["model"], expected) == []
        assert f"s3://{bucket}/torn" in r["torn"] and "model.safetensors.index.json" in r["torn"]
    assert object_keys(client, bucket, f"{RUN}/") == []  # nothing saved


def test_the_config_builds_the_manager_and_refuses_what_cannot_work() -> None:
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from dcp_s3.integrations.torchtitan import S3CheckpointManager

    # what torchtitan's Trainer.Config.checkpoint holds, and what its build() makes
    assert issubclass(S3CheckpointManager.Config, BaseCheckpointManager.Config)
    assert S3CheckpointManager.Config._owner is S3CheckpointManager
    assert (
        S3CheckpointManager.Config(folder="s3://b/run")
        .build(**dict.fromkeys(("dataloader", "model_parts", "optimizers", "lr_schedulers", "states", "sd_adapter")))
        .enable
        is False
    )

    assert S3CheckpointManager.Config(enable=True, folder="s3://b/run", async_mode="async_with_pinned_mem").enable
    with pytest.raises(ConfigError, match="no_such_option"):
        S3CheckpointManager.Config(enable=True, folder="s3://b/run", storage_options={"no_such_option": 1})
    hf = {"enable": True, "folder": "s3://b/run", "initial_load_path": "s3://b/hf", "initial_load_in_hf": True}
    assert S3CheckpointManager.Config(**hf, initial_load_model_only=True).initial_load_in_hf  # torchtitan refuses
    with pytest.raises(ConfigError, match="initial_load_model_only"):
        S3CheckpointManager.Config(**hf, initial_load_model_only=False)
    with pytest.raises(ConfigError, match="quantized"):
        S3CheckpointManager.Config(**hf, initial_load_model_only=True, initial_load_in_hf_quantized=True)


@pytest.mark.parametrize("async_mode", ["async", "async_with_pinned_mem"])
def test_a_save_killed_mid_upload_leaves_the_last_committed_step(
    seaweed: Any, bucket: str, tmp_path: Path, rank_tmp: Path, async_mode: str
) -> None:
    """keep_latest_k counts committed steps only: an async upload in progress (SIGKILLed there) and a step a
    crash left without ``.metadata`` count for nothing, so the last committed step survives and loads bit-exact
    (old code counted both, purged steps 2 and 4 while step 6 uploaded, and the kill left no step). With pinned
    memory the upload runs in torch's own upload process, held at the commit and killed with the trainer."""
    import json

    from held_child import HeldChild

    from dcp_s3._dcp import open_store

    child = str(Path(__file__).with_name("titan_child.py"))
    dump, tmp = tmp_path / "dump", rank_tmp
    dump.mkdir()
    folder = f"s3://{bucket}/{RUN}"
    open_store(folder, endpoint_url=seaweed.endpoint_url, region=seaweed.region).write(
        "step-8/__0_0.distcp", b"an earlier save killed mid-upload"
    )
    stall = Rule(ops={"PutObject"}, fault="stall", key_contains="step-6/.metadata", stall_s=300.0, limit=1)
    with FaultProxy(seaweed.endpoint_url, [stall]) as proxy:
        run = {
            "folder": folder,
            "interval": 2,
            "keep_latest_k": 2,
            "async_mode": async_mode,
            "endpoint_url": proxy.url,
            "storage_options": {"region": seaweed.region},
        }
        held = HeldChild(child, tmp_path, "upload", json.dumps(run), str(dump), str(tmp), str(tmp_path / "saved.pt"))
        held.wait_held()
        held.kill()
        assert stall.injected == 1  # the upload (this process's thread, or torch's upload process) was at the commit
        deadline = time.monotonic() + 30
        while held.group_alive():  # the upload process too: nothing is left to commit step 6 later
            assert time.monotonic() < deadline, "a process of the killed job still runs"
            time.sleep(0.1)
    steps = _steps_in_bucket(seaweed.client(), bucket)
    assert ".metadata" in steps["step-2"] and ".metadata" in steps["step-4"], steps
    assert ".metadata" not in steps["step-6"] and ".metadata" not in steps["step-8"], steps
    run["endpoint_url"] = seaweed.endpoint_url
    loader = HeldChild(child, tmp_path, "load", json.dumps(run), str(dump), str(tmp), str(tmp_path / "loaded.pt"))
    code, out = loader.release()
    assert code == 0, out
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)["state"]
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert loaded["loaded"] is True and loaded["state"]["step"] == 4
    assert (
        _diff(
            {k: v for k, v in saved.items() if k != "data"}, {k: v for k, v in loaded["state"].items() if k != "data"}
        )
        == []
    )


@pytest.mark.parametrize(
    ("configured", "args"),
    [
        ({"part_size": 16 << 20, "compression": "zstd"}, ["--checkpoint.storage-options.part-size", "33554432"]),
        ({}, ["--checkpoint.storage-options", "part_size", "33554432"]),
    ],
)
def test_the_documented_command_lines_parse_with_torchtitans_parser(
    configured: dict[str, Any], args: list[str]
) -> None:
    """The README's command-line forms, through what torchtitan's ``ConfigManager.parse_args`` runs on a loaded
    config (``tyro.cli`` with its registry): the dotted form where the config sets ``storage_options``, the
    key-value form where it sets none (each form is refused in the other case)."""
    import dataclasses

    import tyro
    from torchtitan.config.manager import custom_registry

    from dcp_s3.integrations.torchtitan import S3CheckpointManager

    # A trainer config with its checkpoint section (a real type, not a string annotation of this module).
    Trainer = dataclasses.make_dataclass("Trainer", [("checkpoint", S3CheckpointManager.Config)])
    loaded = Trainer(S3CheckpointManager.Config(enable=True, folder="s3://bucket/run1", storage_options=configured))
    parsed = tyro.cli(
        Trainer,
        args=["--checkpoint.endpoint-url", "http://127.0.0.1:8333", *args],
        default=loaded,
        registry=custom_registry,
    )
    assert parsed.checkpoint.storage_options == {**configured, "part_size": 33554432}
    assert parsed.checkpoint.options().as_dict()["endpoint_url"] == "http://127.0.0.1:8333"
