"""The commit protocol: overwrite, crash and concurrent saves never lose or mix a checkpoint.

Saves run in child processes (``tests/commit_child.py``) that stop at a phase of the save —
a real botocore event on the real request — where the test SIGKILLs them, or lets another
save run to the end and then releases them. Everything runs against the session's SeaweedFS.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_s3 import (
    Checkpointer,
    S3StorageReader,
    S3StorageWriter,
    ServerCapabilityError,
    save_object,
)
from dcp_s3._layout import METADATA_KEY, referenced_objects
from dcp_s3._local_server import LocalS3Server
from dcp_s3._metadata.compact import MAGIC as COMPACT_MAGIC
from dcp_s3._metadata.formats import dump_metadata, load_metadata
from tests.fault_proxy import FaultProxy, Rule
from tests.held_child import HeldChild
from tests.objects import data_keys, object_keys
from tests.storage.commit_child import MiB, model, sgd, state, train_a_bit

CHILD = str(Path(__file__).with_name("commit_child.py"))


class Child(HeldChild):
    """A save in another process, held at ``phase`` until released or killed (see commit_child.py)."""

    def __init__(self, env: dict[str, str], tmp: Path, phase: str, *args: str) -> None:
        super().__init__(CHILD, tmp, phase, *args, env=env)


def child_save(env: dict[str, str], tmp: Path, uri: str, seed: int, phase: str, overwrite: bool = True) -> Child:
    return Child(env, tmp, phase, "save", uri, str(seed), "1" if overwrite else "0")


def _blank(big: bool = False) -> dict[str, Any]:
    ref = state(0, big)
    return {"a": torch.zeros_like(ref["a"]), "b": torch.zeros_like(ref["b"]), "meta": {"seed": -1}}


def loaded_seed(uri: str, big: bool = False) -> int:
    """Load the checkpoint at ``uri`` and return the seed of the save it is — checking it is that save, whole."""
    out = _blank(big)
    dcp.load(out, storage_reader=S3StorageReader(uri), no_dist=True)
    seed = out["meta"]["seed"]
    ref = state(seed, big)
    assert torch.equal(out["a"], ref["a"]) and torch.equal(out["b"], ref["b"]), f"checkpoint at {uri} mixes saves"
    return int(seed)


def referenced(s3: LocalS3Server, bucket: str, prefix: str) -> set[str]:
    body = s3.client().get_object(Bucket=bucket, Key=f"{prefix}/{METADATA_KEY}")["Body"].read()
    return {f"{prefix}/{name}" for name in referenced_objects(load_metadata(body, prefix))}


@pytest.fixture
def env(s3_env: LocalS3Server) -> dict[str, str]:
    return s3_env.env()


# -- a save killed at each phase of an overwrite ------------------------------------------------------------
@pytest.mark.parametrize(("phase", "expected"), [("upload", 1), ("commit", 1), ("cleanup", 2)])
def test_killed_overwrite_leaves_old_or_new_checkpoint(
    bucket: str, s3_env: LocalS3Server, env: dict[str, str], tmp_path: Path, phase: str, expected: int
) -> None:
    uri, prefix = f"s3://{bucket}/ck", "ck"
    dcp.save(state(1), storage_writer=S3StorageWriter(uri), no_dist=True)
    old_objects = set(data_keys(s3_env.client(), bucket, "ck/"))
    child = child_save(env, tmp_path, uri, 2, phase)
    child.wait_held()
    child.kill()
    assert loaded_seed(uri) == expected  # bit-exact: the old save before the commit, the new one after
    if expected == 1:
        assert referenced(s3_env, bucket, prefix) == old_objects  # the old checkpoint is untouched
    # The next save replaces the committed checkpoint and deletes exactly its objects.
    replaced = referenced(s3_env, bucket, prefix)
    dcp.save(state(3), storage_writer=S3StorageWriter(uri), no_dist=True)
    assert loaded_seed(uri) == 3
    remaining = set(data_keys(s3_env.client(), bucket, "ck/"))
    assert not remaining & replaced
    # What the killed save wrote and never committed, or did not get to delete, is left for `dcp-s3 gc`:
    # nothing while its upload was unfinished, its complete data object, or the old checkpoint's objects.
    leftover = remaining - referenced(s3_env, bucket, prefix)
    assert len(leftover) == {"upload": 0, "commit": 1}[phase] if phase != "cleanup" else leftover == old_objects


@pytest.mark.parametrize(("phase", "expected"), [("upload", 1), ("commit", 1), ("cleanup", 2)])
def test_killed_local_overwrite_leaves_old_or_new_checkpoint(tmp_path: Path, phase: str, expected: int) -> None:
    """The same on a local directory (``S3StorageWriter`` over the local object store, as the Checkpointer uses)."""
    directory = tmp_path / "ck"
    dcp.save(state(1), storage_writer=S3StorageWriter(directory), no_dist=True)
    old = {p.name for p in directory.glob("*.distcp")}
    child = Child({}, tmp_path, phase, "local", str(directory), "2")
    child.wait_held()
    child.kill()
    out = _blank()
    dcp.load(out, storage_reader=FileSystemReader(directory), no_dist=True)  # torch's own reader
    ref = state(expected)
    assert out["meta"]["seed"] == expected and torch.equal(out["a"], ref["a"]) and torch.equal(out["b"], ref["b"])
    if expected == 1:
        assert old <= {p.name for p in directory.glob("*.distcp")}
    dcp.save(state(3), storage_writer=S3StorageWriter(directory), no_dist=True)
    used = referenced_objects(load_metadata((directory / METADATA_KEY).read_bytes(), "local"))
    assert not used & old and used <= {p.name for p in directory.glob("*.distcp")}


@pytest.mark.parametrize("phase", ["upload", "commit"])
def test_killed_overwrite_with_parts_larger_than_part_size(
    bucket: str, s3_env: LocalS3Server, env: dict[str, str], tmp_path: Path, phase: str
) -> None:
    """Parts sent straight from tensor memory grow past ``part_size`` (up to ``max_direct_part_size``): a save
    killed between two such parts, or with all of them up but before its commit, leaves the old checkpoint
    loading bit-exact, and the next save of that geometry, run through, loads bit-exact."""
    uri = f"s3://{bucket}/big"
    dcp.save(state(1, big=True), storage_writer=S3StorageWriter(uri), no_dist=True)
    old_objects = set(data_keys(s3_env.client(), bucket, "big/"))
    child = Child(env, tmp_path, phase, "save", uri, "2", "1", "big")
    child.wait_held()
    sizes = [int(size) for size in re.findall(r"part \d+: (\d+) bytes", child.kill())]
    assert sizes and min(sizes[:2]) > 5 * MiB, sizes  # the geometry under test: parts past part_size=5 MiB
    assert loaded_seed(uri, big=True) == 1
    assert referenced(s3_env, bucket, "big") == old_objects  # the old checkpoint is untouched
    resave = Child(env, tmp_path, "none", "save", uri, "3", "1", "big")
    code, out = resave.release()
    assert code == 0, out
    assert max(int(size) for size in re.findall(r"part \d+: (\d+) bytes", out)) > 5 * MiB, out
    assert loaded_seed(uri, big=True) == 3


# -- two saves to one path, one held at each phase while the other runs through -----------------------------
@pytest.mark.parametrize(("phase", "expected"), [("upload", 1), ("commit", 1), ("cleanup", 2)])
def test_killed_compact_overwrite_leaves_old_or_new_checkpoint(tmp_path: Path, phase: str, expected: int) -> None:
    """The same with compact ``.metadata`` (the format jobs of thousands of ranks write): the commit
    is still the one rename of ``.metadata``, and the replaced objects come from its object column."""
    directory = tmp_path / "ck"
    dcp.save(state(1), storage_writer=S3StorageWriter(directory, metadata_format="compact"), no_dist=True)
    assert (directory / METADATA_KEY).read_bytes().startswith(COMPACT_MAGIC)
    old = {p.name for p in directory.glob("*.distcp")}
    child = Child({}, tmp_path, phase, "local", str(directory), "2", "compact")
    child.wait_held()
    child.kill()
    out = _blank()
    dcp.load(out, storage_reader=S3StorageReader(directory), no_dist=True)
    ref = state(expected)
    assert out["meta"]["seed"] == expected and torch.equal(out["a"], ref["a"]) and torch.equal(out["b"], ref["b"])
    assert (directory / METADATA_KEY).read_bytes().startswith(COMPACT_MAGIC)
    if expected == 1:
        assert old <= {p.name for p in directory.glob("*.distcp")}
    dcp.save(state(3), storage_writer=S3StorageWriter(directory, metadata_format="compact"), no_dist=True)
    used = referenced_objects(load_metadata((directory / METADATA_KEY).read_bytes(), "local"))
    assert not used & old and used <= {p.name for p in directory.glob("*.distcp")}


@pytest.mark.parametrize(("phase", "winner"), [("upload", "held"), ("commit", "held"), ("cleanup", "other")])
def test_concurrent_overwrites_commit_exactly_one_save(
    bucket: str, s3_env: LocalS3Server, env: dict[str, str], tmp_path: Path, phase: str, winner: str
) -> None:
    uri = f"s3://{bucket}/race"
    dcp.save(state(1), storage_writer=S3StorageWriter(uri), no_dist=True)
    held = child_save(env, tmp_path, uri, 2, phase)
    held.wait_held()
    dcp.save(state(3), storage_writer=S3StorageWriter(uri), no_dist=True)  # the other save runs through
    assert loaded_seed(uri) == 3
    code, out = held.release()
    assert code == 0, out
    assert loaded_seed(uri) == {"held": 2, "other": 3}[winner]
    remaining = set(data_keys(s3_env.client(), bucket, "race/"))
    used = referenced(s3_env, bucket, "race")
    assert used <= remaining
    if phase != "commit":
        assert remaining == used, remaining - used  # every replaced save's objects were deleted
    else:
        # The held save read which checkpoint it replaces before the other one committed: the
        # other save's objects are left over (never used, never loaded) for `dcp-s3 gc`.
        assert len(remaining - used) == 1


@pytest.mark.parametrize("phase", ["upload", "commit"])
def test_concurrent_saves_without_overwrite_one_wins_one_fails(
    bucket: str, s3_env: LocalS3Server, env: dict[str, str], tmp_path: Path, phase: str
) -> None:
    uri = f"s3://{bucket}/excl"
    held = child_save(env, tmp_path, uri, 2, phase, overwrite=False)
    held.wait_held()
    dcp.save(state(3), storage_writer=S3StorageWriter(uri, overwrite=False), no_dist=True)
    code, out = held.release()
    assert code == 3 and "Checkpoint already exists" in out, out
    assert loaded_seed(uri) == 3
    # The loser removed what it had written.
    assert set(data_keys(s3_env.client(), bucket, "excl/")) == referenced(s3_env, bucket, "excl")


# -- the Getting started loop (docs/getting-started.md) re-saving its resume step, killed mid-save -----------------------------------------------
def _resumed(root: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Resume like the next job would: the iteration, and the model and momentum state it restored."""
    m = model(7)  # another init: everything must come from the checkpoint
    optim = sgd(m)
    it = Checkpointer(root, keep_last=1).load({"m": m}, {"m": optim})
    momentum = {f"momentum.{n}": optim.state[p]["momentum_buffer"].clone() for n, p in m.named_parameters()}
    return it, {k: v.clone() for k, v in m.state_dict().items()} | momentum


