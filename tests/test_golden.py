"""Today's code reads every checkpoint that released versions wrote, bit-exact (tests/golden/).

Each golden set (``tests/golden/<label>/manifest.json``) was written by the code of one release
(see tests/golden/README.md and make_golden.py); the expected values are regenerated here by
``golden_state.py``, never read from a stored result. Local checkpoints are loaded from a copy
in ``tmp_path``; S3 ones are uploaded byte-for-byte to the session's SeaweedFS server first, and
their downloaded copy is also loaded as a local directory (the layouts are the same).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3 import Checkpointer, S3StorageReader
from dcp_s3._cli import main as cli_main
from dcp_s3._local_server import LocalS3Server
from dcp_s3.admin import inspect_checkpoint, list_steps

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

GOLDEN = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("golden_state", GOLDEN / "golden_state.py")
assert _spec is not None and _spec.loader is not None
golden_state = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_state)

MANIFESTS = {p.parent.name: json.loads(p.read_text()) for p in sorted(GOLDEN.glob("*/manifest.json"))}
CASES = [
    pytest.param(label, entry, id=f"{label}-{entry['where']}-{entry['name']}")
    for label, manifest in MANIFESTS.items()
    for entry in manifest["checkpoints"]
]
DCP_CASES = [c for c in CASES if c.values[1]["kind"] == "dcp"]
STEP_CASES = [c for c in CASES if c.values[1]["kind"] == "step"]
TORCH_CASES = [c for c in CASES if c.values[1]["torch_reader"]]


def _stored(label: str, entry: dict[str, Any]) -> Path:
    """Where the checkpoint's files lie in the golden set (an S3 one: its downloaded objects)."""
    root = GOLDEN / label
    if entry["where"] == "s3":
        return root / "s3" / MANIFESTS[label]["bucket"] / entry["path"]
    return root / entry["path"]


def _local_copy(label: str, entry: dict[str, Any], tmp_path: Path) -> Path:
    dest = tmp_path / "copy" / entry["name"]
    shutil.copytree(_stored(label, entry), dest)
    return dest


def _upload(server: LocalS3Server, bucket: str, label: str, entry: dict[str, Any]) -> str:
    """Upload the stored objects byte-for-byte under their original keys; the checkpoint's URI."""
    client = server.client()
    src = _stored(label, entry)
    n = 0
    for f in sorted(src.rglob("*")):
        if f.is_file():
            key = f"{entry['path']}/{f.relative_to(src).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=f.read_bytes())
            n += 1
    assert n > 0, f"no stored objects for {entry['path']}"
    return f"s3://{bucket}/{entry['path']}"


def _uri(label: str, entry: dict[str, Any], tmp_path: Path, server: LocalS3Server, bucket: str) -> str:
    if entry["where"] == "s3":
        return _upload(server, bucket, label, entry)
    return str(_local_copy(label, entry, tmp_path))


def _expected(entry: dict[str, Any]) -> dict[str, Any]:
    states = {"plain": golden_state.plain_state, "shard": golden_state.shard_state, "floats": golden_state.float_state}
    return states[entry["state"]]()


def _load_dcp(reader: Any, entry: dict[str, Any]) -> dict[str, Any]:
    target = golden_state.placeholder(_expected(entry))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(target, storage_reader=reader)
    return target


def test_golden_sets_are_complete() -> None:
    """Every set the README lists is here, with every object its writer downloaded."""
    assert {"0.1.0", "0.2.0"} <= set(MANIFESTS), sorted(MANIFESTS)
    readme = (GOLDEN / "README.md").read_text()
    for label, manifest in MANIFESTS.items():
        assert f"`{label}`" in readme, f"tests/golden/README.md does not list the golden set {label}"
        s3_files = [f for f in (GOLDEN / label / "s3").rglob("*") if f.is_file()]
        assert len(s3_files) == manifest["s3_objects"], label
        for entry in manifest["checkpoints"]:
            assert _stored(label, entry).is_dir(), (label, entry["name"])


@pytest.mark.parametrize(("label", "entry"), DCP_CASES)
def test_dcp_load_bit_exact(
    label: str, entry: dict[str, Any], tmp_path: Path, s3_env: LocalS3Server, bucket: str
) -> None:
    uri = _uri(label, entry, tmp_path, s3_env, bucket)
    golden_state.assert_same(_load_dcp(S3StorageReader(uri), entry), _expected(entry), f"{label}/{entry['name']}")


@pytest.mark.parametrize(("label", "entry"), [c for c in DCP_CASES if c.values[1]["where"] == "s3"])
def test_s3_layout_loads_as_local_directory(label: str, entry: dict[str, Any], tmp_path: Path) -> None:
    """The downloaded objects of an S3 checkpoint are a local checkpoint today's reader loads."""
    path = _local_copy(label, entry, tmp_path)
    loaded = _load_dcp(S3StorageReader(str(path)), entry)
    golden_state.assert_same(loaded, _expected(entry), f"{label}/{entry['name']} (downloaded)")


