"""dcp_s3.integrations.torch_checkpointing: torch-checkpointing 0.1.1's own code saving to and loading from SeaweedFS.

torch_checkpointing ships no test suite for storage backends: the sdist's ``tests/test_local_filesystem.py``
tests ``LocalFileSystemStorage`` only (it sets up and checks with ``os.listdir`` and local files). The contract it
checks — ``Storage.rename``'s table — is tested here, row by row, against ``S3Storage``. Everything else runs
torch_checkpointing's released ``CheckpointManager`` (its writer, barrier, reader, resharder) on real gloo ranks;
what the bucket holds is read with boto3.
"""

from __future__ import annotations

import io
import os
import queue
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_s3.errors import CheckpointExistsError, CheckpointFormatError, ConfigError, DeletionRefusedError


@pytest.fixture(autouse=True)
def _installed() -> None:
    """No silent skip: CI installs torch-checkpointing (``.[test]``); a missing one fails with the command."""
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "these tests need torch-checkpointing: pip install --no-deps torch-checkpointing==0.1.1"
        ) from exc


def _storage(bucket: str, **options: Any) -> Any:
    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    return S3StorageConfig(f"s3://{bucket}/run", options=options or None).create_storage()


def _keys(s3_env: Any, bucket: str) -> list[str]:
    client = s3_env.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def _stage(storage: Any, name: str, files: dict[str, bytes]) -> None:
    """What torch_checkpointing's writer does before its rename: files into ``tmp_<name>``."""
    for rel, data in files.items():
        with storage.stream_write(Path(f"tmp_{name}/{rel}")) as stream:
            stream.write(data)


def test_bad_settings_fail_when_configured() -> None:
    from dcp_s3.integrations.torch_checkpointing import KeepLast, S3StorageConfig

    with pytest.raises(ConfigError, match="checkpoint_names"):
        S3StorageConfig("s3://bucket/run", checkpoint_names="step_(")
    with pytest.raises(ConfigError, match="no_such_option"):
        S3StorageConfig("s3://bucket/run", options={"no_such_option": 1})
    with pytest.raises(ConfigError, match="temp_dir_prefix"):
        S3StorageConfig("s3://bucket/run", temp_dir_prefix="")
    with pytest.raises(ConfigError, match="KeepLast"):
        KeepLast(0)


# -- Storage.rename's table, row by row -----------------------------------------------------------------


def test_stage_onto_absent_destination_commits_in_place(bucket: str, s3_env: Any) -> None:
    storage = _storage(bucket)
    _stage(storage, "step_1", {"model_0.pt": b"m" * 100, "sub/x.json": b"{}"})
    assert storage.ls(Path("")) == ["tmp_step_1"]  # staged, shown as what it is
    assert not storage.exists(Path("step_1")) and not storage.isdir(Path("step_1"))
    assert storage.exists(Path("tmp_step_1"))
    before = set(_keys(s3_env, bucket))

    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)

    assert storage.ls(Path("")) == ["step_1"]
    assert storage.ls(Path("step_1")) == ["model_0.pt", "sub"] and storage.ls(Path("step_1/sub")) == ["x.json"]
    assert not storage.exists(Path("tmp_step_1"))
    assert storage.read(Path("step_1/model_0.pt")) == b"m" * 100
    assert storage.getsize(Path(f"s3://{bucket}/run/step_1/sub/x.json")) == 2
    after = set(_keys(s3_env, bucket))
    # The commit wrote one marker and removed the claim: no object was copied or moved.
    assert after - before == {"run/step_1/.dcp_s3-commit"}
    assert [k for k in before - after] == [f"run/step_1/.dcp_s3-staged/claims/{storage.attempt}/rank-0"]
    # A fresh storage (another process) sees the same.
    other = _storage(bucket)
    assert other.read(Path("step_1/sub/x.json")) == b"{}" and other.ls(Path("")) == ["step_1"]