@pytest.mark.parametrize(
    ("phase", "model_new", "optim_new"),
    # Each part goes to a new generation directory, committed as a whole by the marker: killed before
    # the marker's PUT, every part is the old save's (it used to resume the new model with the old momentum).
    [
        (r"commit:m_model\.[0-9a-f]{16}/\.metadata$", False, False),
        (r"commit:m_optim\.[0-9a-f]{16}/\.metadata$", False, False),
        (r"commit:0001000\.pth$", False, False),
    ],
)
def test_resaving_the_resumed_step_killed_midway_still_resumes(
    bucket: str, env: dict[str, str], tmp_path: Path, phase: str, model_new: bool, optim_new: bool
) -> None:
    root = f"s3://{bucket}/run"
    code, out = Child(env, tmp_path, "none", "step", root, "first").release()
    assert code == 0, out
    it, old = _resumed(root)
    assert it == 1000
    # What the re-save writes: the same steps as the child's, in this process.
    m, optim = model(7), None
    optim = sgd(m)
    Checkpointer(root, keep_last=1).load({"m": m}, {"m": optim})
    train_a_bit(m, optim)
    new = {k: v.clone() for k, v in m.state_dict().items()}
    new |= {f"momentum.{n}": optim.state[p]["momentum_buffer"].clone() for n, p in m.named_parameters()}

    resave = Child(env, tmp_path, phase, "step", root, "resave")
    resave.wait_held()
    resave.kill()
    it, now = _resumed(root)
    assert it == 1000  # the step is still there and complete: the next job resumes from it
    for k, v in now.items():
        is_new = model_new if not k.startswith("momentum.") else optim_new
        assert torch.equal(v, (new if is_new else old)[k]), (k, is_new)


