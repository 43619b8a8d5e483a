"""``dcp-s3 verify``: read every item of every checkpoint at a location and check it.

Problems are collected in a :class:`VerifyReport`, not raised. Plain items are checked without
running them (archive CRCs, checksums, what weights-only loading would refuse, shape and dtype);
encoded (compressed) items are decoded through the storage reader.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dcp_s3._checkpointer.generations import part_dirs_of
from dcp_s3._checkpointer.steps import MARKER_FORMAT, Part, Step
from dcp_s3._dcp import Store
from dcp_s3._layout import METADATA_KEY, checksum_error
from dcp_s3._torch_compat import _StorageInfo, element_size
from dcp_s3._untrusted.byte_items import byte_item_problem
from dcp_s3.admin._locations import Progress, resolve
from dcp_s3.admin._locations import read_metadata as _read_metadata
from dcp_s3.errors import CheckpointFormatError, DcpS3Error

__all__ = ["Problem", "VerifyReport", "verify_checkpoint"]

_BATCH_BYTES = 64 << 20  # largest batch of item bytes held in memory while verifying


@dataclass(frozen=True)
class Problem:
    """Something wrong with one object (or one checkpoint, when ``item`` is empty)."""

    url: str
    message: str
    item: str = ""


@dataclass
class VerifyReport:
    checkpoints: int = 0
    objects: int = 0
    items: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _plain(info: _StorageInfo) -> bool:
    """True if the item's stored bytes are a ``torch.save`` blob (no codec, no transform)."""
    return not getattr(info, "transform_descriptors", None) and getattr(info, "frames", None) is None


def verify_checkpoint(uri: str, *, progress: Progress | None = None, **storage_options: Any) -> VerifyReport:
    """Read every item of every checkpoint at ``uri`` and check it; problems are reported, not raised.

    Checks: the step marker loads and names parts that exist; each part is committed and
    its metadata loads and is well-formed; every data object exists and is long enough; each
    plain item is a readable ``torch.save`` blob that weights-only loading accepts (checked
    without running it: an item the readers would refuse is a problem) and a tensor item has
    the shape and dtype the metadata says; encoded (compressed) items decode through the
    storage reader.
    """
    store, steps = resolve(uri, **storage_options)
    report = VerifyReport()
    checks: list[tuple[Part, Metadata]] = []
    for step in steps:
        report.checkpoints += 1
        if step.kind == "step":
            _verify_marker(store, step, report)
        for part in step.parts.values():
            if not part.committed:
                report.problems.append(Problem(store.url(part.name), f"incomplete: {METADATA_KEY} is missing"))
                continue
            try:
                checks.append((part, _read_metadata(store, part)))
            except (DcpS3Error, OSError) as exc:
                report.problems.append(Problem(store.url(part.name), str(exc)))
    total = sum(int(i.length) for _, md in checks for i in md.storage_data.values())
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        report.bytes_read += n
        if progress is not None:
            progress(done[0], total)

    for part, metadata in checks:
        _verify_part(store, part, metadata, report, advance)
    return report


def _verify_marker(store: Store, step: Step, report: VerifyReport) -> None:
    if step.marker is None:
        report.problems.append(Problem(store.url(step.name), "incomplete step: no marker (the save did not finish)"))
        return
    url = store.url(step.marker.name)
    report.objects += 1
    try:
        data = store.read(step.marker.name)
        bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
        if bad is not None:
            raise CheckpointFormatError(f"record {bad} fails its CRC check")
    except (DcpS3Error, OSError, zipfile.BadZipFile) as exc:
        report.problems.append(Problem(url, f"unreadable marker: {exc}"))
        return
    if byte_item_problem(data) is not None:  # never loaded: Checkpointer.load refuses it the same way
        return  # (an intact archive holding classes weights_only refuses, callbacks say: nothing more to check)
    try:
        marker = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return
    if step.error:
        report.problems.append(Problem(url, step.error))
        return
    try:
        named = part_dirs_of(marker, step.name, url)  # validated, also where no generation is listed
    except CheckpointFormatError as exc:
        report.problems.append(Problem(url, str(exc)))
        return
    if named is not None and any(step.parts.get(k) is None or step.parts[k].name != v for k, v in named.items()):
        missing = sorted(v for k, v in named.items() if k not in step.parts or step.parts[k].name != v)
        report.problems.append(Problem(store.url(missing[0]), "missing: the marker names it"))
        return
    if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT:
        for name in marker.get("parts", []):
            if name not in step.parts:
                report.problems.append(Problem(store.url(f"{step.name}.{name}"), "missing: the marker lists it"))


def _verify_part(
    store: Store, part: Part, metadata: Metadata, report: VerifyReport, advance: Callable[[int], None]
) -> None:
    sizes = {o.name: o.size for o in part.objects}
    by_object: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in metadata.storage_data.items():
        by_object.setdefault(info.relative_path, []).append((index, info))
    for rel, items in sorted(by_object.items()):
        name = f"{part.name}/{rel}" if part.name else rel
        url = store.url(name)
        report.objects += 1
        report.items += len(items)
        need = max(int(i.offset) + int(i.length) for _, i in items)
        have = sizes.get(name)
        if have is None:
            report.problems.append(Problem(url, f"missing ({len(items)} items refer to it)"))
            advance(sum(int(i.length) for _, i in items))
            continue
        if have < need:
            report.problems.append(Problem(url, f"truncated: {have} bytes, the metadata needs {need}"))
            advance(sum(int(i.length) for _, i in items))
            continue
        plain = [(ix, i) for ix, i in items if _plain(i)]
        encoded = [(ix, i) for ix, i in items if not _plain(i)]
        for batch in _batches(plain):
            try:
                blobs = store.read_ranges(name, [(int(i.offset), int(i.offset) + int(i.length)) for _, i in batch])
            except (DcpS3Error, OSError) as exc:
                report.problems.append(Problem(url, f"read failed: {exc}"))
                advance(sum(int(i.length) for _, i in batch))
                continue
            for (index, info), blob in zip(batch, blobs, strict=True):
                error = _check_blob(blob, index, info, metadata)
                if error:
                    report.problems.append(Problem(url, error, _item_name(index)))
                advance(int(info.length))
        if encoded:
            _verify_encoded(store, part, metadata, url, encoded, report)
            advance(sum(int(i.length) for _, i in encoded))