def test_a_local_directory_commits_and_reads_like_s3(tmp_path: Path) -> None:
    """The same storage on a local directory (dcp_s3's local object store): the commit lists each writer's
    directory (a key ending in "/", which the local store refuses as an object name) and must still commit."""
    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    storage = S3StorageConfig(str(tmp_path / "run")).create_storage()
    _stage(storage, "step_1", {"model_0.pt": b"m" * 100, "sub/x.json": b"{}"})
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    other = S3StorageConfig(str(tmp_path / "run")).create_storage()
    assert other.ls(Path("")) == ["step_1"] and other.read(Path("step_1/model_0.pt")) == b"m" * 100


def test_stage_onto_committed_destination_raises_and_touches_nothing(bucket: str, s3_env: Any) -> None:
    first, second = _storage(bucket), _storage(bucket)
    _stage(first, "step_1", {"a": b"1"})
    first.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    before = _keys(s3_env, bucket)
    with pytest.raises(CheckpointExistsError) as info:  # a FileExistsError, so an OSError as the table says
        _stage(second, "step_1", {"a": b"2"})
    assert isinstance(info.value, OSError) and "committed" in str(info.value)
    assert _keys(s3_env, bucket) == before
    assert second.read(Path("step_1/a")) == b"1"


def test_stage_onto_populated_plain_directory_or_file_raises(bucket: str) -> None:
    storage = _storage(bucket)
    storage.write(Path("step_2/existing.bin"), b"x")
    storage.write(Path("step_3"), b"a file")
    for name in ("step_2", "step_3"):
        _stage(storage, name, {"a": b"1"})
        with pytest.raises(OSError):
            storage.rename(Path(f"tmp_{name}"), Path(name), is_directory=True)
    assert storage.read(Path("step_2/existing.bin")) == b"x" and storage.read(Path("step_3")) == b"a file"
    assert storage.ls(Path("step_2")) == ["existing.bin"]  # no merge
    assert not storage.exists(Path("step_2/a"))


def test_stage_onto_another_name_is_refused(bucket: str) -> None:
    storage = _storage(bucket)
    _stage(storage, "step_1", {"a": b"1"})
    with pytest.raises(ConfigError, match="only onto"):
        storage.rename(Path("tmp_step_1"), Path("elsewhere"), is_directory=True)
    assert not storage.exists(Path("elsewhere")) and storage.exists(Path("tmp_step_1"))


def test_file_renames_commit_replace_and_refuse_a_directory(bucket: str) -> None:
    storage = _storage(bucket)
    storage.write(Path("f.tmp"), b"one")
    storage.rename(Path("f.tmp"), Path("f"))  # onto absent
    storage.write(Path("f.tmp"), b"two")
    storage.rename(Path("f.tmp"), Path("f"))  # onto an existing file: replaced
    assert storage.read(Path("f")) == b"two" and not storage.exists(Path("f.tmp"))
    storage.write(Path("d/inside"), b"x")
    storage.write(Path("g.tmp"), b"three")
    with pytest.raises(OSError):
        storage.rename(Path("g.tmp"), Path("d"))  # onto a directory
    assert storage.read(Path("g.tmp")) == b"three" and storage.read(Path("d/inside")) == b"x"


# -- memory, reads, one save per load ------------------------------------------------------------------


def test_streams_are_bounded_and_ranged(bucket: str) -> None:
    mib = 1 << 20
    storage = _storage(bucket, part_size=5 * mib, max_concurrency=2, max_range_size=5 * mib)
    data = os.urandom(3 * mib) * 9  # 27 MiB: six parts
    _stage(storage, "step_1", {})
    with storage.stream_write(Path("tmp_step_1/big.pt")) as stream:
        for start in range(0, len(data), 1 * mib):
            stream.write(data[start : start + 1 * mib])
    assert storage._pool.peak_bytes <= (2 + 2) * 5 * mib  # the pool's places x part size, never the object
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)

    with storage.stream_read(Path("step_1/big.pt")) as stream:
        whole = bytearray(len(data))
        assert stream.readinto(whole) == len(data)  # one readinto: concurrent ranged GETs into the buffer
        assert whole == data
        stream.seek(12345)
        assert stream.read(10) == data[12345:12355]
        stream.seek(-7, io.SEEK_END)
        assert stream.read() == data[-7:]