# -- a server that ignores If-None-Match -------------------------------------------------------------------
@pytest.fixture
def no_conditional(moto_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FaultProxy, str]]:
    """moto behind a proxy that drops If-None-Match: a server that overwrites instead of answering 412."""
    with FaultProxy(moto_server.endpoint_url, drop_request_headers={"if-none-match"}) as proxy:
        for name, value in moto_server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy, moto_server.create_bucket(f"nocond-{time.monotonic_ns()}")


def test_server_without_conditional_writes(no_conditional: tuple[FaultProxy, str]) -> None:
    proxy, bucket = no_conditional
    uri = f"s3://{bucket}/ck"
    # overwrite=False cannot be guaranteed there: refused before anything is written.
    with pytest.raises(BaseException) as info:
        dcp.save(state(1), storage_writer=S3StorageWriter(uri, overwrite=False), no_dist=True)
    assert "ignores If-None-Match" in str(info.value) and "require_conditional_writes" in str(info.value)
    assert isinstance(_cause(info.value), ServerCapabilityError), repr(info.value)
    assert proxy.counts["CreateMultipartUpload"] == 0 and proxy.counts["UploadPart"] == 0
    # Opting into the best-effort check: a loud warning, the save works...
    with pytest.warns(RuntimeWarning, match="ignores If-None-Match"):
        dcp.save(
            state(1),
            storage_writer=S3StorageWriter(uri, overwrite=False, require_conditional_writes=False),
            no_dist=True,
        )
    assert loaded_seed(uri) == 1
    # ...the HEAD check still refuses a second save, and the probe ran once per bucket and process.
    probes = proxy.counts["PutObject"]
    with warnings.catch_warnings(), pytest.raises(BaseException, match="Checkpoint already exists"):
        warnings.simplefilter("ignore")
        dcp.save(
            state(2),
            storage_writer=S3StorageWriter(uri, overwrite=False, require_conditional_writes=False),
            no_dist=True,
        )
    assert proxy.counts["PutObject"] == probes
    assert loaded_seed(uri) == 1
    # overwrite=True needs no conditional write at all.
    dcp.save(state(2), storage_writer=S3StorageWriter(uri), no_dist=True)
    assert loaded_seed(uri) == 2


