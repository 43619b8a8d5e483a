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
        raise ImportError("these tests need torch-checkpointing: pip install --no-deps torch-checkpointing==0.1.1") from exc


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
    assert [k for k in before - after] == ["run/step_1/.dcp_s3-staged/claims/rank-0"]
    # A fresh storage (another process) sees the same.
    other = _storage(bucket)
    assert other.read(Path("step_1/sub/x.json")) == b"{}" and other.ls(Path("")) == ["step_1"]


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
    s3_env.client().put_object(Bucket=bucket, Key=key, Body=b"from elsewhere")
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


def test_an_interrupted_stage_is_never_committed_or_mixed(bucket: str) -> None:
    crashed = _storage(bucket)
    _stage(crashed, "step_2", {"model_0.pt": b"half"})  # its process dies before the rename
    retry = _storage(bucket)
    with pytest.raises(CheckpointExistsError, match=r"never committed.*dcp-s3 rm s3://"):
        _stage(retry, "step_2", {"model_0.pt": b"whole"})
    assert not retry.exists(Path("step_2")) and retry.ls(Path("")) == ["tmp_step_2"]


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