def test_a_save_of_torch_tensors_round_trips_through_torch_load(bucket: str) -> None:
    storage = _storage(bucket)
    state = {"w": torch.randn(64, 33), "b": torch.arange(7, dtype=torch.int64)}
    with storage.stream_write(Path("tmp_step_5/model_0.pt")) as stream:
        torch.save(state, stream)
    storage.rename(Path("tmp_step_5"), Path("step_5"), is_directory=True)
    with storage.stream_read(Path("step_5/model_0.pt")) as stream:
        loaded = torch.load(stream, weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_replaced_object_is_refused_not_read(bucket: str, s3_env: Any) -> None:
    storage = _storage(bucket)
    _stage(storage, "step_1", {"a": b"from the save"})
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    key = next(k for k in _keys(s3_env, bucket) if k.endswith("/a"))
    s3_env.client().put_object(Bucket=bucket, Key=key, Body=b"FROM THE SAVE")  # the same size: the ETag tells
    with pytest.raises(CheckpointFormatError, match="not the object its checkpoint's commit recorded"):
        _storage(bucket).read(Path("step_1/a"))


def test_a_load_keeps_the_save_it_looked_at(bucket: str) -> None:
    """A reader resolves a checkpoint's files through the marker it read when it looked at the directory: a
    re-save of the name in between is never mixed in (its reads fail instead)."""
    writer, reader = _storage(bucket), _storage(bucket)
    _stage(writer, "step_1", {"a": b"save 1", "b": b"save 1"})
    writer.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert reader.exists(Path("step_1"))  # torch_checkpointing's reader looks at the directory first
    assert reader.read(Path("step_1/a")) == b"save 1"
    writer.rmdir(Path("step_1"))
    fresh = _storage(bucket)
    _stage(fresh, "step_1", {"a": b"save 2", "b": b"save 2"})
    fresh.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    with pytest.raises(FileNotFoundError, match="is gone"):
        reader.read(Path("step_1/b"))  # save 1's object is gone; save 2's is not taken for it
    assert reader.exists(Path("step_1")) and reader.read(Path("step_1/b")) == b"save 2"  # the next load


def _marker(s3_env: Any, bucket: str, name: str) -> dict[str, Any]:
    import json

    return json.loads(s3_env.client().get_object(Bucket=bucket, Key=f"run/{name}/.dcp_s3-commit")["Body"].read())


def _claimed_writers(s3_env: Any, bucket: str, name: str) -> set[str]:
    """The writer ids of the claims left in the stage of ``name`` (by attempts that never committed)."""
    import json

    client = s3_env.client()
    keys = [k for k in _keys(s3_env, bucket) if k.startswith(f"run/{name}/.dcp_s3-staged/claims/")]
    return {json.loads(client.get_object(Bucket=bucket, Key=k)["Body"].read())["writer"] for k in keys}


def test_a_restarted_job_saves_an_interrupted_name_again_without_the_dead_attempts_files(
    bucket: str, s3_env: Any
) -> None:
    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    dead, new = "a" * 32, "b" * 32

    def rank(r: int, attempt: str) -> Any:
        return S3StorageConfig(f"s3://{bucket}/run", rank=r, world_size=2, attempt=attempt).create_storage()

    # Attempt "a" of a 2-rank job: both ranks wrote, then it died before the commit.
    _stage(rank(0, dead), "step_2", {"model_0.pt": b"dead 0", "extra.pt": b"only the dead attempt wrote this"})
    _stage(rank(1, dead), "step_2", {"model_1.pt": b"dead 1"})
    dead_writers = _claimed_writers(s3_env, bucket, "step_2")
    assert len(dead_writers) == 2

    # The restarted job (attempt "b"): rank 1 wrote nothing yet, so rank 0 cannot commit, whatever claims the dead
    # attempt left for rank 1.
    new0 = rank(0, new)
    _stage(new0, "step_2", {"model_0.pt": b"new 0"})
    with pytest.raises(CheckpointFormatError, match=r"claims of ranks \[0\].*other attempts are never used"):
        new0.rename(Path("tmp_step_2"), Path("step_2"), is_directory=True)
    _stage(rank(1, new), "step_2", {"model_1.pt": b"new 1"})
    new0.rename(Path("tmp_step_2"), Path("step_2"), is_directory=True)

    marker = _marker(s3_env, bucket, "step_2")
    assert sorted(marker["files"]) == ["model_0.pt", "model_1.pt"]  # not the dead attempt's extra.pt
    assert not set(marker["writers"].values()) & dead_writers
    assert {entry[0] for entry in marker["files"].values()} == set(marker["writers"].values())
    reader = _storage(bucket)
    assert reader.ls(Path("step_2")) == ["model_0.pt", "model_1.pt"]
    assert reader.read(Path("step_2/model_0.pt")) == b"new 0" and reader.read(Path("step_2/model_1.pt")) == b"new 1"
    assert _claimed_writers(s3_env, bucket, "step_2") == dead_writers  # never deleted by inference
    assert any(k.endswith("/extra.pt") for k in _keys(s3_env, bucket))


def test_a_second_save_of_a_name_in_one_attempt_is_refused(bucket: str) -> None:
    """Within one attempt a place is claimed once: a save that failed (the process lived on) is never mixed with the
    next save of its name in that attempt; the refusal names the stage and the command that removes it."""
    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    attempt = "c" * 32
    crashed = S3StorageConfig(f"s3://{bucket}/run", attempt=attempt).create_storage()
    _stage(crashed, "step_2", {"model_0.pt": b"half"})
    retry = S3StorageConfig(f"s3://{bucket}/run", attempt=attempt).create_storage()
    stage = f"s3://{bucket}/run/step_2"
    with pytest.raises(CheckpointExistsError, match=rf"never committed.*dcp-s3 rm {stage}\b"):
        _stage(retry, "step_2", {"model_0.pt": b"whole"})
    assert not retry.exists(Path("step_2")) and retry.ls(Path("")) == ["tmp_step_2"]
    with pytest.raises(ConfigError, match="attempt"):
        S3StorageConfig(f"s3://{bucket}/run", attempt="../x")


# -- a save retried in the same process ------------------------------------------------------------------


class _Unpicklable:
    """An item value torch.save cannot write: the save fails on that file, after the files before it."""

    def __reduce__(self) -> Any:
        raise TypeError("this value cannot be saved")


def test_a_failed_save_retried_in_the_same_process_commits_only_the_retrys_files(bucket: str, s3_env: Any) -> None:
    """One manager (one ``S3Storage``) saves ``step_1``; the save fails after ``extra_0.pt`` was written; the same
    manager saves ``step_1`` again with other items. The commit names only the retry's files: the failed save's
    ``extra_0.pt`` is neither listed nor loaded from ``step_1``, and nothing it wrote is deleted."""
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.schema import ItemSpec

    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    root = f"s3://{bucket}/run"
    config = CheckpointManager.Config(
        items={"model": ItemSpec(required=False)},
        save=SyncCheckpointSaverConfig(),
        storage_config=S3StorageConfig(root),
    )
    manager = CheckpointManager(config)
    try:
        with pytest.raises(Exception, match="cannot be saved"):  # extra_0.pt is written first, then bad_0.pt fails
            manager.save(f"{root}/step_1", {"extra": {"from": "the failed save"}, "bad": _Unpicklable()})
        failed = {
            k for k in _keys(s3_env, bucket) if k.startswith("run/step_1/.dcp_s3-staged/") and "/claims/" not in k
        }
        assert any(k.endswith("/extra_0.pt") for k in failed)

        model = torch.arange(12.0)
        manager.save(f"{root}/step_1", {"model": model})  # the retry: another set of files

        assert sorted(_marker(s3_env, bucket, "step_1")["files"]) == ["model_0.pt"]
        reader = _storage(bucket)
        assert reader.ls(Path("step_1")) == ["model_0.pt"]
        assert not reader.exists(Path("step_1/extra_0.pt"))
        assert torch.equal(manager.load(f"{root}/step_1", into={"model": torch.zeros(12)})["model"], model)
        with pytest.raises(FileNotFoundError, match="extra_0.pt"):
            manager.load(f"{root}/step_1", into={"extra": None})  # on main: the failed save's value
        assert failed <= set(_keys(s3_env, bucket))  # the failed save's objects stay (deleted with the checkpoint)
    finally:
        manager.close()


class _AddNotes:
    """A pre-finalize callback adding a file in a directory of its own to the stage, the way it would on a disk."""

    def __call__(self, args: Any) -> None:
        args.storage.mkdir(Path(args.path) / "notes")
        args.storage.write(Path(args.path) / "notes" / "n.txt", b"added before the commit")


def test_a_callback_making_a_directory_in_the_stage_continues_the_save(bucket: str, s3_env: Any) -> None:
    """A ``mkdir`` in the stage begins a new save only where this save already wrote: a callback's new directory
    does not drop the save's files from its commit."""
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    root = f"s3://{bucket}/run"
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=S3StorageConfig(root), pre_finalize_callback=_AddNotes()
    )
    manager = CheckpointManager(config)
    try:
        manager.save(f"{root}/step_1", {"model": torch.ones(3)})
    finally:
        manager.close()
    assert sorted(_marker(s3_env, bucket, "step_1")["files"]) == ["model_0.pt", "notes/n.txt"]
    assert _storage(bucket).read(Path("step_1/notes/n.txt")) == b"added before the commit"