def _cause(exc: BaseException) -> BaseException:
    """The dcp_s3 error inside DCP's CheckpointException."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


# -- steps written by another checkpointer with the same layout ------------------------------------------------
def test_resumes_steps_whose_marker_has_no_format(bucket: str) -> None:
    root = f"s3://{bucket}/theirs"
    m = model(0)
    optim = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    m(torch.ones(2, 16)).sum().backward()
    optim.step()
    sched.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # That checkpointer's save path: one DCP checkpoint per key and kind, then a plain torch.save marker.
    dcp.save(m.state_dict(), storage_writer=S3StorageWriter(f"{root}/0000500.model_model"), no_dist=True)
    dcp.save(
        get_optimizer_state_dict(m, optim), storage_writer=S3StorageWriter(f"{root}/0000500.model_optim"), no_dist=True
    )
    save_object(
        {"iteration": 500, "scheduler": {"model": sched.state_dict()}, "grad_scaler": None, "callbacks": None},
        f"{root}/0000500.pth",
    )

    m2 = model(9)
    optim2 = torch.optim.AdamW(m2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=1, gamma=0.5)
    assert Checkpointer(root).load({"model": m2}, {"model": optim2}, {"model": sched2}) == 500
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"] == 1
    for p, p2 in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(optim.state[p]["exp_avg"], optim2.state[p2]["exp_avg"])
    # A marker that is neither kind is still refused.
    save_object({"something": 1}, f"{root}/0000600.pth")
    dcp.save(m.state_dict(), storage_writer=S3StorageWriter(f"{root}/0000600.model_model"), no_dist=True)
    with pytest.raises(ValueError, match="neither a step marker"):
        Checkpointer(root).load({"model": m2}, path=f"{root}/0000600")


# -- servers without DeleteObjects or ListMultipartUploads (answers played by the proxy) ----------------------
def test_servers_missing_batch_delete_and_upload_listing(
    moto_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rules = [Rule({"DeleteObjects"}, "md5", max_per_request=None), Rule({"ListMultipartUploads"}, "501")]
    with FaultProxy(moto_server.endpoint_url, rules) as proxy:
        for name, value in moto_server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        bucket = moto_server.create_bucket(f"quirks-{time.monotonic_ns()}")
        root = f"s3://{bucket}/run"
        m = model(0)
        ckpt = Checkpointer(root, keep_last=1)
        with pytest.warns(RuntimeWarning, match="does not list multipart uploads"):
            for it in (1, 2, 3):  # retention deletes steps 1 and 2; re-saving 3 deletes its replaced objects
                ckpt.save({"m": m}, iteration=it)
            ckpt.save({"m": m}, iteration=3)
        keys = set(object_keys(moto_server.client(), bucket, "run/"))
        assert not any(k.startswith(("run/0000001", "run/0000002")) for k in keys), keys
        assert len([k for k in keys if k.endswith(".distcp")]) == 1, keys  # only the last save's object
        assert proxy.faults[("DeleteObjects", "md5")] == 1  # learnt once, then one DELETE per key
        assert proxy.counts["DeleteObject"] >= 3
        assert Checkpointer(root).load({"m": model(5)}) == 3


def test_overwrite_cleans_up_where_head_has_no_etag(
    moto_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JuiceFS gateway answers HEAD without an ETag: the writer then compares .metadata's bytes."""
    with FaultProxy(moto_server.endpoint_url, drop_response_headers={("HEAD", "etag")}) as proxy:
        for name, value in moto_server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        bucket = moto_server.create_bucket(f"noetag-{time.monotonic_ns()}")
        uri = f"s3://{bucket}/ck"
        for seed in (1, 2, 3):
            dcp.save(state(seed), storage_writer=S3StorageWriter(uri), no_dist=True)
        assert loaded_seed(uri) == 3
        client = moto_server.client()
        head = S3StorageWriter(uri)._session.object_store.head("ck/.metadata")
        assert head is not None and head.etag == ""
        assert len(data_keys(client, bucket, "ck/")) == 1  # the replaced saves' objects are gone


