"""Library functions behind the ``dcp-s3`` command line: list, inspect, verify, gc, cp, rm, convert.

Every function takes a location (``s3://bucket/prefix`` or a local path) and storage
options (``credential_path``, ``endpoint_url``, ``region``, ``profile``, ...; copy and convert
take ``src_options``/``dst_options``), and returns plain dataclasses; printing is the CLI's job. A location may be a run directory holding
several steps, one step of :class:`~dcp_s3.checkpointer.Checkpointer` (``.../0000100``,
meaning ``0000100.pth`` and the ``0000100.*_model|_optim`` checkpoints), or one plain DCP
checkpoint directory.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
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

from ._torch_compat import _StorageInfo, element_size
from .byte_items import byte_item_problem
from .cleanup import Garbage, Removal, collect_garbage, find_garbage, remove_checkpoint
from .convert import ConvertReport, convert_checkpoint
from .errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError, DcpS3Error
from .layout import METADATA_KEY, checksum_error
from .locations import Store, resolve
from .locations import is_root as _is_root
from .locations import read_metadata as _read_metadata
from .locations import single as _single
from .steps import MARKER_FORMAT, MARKER_SUFFIX, Part, Step
from .store import Entry, check_relative_name, open_object, open_store
from .store_local import LocalStore

__all__ = [
    "StepSummary", "TensorInfo", "Problem", "VerifyReport", "Garbage", "Removal", "CopyReport", "ConvertReport",
    "list_steps", "inspect_checkpoint", "verify_checkpoint", "find_garbage", "collect_garbage",
    "copy_checkpoint", "remove_checkpoint", "convert_checkpoint", "resolve",
]

#: ``progress(done, total)`` in bytes.
Progress = Callable[[int, int], None]
_BATCH_BYTES = 64 << 20  # largest batch of item bytes held in memory while verifying


def _tensor_bytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * element_size(md.properties.dtype)


def _tensor_sizes(metadata: Metadata) -> tuple[int, int]:
    """(tensor bytes per the metadata, stored bytes of the tensor items)."""
    tensors = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    stored = sum(int(info.length) for index, info in metadata.storage_data.items() if index.fqn in tensors)
    return sum(map(_tensor_bytes, tensors.values())), stored


# -- ls -----------------------------------------------------------------------------------------------
@dataclass
class StepSummary:
    """One row of ``dcp-s3 ls``."""

    name: str
    url: str
    kind: str  # "step" or "dcp"
    complete: bool
    stored_bytes: int
    logical_bytes: int | None  # tensor bytes per metadata; None if a part is not committed
    tensor_stored_bytes: int  # stored bytes of the tensor items (what the ratio compares against)
    objects: int
    mtime: float
    parts: list[str] = field(default_factory=list)
    error: str = ""  # why the metadata could not be read, if it could not

    @property
    def ratio(self) -> float | None:
        """Tensor bytes / their stored bytes: > 1 for compressed checkpoints, about 1 otherwise."""
        if self.logical_bytes is None or not self.tensor_stored_bytes:
            return None
        return self.logical_bytes / self.tensor_stored_bytes


def list_steps(uri: str, **storage_options: Any) -> list[StepSummary]:
    """The steps and DCP checkpoints under ``uri``, oldest first."""
    store, steps = resolve(uri, **storage_options)
    out = []
    for step in steps:
        logical: int | None = 0
        stored_tensors = 0
        error = ""
        for part in step.parts.values():
            if not part.committed:
                logical = None
                break
            try:
                part_logical, part_stored = _tensor_sizes(_read_metadata(store, part))
            except (DcpS3Error, OSError) as exc:
                logical, error = None, str(exc)
                break
            logical = (logical or 0) + part_logical
            stored_tensors += part_stored
        if step.kind == "step" and not step.parts:
            logical = None  # a legacy single-file checkpoint: no metadata to read
        out.append(
            StepSummary(
                name=step.name or ".", url=store.url(step.name), kind=step.kind, complete=step.complete,
                stored_bytes=step.stored_bytes, logical_bytes=logical, tensor_stored_bytes=stored_tensors,
                objects=len(step.objects), mtime=step.mtime, parts=sorted(step.parts), error=error,
            )
        )
    return out


# -- inspect -------------------------------------------------------------------------------------------
@dataclass
class TensorInfo:
    """One entry of a checkpoint's metadata."""

    part: str
    fqn: str
    kind: str  # "tensor" or "bytes"
    shape: list[int] | None
    dtype: str | None
    chunks: list[dict[str, list[int]]]
    stored_bytes: int
    logical_bytes: int