#: What a pre-finalize callback may do to the stage directory of a save in progress, as it would on a disk: none of
#: it is a save boundary (the sweep of side effects: tests/test_save_boundaries.py). (``ls`` of a stage is refused
#: with ``ConfigError``: which files of a stage belong to this save only the commit says.)
SIDE_EFFECTS = {
    "mkdir": lambda storage, stage: storage.mkdir(stage),
    "exists": lambda storage, stage: (storage.exists(stage), storage.exists(stage / "model_0.pt")),
    "isdir": lambda storage, stage: storage.isdir(stage),
}


class _NotesBesideTheModel:
    """A pre-finalize callback (issue 50, item 1): a side effect on the stage directory itself, where the save
    already wrote ``model_0.pt`` (``mkdir`` of the directory, as on a disk where it exists), then ``notes.json``
    into it."""

    def __init__(self, side_effect: str = "mkdir") -> None:
        self.side_effect = SIDE_EFFECTS[side_effect]

    def __call__(self, args: Any) -> None:
        self.side_effect(args.storage, Path(args.path))
        args.storage.write(Path(args.path) / "notes.json", b'{"note": "beside the model"}')


def _sync_manager(root: str, callback: Any, keep_last: int | None = None) -> Any:
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    from dcp_s3.integrations.torch_checkpointing import KeepLast, S3StorageConfig

    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=S3StorageConfig(root),
        pre_finalize_callback=callback,
        finalize_callback=KeepLast(keep_last) if keep_last else None,
    )
    return CheckpointManager(config)