def test_overwrite_deletes_only_data_objects_a_crafted_metadata_names(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """A .metadata that claims a user's file as its object does not get that file deleted on overwrite."""
    client = s3_env.client()
    uri = f"s3://{bucket}/crafted"
    dcp.save(state(1), storage_writer=S3StorageWriter(uri), no_dist=True)
    client.put_object(Bucket=bucket, Key="crafted/config.yaml", Body=b"lr: 0.1")
    metadata = S3StorageReader(uri).read_metadata()
    next(iter(metadata.storage_data.values())).relative_path = "config.yaml"
    client.put_object(Bucket=bucket, Key=f"crafted/{METADATA_KEY}", Body=dump_metadata(metadata))
    dcp.save(state(2), storage_writer=S3StorageWriter(uri), no_dist=True)
    assert loaded_seed(uri) == 2
    assert client.get_object(Bucket=bucket, Key="crafted/config.yaml")["Body"].read() == b"lr: 0.1"
    # The same on disk.
    directory = tmp_path / "ck"
    dcp.save(state(1), storage_writer=S3StorageWriter(directory), no_dist=True)
    (directory / "config.yaml").write_text("lr: 0.1")
    local = load_metadata((directory / METADATA_KEY).read_bytes(), "local")
    next(iter(local.storage_data.values())).relative_path = "config.yaml"
    (directory / METADATA_KEY).write_bytes(dump_metadata(local))
    dcp.save(state(2), storage_writer=S3StorageWriter(directory), no_dist=True)
    assert (directory / "config.yaml").read_text() == "lr: 0.1"


def test_local_overwrite_false_race_commits_exactly_one(tmp_path: Path) -> None:
    """Two overwrite=False saves to one directory: the commit is an exclusive link, one wins."""
    directory = tmp_path / "ck"

    class RaceAtFirstItem(DefaultSavePlanner):
        ran = False

        def resolve_data(self, write_item: Any) -> Any:
            if not RaceAtFirstItem.ran:  # the other save runs to its commit while this one writes
                RaceAtFirstItem.ran = True
                dcp.save(state(3), storage_writer=S3StorageWriter(directory, overwrite=False), no_dist=True)
            return super().resolve_data(write_item)

    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save(
            state(2),
            storage_writer=S3StorageWriter(directory, overwrite=False),
            planner=RaceAtFirstItem(),
            no_dist=True,
        )
    out = _blank()
    dcp.load(out, storage_reader=FileSystemReader(directory), no_dist=True)
    assert out["meta"]["seed"] == 3 and torch.equal(out["a"], state(3)["a"])
    used = referenced_objects(load_metadata((directory / METADATA_KEY).read_bytes(), "local"))
    assert {p.name for p in directory.glob("*.distcp")} == used  # the loser removed its files