def _batches(items: list[tuple[MetadataIndex, Any]]) -> Iterable[list[tuple[MetadataIndex, Any]]]:
    batch: list[tuple[MetadataIndex, Any]] = []
    size = 0
    for item in sorted(items, key=lambda x: int(x[1].offset)):
        if batch and size + int(item[1].length) > _BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += int(item[1].length)
    if batch:
        yield batch


def _item_name(index: MetadataIndex) -> str:
    return f"{index.fqn}{list(index.offset)}" if index.offset is not None else index.fqn


def _chunk(metadata: Metadata, index: MetadataIndex) -> tuple[TensorStorageMetadata | None, list[int] | None]:
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None, None
    for chunk in md.chunks:
        if index.offset is not None and tuple(chunk.offsets) == tuple(index.offset):
            return md, list(chunk.sizes)
    return md, None


def _check_blob(blob: bytes, index: MetadataIndex, info: Any, metadata: Metadata) -> str | None:
    """Why ``blob`` is not the item the metadata describes, or None: in turn its archive, its checksums, the
    readers' rules for byte items and, for a tensor, what it loads as."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if md is None:
        return "not described in the metadata"
    error = _archive_problem(blob, info) or _checksum_problem(blob, index, info, md, metadata)
    if error:
        return error
    # Checked without running it: a byte item the readers would refuse is a problem too.
    problem = byte_item_problem(blob)
    if problem is not None:
        return _short(f"refused on load: {problem}")
    if isinstance(md, BytesStorageMetadata):
        return None
    return _tensor_problem(blob, index, metadata)


def _archive_problem(blob: bytes, info: Any) -> str | None:
    """Why ``blob`` is not a sound torch.save archive (a record that does not read back), or None."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        records = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"not a torch.save archive ({exc})"
    # dcp_s3 writes a tensor's bytes straight from memory after a header made with
    # torch.serialization.skip_data, so its data record carries no CRC; every other record does.
    no_crc = getattr(info, "payload_offset", None) is not None
    for record in records:
        if no_crc and "/data/" in record.filename:
            continue
        try:
            with archive.open(record) as f:
                while f.read(1 << 20):
                    pass
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
            return f"record {record.filename} is damaged ({exc})"
    return None


def _checksum_problem(blob: bytes, index: MetadataIndex, info: Any, md: Any, metadata: Metadata) -> str | None:
    """The stored checksum's complaint: over a tensor's payload, or over a byte item's whole blob."""
    payload_offset = getattr(info, "payload_offset", None)
    if isinstance(md, TensorStorageMetadata) and payload_offset is not None:
        _, sizes = _chunk(metadata, index)
        if sizes is not None:
            nbytes = math.prod(sizes) * element_size(md.properties.dtype)
            return checksum_error(info, memoryview(blob)[payload_offset : payload_offset + nbytes])
    elif isinstance(md, BytesStorageMetadata):
        return checksum_error(info, blob)
    return None


def _tensor_problem(blob: bytes, index: MetadataIndex, metadata: Metadata) -> str | None:
    """Why ``blob`` does not load (weights only) as the chunk of the shape and dtype the metadata says, or None."""
    try:
        tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        return _short(f"does not load: {type(exc).__name__}: {exc}")
    if not isinstance(tensor, torch.Tensor):
        return f"holds a {type(tensor).__name__}, not a tensor"
    tmd, sizes = _chunk(metadata, index)
    assert tmd is not None
    if sizes is None:
        return "no chunk of this offset in the metadata"
    if list(tensor.shape) != sizes or tensor.dtype != tmd.properties.dtype:
        return f"holds a {list(tensor.shape)} {tensor.dtype} tensor, the metadata says {sizes} {tmd.properties.dtype}"
    return None


def _short(message: str, limit: int = 200) -> str:
    line = message.strip().splitlines()[0] if message.strip() else message
    return line if len(line) <= limit else line[: limit - 3] + "..."


class _Sink(LoadPlanner):
    """A load planner that reads items into scratch tensors and keeps nothing."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    # Planning is not used: plans are built by hand, one item at a time.
    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[read_item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        return torch.empty(tuple(read_item.lengths), dtype=md.properties.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        zipfile.ZipFile(value).testzip()


def _verify_encoded(
    store: Store, part: Part, metadata: Metadata, url: str, items: list[tuple[MetadataIndex, Any]], report: VerifyReport
) -> None:
    """Items the storage reader must decode (compressed): read them through it, one at a time."""
    reader = store.reader(part.name)
    reader.set_up_storage_reader(metadata, True)
    sink = _Sink(metadata)
    for index, _ in items:
        md = metadata.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata):
            _, sizes = _chunk(metadata, index)
            if sizes is None:
                report.problems.append(Problem(url, "no chunk of this offset in the metadata", _item_name(index)))
                continue
            zeros = torch.Size([0] * len(sizes))
            read = ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, torch.Size(sizes))
        else:
            zero = torch.Size([0])
            read = ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)
        try:
            reader.read_data(LoadPlan([read]), sink).wait()
        except Exception as exc:
            report.problems.append(Problem(url, f"does not decode: {type(exc).__name__}: {exc}", _item_name(index)))