@pytest.mark.parametrize("side_effect", sorted(SIDE_EFFECTS))
def test_a_callbacks_mkdir_of_the_stage_does_not_drop_the_model_from_the_commit(
    side_effect: str, bucket: str, s3_env: Any
) -> None:
    """A save begins and ends where torch_checkpointing's writer says (its ``write`` call), never at a ``mkdir`` (or
    any other side effect or probe of the storage): the callback's ``mkdir`` of the stage directory and its
    ``notes.json`` stay in the save, the commit names ``model_0.pt`` too, the step loads, and ``KeepLast(1)`` deletes
    the step before only once this one is whole."""
    root = f"s3://{bucket}/run"
    manager = _sync_manager(root, _NotesBesideTheModel(side_effect), keep_last=1)
    try:
        manager.save(f"{root}/step_1", {"model": torch.ones(3)})
        model = torch.arange(6.0)
        manager.save(f"{root}/step_2", {"model": model})
        assert sorted(_marker(s3_env, bucket, "step_2")["files"]) == ["model_0.pt", "notes.json"]
        assert torch.equal(manager.load(f"{root}/step_2", into={"model": torch.zeros(6)})["model"], model)
    finally:
        manager.close()
    assert _storage(bucket).read(Path("step_2/notes.json")) == b'{"note": "beside the model"}'
    assert _storage(bucket).ls(Path("")) == ["step_2"]