def inspect_checkpoint(uri: str, **storage_options: Any) -> list[TensorInfo]:
    """Every entry of the checkpoint (every part of a step): shape, dtype, chunks, stored size."""
    store, steps = resolve(uri, **storage_options)
    step = _single(store, steps, uri)
    if not step.parts:
        raise DcpS3Error(f"{store.url(step.name)} is a single-file checkpoint; there is no DCP metadata to inspect")
    out: list[TensorInfo] = []
    for key, part in sorted(step.parts.items()):
        if not part.committed:
            raise CheckpointNotFoundError(f"{store.url(part.name)} is incomplete: {METADATA_KEY} is missing")
        metadata = _read_metadata(store, part)
        stored: dict[str, int] = {}
        for index, info in metadata.storage_data.items():
            stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
        for fqn, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                out.append(TensorInfo(
                    part=key, fqn=fqn, kind="tensor", shape=list(md.size),
                    dtype=str(md.properties.dtype).replace("torch.", ""),
                    chunks=[{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
                    stored_bytes=stored.get(fqn, 0), logical_bytes=_tensor_bytes(md),
                ))
            else:
                out.append(TensorInfo(part=key, fqn=fqn, kind="bytes", shape=None, dtype=None, chunks=[],
                                      stored_bytes=stored.get(fqn, 0), logical_bytes=stored.get(fqn, 0)))
    return out


# -- verify --------------------------------------------------------------------------------------------
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
    try:
        marker = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return  # intact archive holding classes weights_only refuses (callbacks): nothing more to check
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
    """Why ``blob`` is not the item the metadata describes, or None."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if md is None:
        return "not described in the metadata"
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
    payload_offset = getattr(info, "payload_offset", None)
    if isinstance(md, TensorStorageMetadata) and payload_offset is not None:
        _, sizes = _chunk(metadata, index)
        if sizes is not None:
            nbytes = math.prod(sizes) * element_size(md.properties.dtype)
            error = checksum_error(info, memoryview(blob)[payload_offset : payload_offset + nbytes])
            if error:
                return error
    elif isinstance(md, BytesStorageMetadata) and (error := checksum_error(info, blob)):
        return error
    # Checked without running it: a byte item the readers would refuse is a problem too.
    problem = byte_item_problem(blob)
    if problem is not None:
        return _short(f"refused on load: {problem}")
    if isinstance(md, BytesStorageMetadata):
        return None
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


# -- cp ----------------------------------------------------------------------------------------------------
@dataclass
class CopyReport:
    source: str
    destination: str
    objects: int
    bytes: int
    seconds: float


def _commit_rank(name: str) -> int:
    """Copy order: data first, then ``.metadata``, then step markers, so a partial copy never looks complete."""
    base = name.rpartition("/")[2]
    if base.endswith(MARKER_SUFFIX):
        return 2
    return 1 if base == METADATA_KEY else 0


def copy_checkpoint(
    src: str,
    dst: str,
    *,
    workers: int = 8,
    overwrite: bool = False,
    follow_symlinks: bool = False,
    progress: Progress | None = None,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> CopyReport:
    """Copy a step, a checkpoint or a whole run between S3 and local disk (either way, or S3 to S3).

    Objects are copied concurrently; each copy's size is checked against the source's.
    ``dst`` names the copy: a step ``.../0000100`` copies to ``<dst>.pth``, ``<dst>.<part>/...``.
    Before anything is written, every destination name is checked: a source key that would
    land outside ``dst`` (``..``, ``.`` or empty segments, as in ``ck/../../x``) is refused
    (``CheckpointFormatError`` naming it), and so is a symbolic link that leads out of a local
    source or destination directory unless ``follow_symlinks``.
    """
    t0 = time.perf_counter()
    src_store, steps = resolve(src, follow_symlinks=follow_symlinks, **(src_options or {}))
    whole = _is_root(src_store, src)
    if whole:  # a directory: everything under it
        entries = src_store.list_objects()
        dst_store = open_store(dst, follow_symlinks=follow_symlinks, **(dst_options or {}))
        pairs = [(e, e.name) for e in entries]
        tops = [""]
    else:  # one step, named by its prefix: <name>.pth, <name>.<part>/...
        (step,) = steps
        dst_store, dst_name = open_object(dst, follow_symlinks=follow_symlinks, **(dst_options or {}))
        pairs = [(e, dst_name + e.name[len(step.name):]) for e in step.objects]
        tops = [p.name for p in step.parts.values()] + ([step.marker.name] if step.marker else [])
    for entry, name in pairs:
        check_relative_name(entry.name, src_store.url())
        check_relative_name(name, src_store.url(entry.name))
    if not follow_symlinks:
        _refuse_links_out(src_store, tops, "source")
        _refuse_links_out(dst_store, [n for _, n in pairs], "destination")
    # Only the names a step's copy writes (<dst_name>...), not the whole destination directory.
    existing = {e.name for e in dst_store.list_objects("" if whole else dst_name)} & {d for _, d in pairs}
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{dst_store.url(min(existing))} already exists ({len(existing)} objects would be replaced); "
            "pass --overwrite"
        )
    total = sum(e.size for e, _ in pairs)
    done = [0]
    lock = threading.Lock()

    def copy_one(entry: Entry, name: str) -> None:
        _copy_object(src_store, entry.name, dst_store, name)
        size = dst_store.size(name)
        if size != entry.size:
            raise DcpS3Error(
                f"copy of {src_store.url(entry.name)} to {dst_store.url(name)} has {size} bytes, expected {entry.size}"
            )
        with lock:
            done[0] += entry.size
            if progress is not None:
                progress(done[0], total)

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dcp_s3-cp") as pool:
        for rank in (0, 1, 2):
            batch = [(e, n) for e, n in pairs if _commit_rank(e.name) == rank]
            for fut in [pool.submit(copy_one, e, n) for e, n in batch]:
                fut.result()
    return CopyReport(src, dst, len(pairs), total, time.perf_counter() - t0)


def _refuse_links_out(store: Store, names: list[str], role: str) -> None:
    links = store.links_out(names) if isinstance(store, LocalStore) else []
    if links:
        path, target = links[0]
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        raise DcpS3Error(
            f"{path} is a symbolic link out of the {role} directory {store.root} (to {target}){more}; "
            "not following it: pass follow_symlinks=True (--follow-symlinks) to copy through it"
        )


def _copy_object(src: Store, src_name: str, dst: Store, dst_name: str) -> None:
    if isinstance(dst, LocalStore):
        target = dst.path(dst_name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        src.download(src_name, target)
    elif isinstance(src, LocalStore):
        dst.upload(src.path(src_name), dst_name)
    elif dst.same_server(src):
        dst.copy_from(src, src_name, dst_name)  # server-side: no bytes through this machine
    else:
        with tempfile.TemporaryDirectory(prefix="dcp_s3-cp-") as tmp:
            path = os.path.join(tmp, "object")
            src.download(src_name, path)
            dst.upload(path, dst_name)
