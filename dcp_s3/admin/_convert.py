"""``dcp-s3 convert``: a DCP checkpoint to a single file of full tensors; a DCP checkpoint or a Hugging Face
safetensors export to an uncompressed DCP checkpoint, streamed (:mod:`dcp_s3.admin._streaming`)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_s3._checkpointer.steps import Part
from dcp_s3._dcp import Store, open_object, open_store
from dcp_s3._dcp.hf_reader import INDEX_NAME, SINGLE_NAME, S3HuggingFaceStorageReader
from dcp_s3._dcp.hf_writer import S3HuggingFaceStorageWriter
from dcp_s3._layout import METADATA_KEY
from dcp_s3._objstore.config import TransferConfig
from dcp_s3._objstore.uri import s3_location
from dcp_s3._torch_compat import _EmptyStateDictLoadPlanner, _load_state_dict, checkpoint_failures
from dcp_s3.admin._locations import Progress, resolve
from dcp_s3.admin._locations import single as _single
from dcp_s3.admin._streaming import DEFAULT_CHUNK_BYTES, StreamingSavePlanner
from dcp_s3.errors import CheckpointExistsError, CheckpointNotFoundError, DcpS3Error

__all__ = ["ConvertReport", "convert_checkpoint"]


@dataclass
class ConvertReport:
    source: str
    destination: str
    format: str
    tensors: int
    bytes: int
    skipped: list[str] = field(default_factory=list)


def _load_full(store: Store, part: Part) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as full (unsharded) CPU tensors, in one process."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=store.reader(part.name), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def _flatten(state: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, state


def convert_checkpoint(
    uri: str,
    out: str,
    *,
    fmt: str | None = None,
    overwrite: bool = False,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert a checkpoint: to a single file of full tensors, to an uncompressed DCP checkpoint, or to a Hugging
    Face safetensors export.

    ``fmt``: ``"torch"`` (a ``torch.save`` file of the nested state dict), ``"safetensors"`` (``out`` ending in
    ``.safetensors``: one file of flat dotted names, tensors only, needs the ``safetensors`` package; any other
    ``out``: an export prefix — ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json``,
    written by ``S3HuggingFaceStorageWriter``) or ``"dcp"`` (a new checkpoint at ``out``, stock ``.metadata``).
    Default: from ``out``'s suffix (``.safetensors``), else ``torch``. ``uri`` is a DCP checkpoint, a step with
    exactly one ``*_model`` part (that part is converted), or, for an export or ``"dcp"``, a prefix holding a Hugging
    Face export (its index and shards, or ``model.safetensors``).

    The single files load everything into this process's memory. ``"dcp"`` and an export stream: each tensor is
    copied in chunks of whole rows of at most ``chunk_bytes`` (32 MiB), each read only when written, so memory is
    bounded by the chunk and the transfer settings, not by the largest tensor; every byte is checked as the source's
    reader checks it; ``progress(done, total)`` is told the tensor bytes copied. ``src_options``/``dst_options`` are
    the storage options of ``uri`` and ``out``. An existing ``out`` (a file, or any object under a prefix) is
    refused with ``CheckpointExistsError`` before anything is read, unless ``overwrite``.
    """
    src_options, dst_options = dict(src_options or {}), dict(dst_options or {})
    fmt = fmt or ("safetensors" if out.endswith(".safetensors") else "torch")
    if fmt not in ("torch", "safetensors", "dcp"):
        raise DcpS3Error(f"unknown format {fmt!r}; expected torch, safetensors or dcp")
    export = fmt == "safetensors" and not out.endswith(".safetensors")
    if fmt == "dcp" or export:
        # The chunks are this copy's own memory: parts sent straight from them may be up to max_direct_part_size
        # (64 MiB) each, and the writer keeps max_concurrency + 1 parts in flight; parts of part_size bound it.
        if s3_location(out) is not None:
            transfer = dst_options.get("transfer") or TransferConfig()
            dst_options.setdefault("max_direct_part_size", dst_options.get("part_size", transfer.part_size))
        dst_dir = open_store(out, **dst_options)
        _refuse_objects_under(dst_dir, overwrite)
        reader = _source_reader(uri, src_options)
        if export:
            writer: Any = S3HuggingFaceStorageWriter(out, overwrite=overwrite, **dst_options)
        else:
            writer = dst_dir.writer("", overwrite=overwrite)
            writer.metadata_format = "dcp"  # stock .metadata: a downloaded copy loads with torch's FileSystemReader
        planner = StreamingSavePlanner(reader, chunk_bytes, progress, tensors_only=export)
        _save(writer, planner)
        return ConvertReport(str(reader.checkpoint_id), out, fmt, planner.tensors, planner.nbytes, planner.skipped)
    return _to_one_file(uri, out, fmt, overwrite, src_options, dst_options)