class _LoseTheModel:
    """A pre-finalize callback standing for an object of the save lost before the commit (deleted behind the
    storage's back, e.g. by a lifecycle rule or a concurrent ``rm``): the staged ``model_0.pt`` of ``step_2``."""

    def __init__(self, s3_env: Any, bucket: str) -> None:
        self.client, self.bucket = s3_env.client(), bucket

    def __call__(self, args: Any) -> None:
        if not args.path.endswith("tmp_step_2"):
            return
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="run/step_2/")
        keys = [o["Key"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith("/model_0.pt")]
        assert keys
        self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys]})


def test_a_commit_missing_a_file_of_the_save_fails_and_keep_last_deletes_nothing(bucket: str, s3_env: Any) -> None:
    """The commit names every file this save wrote, or the save fails: a file of ``step_2`` gone before its commit
    fails ``manager.save`` (naming the file), ``step_2`` is not committed, and ``KeepLast(1)`` (which runs only
    after a commit) leaves ``step_1`` whole."""
    root = f"s3://{bucket}/run"
    manager = _sync_manager(root, _LoseTheModel(s3_env, bucket), keep_last=1)
    try:
        model = torch.arange(3.0)
        manager.save(f"{root}/step_1", {"model": model})
        with pytest.raises(CheckpointFormatError, match="model_0.pt"):
            manager.save(f"{root}/step_2", {"model": torch.ones(3)})
        assert _storage(bucket).ls(Path("")) == ["step_1", "tmp_step_2"]
        assert torch.equal(manager.load(f"{root}/step_1", into={"model": torch.zeros(3)})["model"], model)
    finally:
        manager.close()


# -- deletion by ownership -----------------------------------------------------------------------------


def test_keep_last_deletes_only_owned_committed_checkpoints(bucket: str, s3_env: Any) -> None:
    storage = _storage(bucket)
    for n in (1, 2, 10, 11):
        _stage(storage, f"step_{n}", {"m": b"x"})
        storage.rename(Path(f"tmp_step_{n}"), Path(f"step_{n}"), is_directory=True)
    _stage(storage, "best", {"m": b"x"})  # committed, but not a name of the scheme
    storage.rename(Path("tmp_best"), Path("best"), is_directory=True)
    _stage(_storage(bucket), "step_0", {"m": b"x"})  # a stage that never committed
    storage.write(Path("step_3/m"), b"plain")  # a scheme name, never committed
    kept = [k for k in _keys(s3_env, bucket) if not re.match(r"run/step_(1|2)/", k)]

    assert storage.keep_last(2) == ["step_1", "step_2"]  # by the numbers in the names, not as strings

    assert _keys(s3_env, bucket) == kept
    for name in ("step_0", "step_3"):  # owned names, not committed
        with pytest.raises(DeletionRefusedError, match="only committed checkpoints"):
            storage.rmdir(Path(name))
    for name in ("best", ""):  # not names of the scheme
        with pytest.warns(UserWarning, match="does not delete"), pytest.raises(DeletionRefusedError):
            storage.rmdir(Path(name))
    assert _keys(s3_env, bucket) == kept
    assert storage.ls(Path("")) == ["best", "step_10", "step_11", "step_3", "tmp_step_0"]