@pytest.mark.parametrize(("label", "entry"), TORCH_CASES)
def test_torch_filesystem_reader(label: str, entry: dict[str, Any], tmp_path: Path) -> None:
    """Torch's own reader loads the stock, uncompressed ones (it unpickles ``.metadata`` with plain pickle)."""
    path = _local_copy(label, entry, tmp_path)
    loaded = _load_dcp(FileSystemReader(str(path)), entry)
    golden_state.assert_same(loaded, _expected(entry), f"{label}/{entry['name']} (FileSystemReader)")


@pytest.mark.parametrize(("label", "entry"), DCP_CASES)
def test_verify_and_inspect(
    label: str, entry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(_local_copy(label, entry, tmp_path))
    assert cli_main(["verify", path]) == 0, capsys.readouterr()
    want = {k: v for k, v in _flat(_expected(entry)).items() if hasattr(v, "dtype")}
    got = {t.fqn: t for t in inspect_checkpoint(path) if t.kind == "tensor"}
    assert set(got) == set(want)
    for fqn, tensor in want.items():
        assert got[fqn].shape == list(tensor.shape), fqn
        assert got[fqn].dtype == str(tensor.dtype).removeprefix("torch."), fqn


def _same_keys(got: dict[str, Any], want: dict[str, Any], where: str, required: set[str]) -> None:
    assert required <= set(got) & set(want), (where, sorted(required - set(got)))
    for key in set(got) & set(want):
        golden_state.assert_same(got[key], want[key], f"{where}.{key}")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


@pytest.mark.parametrize(("label", "entry"), STEP_CASES)
def test_checkpointer_step(
    label: str,
    entry: dict[str, Any],
    tmp_path: Path,
    s3_env: LocalS3Server,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``Checkpointer.load`` resumes the step: model, optimizer state, scheduler, iteration."""
    root = _uri(label, entry, tmp_path, s3_env, bucket)
    steps = list_steps(root)
    assert [(s.name, s.kind, s.complete) for s in steps] == [("0000007", "step", True)], steps
    model, opt, sched = golden_state.training_objects(filled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        iteration = Checkpointer(root).load({"model": model}, {"model": opt}, {"model": sched})
    assert iteration == golden_state.ITERATION
    want_model, want_opt, want_sched = golden_state.training_objects()
    where = f"{label}/{entry['name']}"
    golden_state.assert_same(dict(model.state_dict()), dict(want_model.state_dict()), f"{where} model")
    got_opt, want_opt_sd = opt.state_dict(), want_opt.state_dict()
    golden_state.assert_same(got_opt["state"], want_opt_sd["state"], f"{where} optimizer state")
    # Hyperparameters: those this torch's AdamW/StepLR have (another torch may add or drop a default).
    assert len(got_opt["param_groups"]) == 1
    _same_keys(
        got_opt["param_groups"][0],
        want_opt_sd["param_groups"][0],
        f"{where} param_groups",
        {"lr", "initial_lr", "betas", "eps", "weight_decay", "params"},
    )
    _same_keys(
        sched.state_dict(),
        want_sched.state_dict(),
        f"{where} scheduler",
        {"step_size", "gamma", "base_lrs", "last_epoch", "_last_lr"},
    )
    assert opt.param_groups[0]["lr"] == 0.01 * 0.5  # StepLR(step_size=2, gamma=0.5) after 3 steps
    assert cli_main(["verify", root]) == 0, capsys.readouterr()


@pytest.mark.parametrize(("label", "entry"), STEP_CASES)
def test_step_parts_load_with_torch(label: str, entry: dict[str, Any], tmp_path: Path) -> None:
    """Each part of a step is a stock DCP checkpoint: torch's FileSystemReader (dcp_to_torch_save) reads it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = _local_copy(label, entry, tmp_path)
    want_model, want_opt, _ = golden_state.training_objects()
    names = {id(p): n for n, p in want_model.named_parameters()}
    # A re-saved step's marker names its part directories, relative to the step (dcp_s3._checkpointer.generations).
    marker = torch.load(root / "0000007.pth", weights_only=True)
    dirs = marker.get("part_dirs", {"model_model": "model_model", "model_optim": "model_optim"})
    loaded = {}
    for part in ("model_model", "model_optim"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(root / f"0000007.{dirs[part]}"), str(tmp_path / f"{part}.pt"))
        loaded[part] = torch.load(tmp_path / f"{part}.pt", weights_only=True)
    golden_state.assert_same(loaded["model_model"], dict(want_model.state_dict()), f"{label}/{entry['name']} model")
    want_state = {names[id(p)]: s for p, s in want_opt.state.items()}
    golden_state.assert_same(loaded["model_optim"]["state"], want_state, f"{label}/{entry['name']} optimizer")