def _refuse_objects_under(dst_dir: Store, overwrite: bool) -> None:
    present = dst_dir.list_objects()
    if present and not overwrite:
        raise CheckpointExistsError(
            f"{dst_dir.url()} already holds {len(present)} objects (e.g. {dst_dir.url(present[0].name)}); "
            "pass overwrite=True (--force) to write over them"
        )


def _source_reader(uri: str, options: dict[str, Any]) -> Any:
    """The reader of what ``uri`` holds: a Hugging Face export, or one committed DCP checkpoint (a step's one
    ``*_model`` part)."""
    if _is_hf_export(uri, options):
        return open_store(uri, **options).reader("", S3HuggingFaceStorageReader)
    store, part = _dcp_part(uri, options)
    return store.reader(part.name)


def _dcp_part(uri: str, options: dict[str, Any]) -> tuple[Store, Part]:
    store, steps = resolve(uri, **options)
    step = _single(store, steps, uri)
    parts = [p for k, p in step.parts.items() if step.kind == "dcp" or k.endswith("_model")]
    if len(parts) != 1:
        names = ", ".join(store.url(p.name) for p in step.parts.values()) or "none"
        raise DcpS3Error(f"{store.url(step.name)} has several checkpoints ({names}); convert one of them")
    part = parts[0]
    if not part.committed:
        raise CheckpointNotFoundError(f"{store.url(part.name)} is incomplete: {METADATA_KEY} is missing")
    return store, part


def _to_one_file(
    uri: str, out: str, fmt: str, overwrite: bool, src_options: dict[str, Any], dst_options: dict[str, Any]
) -> ConvertReport:
    """A ``torch.save`` or a single safetensors file of the full tensors, made in this process's memory."""
    if fmt == "safetensors":
        try:
            import safetensors.torch as st
        except ImportError:
            raise DcpS3Error("--format safetensors needs the safetensors package (pip install safetensors)") from None
    dst_store, name = open_object(out, **dst_options)
    if not overwrite and dst_store.size(name) is not None:
        raise CheckpointExistsError(
            f"{dst_store.url(name)} already exists; pass overwrite=True (--force) to replace it"
        )
    store, part = _dcp_part(uri, src_options)
    state = _load_full(store, part)
    tensors = [(k, v) for k, v in _flatten(state) if isinstance(v, torch.Tensor)]
    nbytes = sum(v.numel() * v.element_size() for _, v in tensors)
    skipped: list[str] = []
    if fmt == "safetensors":
        skipped = [k for k, v in _flatten(state) if not isinstance(v, torch.Tensor)]
        data = st.save({k: v.contiguous().clone() for k, v in tensors})
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
    dst_store.write(name, data, overwrite=overwrite)
    return ConvertReport(store.url(part.name), out, fmt, len(tensors), nbytes, skipped)


def _is_hf_export(uri: str, options: dict[str, Any]) -> bool:
    """Whether ``uri`` holds a Hugging Face export (its index or single file) rather than a DCP checkpoint."""
    store = open_store(uri, **options)
    try:
        return store.size(METADATA_KEY) is None and any(store.size(n) is not None for n in (INDEX_NAME, SINGLE_NAME))
    finally:
        store.close()


def _save(writer: Any, planner: StreamingSavePlanner) -> None:
    """One ``dcp.save`` in this process; a failure raises the ``DcpS3Error`` it met, not torch's wrapper."""
    try:
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException as exc:  # torch's CheckpointException (a BaseException): raise the error it carries
        causes = [c for c in checkpoint_failures(exc) if isinstance(c, DcpS3Error)]
        if causes:
            raise causes[0] from exc
        raise