def test_latest_is_the_newest_committed_checkpoint_as_a_url(bucket: str, s3_env: Any) -> None:
    """The s3:// stand-in for the tutorial's latest-checkpoint finder (``Path(root).iterdir()`` sees no bucket)."""
    storage = _storage(bucket)
    assert storage.latest() is None
    for n in (9, 10):
        _stage(storage, f"step_{n}", {"m": b"x"})
        storage.rename(Path(f"tmp_step_{n}"), Path(f"step_{n}"), is_directory=True)
    _stage(storage, "step_11", {"m": b"x"})  # a stage that never committed
    storage.write(Path("step_12/m"), b"plain")  # a scheme name, never committed
    assert storage.latest() == f"s3://{bucket}/run/step_10"  # by number: step_10 after step_9


# -- torch_checkpointing's CheckpointManager on 2 gloo ranks (FSDP2-sharded model) ----------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))


def _manager(root: str, *, sync: bool, keep_last: int | None = None, die_on_rank: int | None = None) -> Any:
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.schema import ItemSpec
    from torch_checkpointing.staging import CheckpointStagerConfig

    from dcp_s3.integrations.torch_checkpointing import KeepLast, S3StorageConfig

    # Generous deadlines (a loaded 2-core machine starts a writer process slowly); a short barrier where a
    # rank is killed on purpose, so that the survivor's wait ends.
    writer = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=20 if die_on_rank is not None else 180)
    if sync:
        save: Any = SyncCheckpointSaverConfig(writer_config=writer)
    else:  # the upload runs in torch_checkpointing's own writer process; no accelerator here
        stager = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
        process = CheckpointProcessConfig(subprocess_init_timeout_secs=180)
        save = AsyncCheckpointSaverConfig(writer_config=writer, staging_config=stager, process_config=process)
    return CheckpointManager(
        CheckpointManager.Config(
            # No resharder: torch-checkpointing 0.1.1's metadata all-gather (which a resharder needs) runs on
            # device="cuda". Each rank saves and loads its own shard (the same 2 ranks on both sides).
            items={"model": ItemSpec()},
            save=save,
            storage_config=S3StorageConfig(root),
            finalize_callback=KeepLast(keep_last) if keep_last else None,
            pre_finalize_callback=_Die(die_on_rank) if die_on_rank is not None else None,
        )
    )


class _Die:
    """A pre-finalize callback killing one rank after it wrote its files, before the barrier and the commit."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, args: Any) -> None:
        import torch.distributed as dist

        if args.storage.rank == self.rank:
            os._exit(9)
        del dist


def _save(rank: int, world: int, root: str, step: int, sync: bool, keep_last: int | None, die: int | None) -> Any:
    from dist_utils import full
    from torch.distributed.fsdp import fully_shard

    model = _model(seed=step)
    fully_shard(model)
    manager = _manager(root, sync=sync, keep_last=keep_last, die_on_rank=die)
    try:
        future = manager.save(f"{root}/step_{step}", {"model": model.state_dict(), "step": step})
        if future is not None:
            future.result(timeout=120)
    finally:
        manager.close()
    return _plain(full(model.state_dict()))


def _plain(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Each tensor as (dtype, shape, bytes): what a rank returns (a tensor would travel by shared memory)."""
    return {k: (str(v.dtype), tuple(v.shape), v.contiguous().numpy().tobytes()) for k, v in state.items()}


