"""Checkpoints on local disk through S3StorageWriter/S3StorageReader (the local object store).

The same format and protocol as on S3, checked against torch's own FileSystemWriter/Reader:
what torch writes loads here, what is written here (uncompressed) loads with torch.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_s3 import CheckpointExistsError, S3StorageReader, S3StorageWriter
from dcp_s3._layout import METADATA_KEY, referenced_objects
from dcp_s3._metadata.formats import dump_metadata, load_metadata
from dcp_s3.errors import CheckpointFormatError

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 40, generator=g),
        "h": torch.randn(64, 8, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (50,), generator=g),
        "extra": {"seed": seed, "name": f"run-{seed}"},
    }


def blank() -> dict[str, Any]:
    ref = state(0)
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": 0, "name": ""} for k, v in ref.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], v) if isinstance(v, torch.Tensor) else a[k] == v for k, v in b.items())


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_local_checkpoint_loads_with_torchs_filesystem_reader(tmp_path: Path) -> None:
    sd = state(1)
    dcp.save(sd, storage_writer=S3StorageWriter(tmp_path / "ck"), no_dist=True)
    names = files(tmp_path / "ck")
    assert METADATA_KEY in names and not [n for n in names if ".tmp-" in n]  # no temporary file left
    out = blank()
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "ck"), no_dist=True)
    assert same(out, sd)
    # and every item carries a CRC32C, as on S3
    md = load_metadata((tmp_path / "ck" / METADATA_KEY).read_bytes(), "ck")
    assert all(getattr(info, "crc32c", None) is not None for info in md.storage_data.values())


@pytest.mark.parametrize("extensions", [False, True])
def test_torch_filesystem_writer_checkpoints_load_here(tmp_path: Path, extensions: bool) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    sd = state(2)
    writer = FileSystemWriter(tmp_path / "old", _extensions=[ZStandard()] if extensions else None)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    out = blank()
    dcp.load(out, storage_reader=S3StorageReader(tmp_path / "old"), no_dist=True)
    assert same(out, sd)


def test_compressed_and_spread_local_checkpoint(tmp_path: Path) -> None:
    sd = state(3)
    writer = S3StorageWriter(f"file://{tmp_path}/z", compression="zstd", key_prefixes=4, files_per_rank=2)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert all(n == METADATA_KEY or n.startswith("p-0/") for n in files(tmp_path / "z"))  # rank 0's prefix
    out = blank()
    dcp.load(out, storage_reader=S3StorageReader(tmp_path / "z"), no_dist=True)
    assert same(out, sd)


def test_metadata_naming_a_file_outside_the_directory_is_refused(tmp_path: Path) -> None:
    sd = state(4)
    dcp.save(sd, storage_writer=S3StorageWriter(tmp_path / "ck"), no_dist=True)
    outside = tmp_path / "secret.distcp"
    outside.write_bytes(b"not yours")
    md = load_metadata((tmp_path / "ck" / METADATA_KEY).read_bytes(), "ck")
    for info in md.storage_data.values():
        info.relative_path = "../secret.distcp"
    (tmp_path / "ck" / METADATA_KEY).write_bytes(dump_metadata(md))
    with pytest.raises(BaseException, match="invalid object path '../secret.distcp'"):
        dcp.load(blank(), storage_reader=S3StorageReader(tmp_path / "ck"), no_dist=True)
    # An overwrite does not delete it either (and the object store refuses such names on its own:
    # dcp_s3/testing/_objstore_conformance.py).
    dcp.save(state(5), storage_writer=S3StorageWriter(tmp_path / "ck"), no_dist=True)
    assert outside.read_bytes() == b"not yours"


def test_overwrite_replaces_files_and_overwrite_false_refuses(tmp_path: Path) -> None:
    dcp.save(state(6), storage_writer=S3StorageWriter(tmp_path / "ck"), no_dist=True)
    first = files(tmp_path / "ck")
    dcp.save(state(7), storage_writer=S3StorageWriter(tmp_path / "ck"), no_dist=True)
    md = load_metadata((tmp_path / "ck" / METADATA_KEY).read_bytes(), "ck")
    assert files(tmp_path / "ck") == referenced_objects(md) | {METADATA_KEY} and not (first - {METADATA_KEY}) & files(
        tmp_path / "ck"
    )
    with pytest.raises(BaseException, match="Checkpoint already exists") as info:
        dcp.save(state(8), storage_writer=S3StorageWriter(tmp_path / "ck", overwrite=False), no_dist=True)
    assert "CheckpointExistsError" in repr(info.value) or isinstance(info.value, CheckpointExistsError)
    out = blank()
    dcp.load(out, storage_reader=S3StorageReader(tmp_path / "ck"), no_dist=True)
    assert same(out, state(7))


def test_local_writer_pickles_for_async_process_saves(tmp_path: Path) -> None:
    writer = S3StorageWriter(tmp_path / "ck", compression="zstd")
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.checkpoint_id == os.fspath(tmp_path / "ck")
    dcp.save(state(9), storage_writer=copy, no_dist=True)
    out = blank()
    dcp.load(out, storage_reader=pickle.loads(pickle.dumps(S3StorageReader(tmp_path / "ck"))), no_dist=True)
    assert same(out, state(9))


def test_a_corrupt_local_metadata_is_a_format_error(tmp_path: Path) -> None:
    dcp.save(state(10), storage_writer=S3StorageWriter(tmp_path / "ck"), no_dist=True)
    (tmp_path / "ck" / METADATA_KEY).write_bytes(b"\x80\x04garbage")
    with pytest.raises(BaseException) as info:
        dcp.load(blank(), storage_reader=S3StorageReader(tmp_path / "ck"), no_dist=True)
    assert "CheckpointFormatError" in repr(info.value) or isinstance(info.value, CheckpointFormatError)


def test_unknown_torch_transform_is_a_format_error(tmp_path: Path) -> None:
    dcp.save(state(11), storage_writer=FileSystemWriter(tmp_path / "old"), no_dist=True)
    md = load_metadata((tmp_path / "old" / METADATA_KEY).read_bytes(), "old")
    for info in md.storage_data.values():
        info.transform_descriptors = ["evil/1"]
    (tmp_path / "old" / METADATA_KEY).write_bytes(dump_metadata(md))
    with pytest.raises(BaseException, match=r"cannot undo transforms \['evil/1'\]"):
        dcp.load(blank(), storage_reader=S3StorageReader(tmp_path / "old"), no_dist=True)