def _load(rank: int, world: int, root: str, step: int) -> Any:
    from dist_utils import full
    from torch.distributed.fsdp import fully_shard

    model = _model(seed=12345)  # different weights: the load must overwrite every element
    fully_shard(model)
    manager = _manager(root, sync=True)
    try:
        loaded = manager.load(f"{root}/step_{step}", into={"model": model.state_dict(), "step": 0})
    finally:
        manager.close()
    model.load_state_dict(loaded["model"])
    return _plain(full(model.state_dict())), loaded["step"]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a) and a == b


@pytest.mark.multiproc
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_sharded_save_and_resume_on_two_ranks_bit_exact(bucket: str, s3_env: Any, sync: bool, tmp_path: Path) -> None:
    from dist_utils import run_ranks

    root = f"s3://{bucket}/run"
    saved = run_ranks(_save, 2, root, 7, sync, None, None, timeout=240)
    assert _same(saved[0], saved[1])
    keys = _keys(s3_env, bucket)
    assert "run/step_7/.dcp_s3-commit" in keys and not any(".dcp_s3-staged/claims/" in k for k in keys)
    assert all(k.startswith("run/step_7/") for k in keys)  # no tmp_step_7 objects: nothing was copied
    assert not any(tmp_path.rglob("*.pt"))

    loaded = run_ranks(_load, 2, root, 7, timeout=240)
    for state, step in loaded:
        assert step == 7 and _same(state, saved[0])


def _resave_and_load(rank: int, world: int, root: str, step: int) -> Any:
    """The restarted job: save ``step`` again (a new attempt), then load it."""
    saved = _save(rank, world, root, step, True, None, None)
    return saved, _load(rank, world, root, step)


@pytest.mark.multiproc
def test_a_writer_killed_mid_save_then_the_job_resumes_and_saves_that_step_again(bucket: str, s3_env: Any) -> None:
    from dist_utils import run_ranks

    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    root = f"s3://{bucket}/run"
    first = run_ranks(_save, 2, root, 1, True, None, None, timeout=240)[0]
    with pytest.raises(queue.Empty):  # rank 1 dies (no result comes); rank 0's barrier times out: no commit
        run_ranks(_save, 2, root, 2, True, None, 1, timeout=60)
    storage = S3StorageConfig(root).create_storage()
    assert not storage.exists(Path("step_2")) and storage.ls(Path("")) == ["step_1", "tmp_step_2"]
    dead_writers = _claimed_writers(s3_env, bucket, "step_2")
    dead_objects = {k for k in _keys(s3_env, bucket) if k.startswith("run/step_2/.dcp_s3-staged/")}
    assert len(dead_writers) == 2 and dead_objects  # what the crash left: both ranks had claimed and written

    loaded = run_ranks(_load, 2, root, 1, timeout=240)  # (a) the restarted job resumes from step 1
    assert all(step == 1 and _same(state, first) for state, step in loaded)

    again = run_ranks(_resave_and_load, 2, root, 2, timeout=240)  # (b) and saves step 2 again
    assert all(step == 2 and _same(state, saved) for saved, (state, step) in again)
    marker = _marker(s3_env, bucket, "step_2")
    assert not set(marker["writers"].values()) & dead_writers  # the dead attempt's files are not part of it
    assert dead_objects <= set(_keys(s3_env, bucket))  # and nothing of it was deleted by inference
    assert storage.ls(Path("")) == ["step_1", "step_2"]

    run_ranks(_save, 2, root, 3, False, 1, None, timeout=240)  # KeepLast(1) after the commit
    assert storage.ls(Path("")) == ["step_3"]
    assert not any(k.startswith(("run/step_1/", "run/step_2/")) for k in _keys(s3_env, bucket))
