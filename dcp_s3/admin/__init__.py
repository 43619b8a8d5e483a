"""Library functions behind the ``dcp-s3`` command line: list, inspect, verify, gc, cp, rm, convert.

Every function takes a location (``s3://bucket/prefix`` or a local path) and storage
options (``credential_path``, ``endpoint_url``, ``region``, ``profile``, ...; copy and convert
take ``src_options``/``dst_options``), and returns plain dataclasses; printing is the CLI's job.
A location may be a run directory holding several steps, one step of
:class:`~dcp_s3._checkpointer.manager.Checkpointer` (``.../0000100``, meaning ``0000100.pth`` and the
``0000100.*_model|_optim`` checkpoints), or one plain DCP checkpoint directory.

This module gathers them; each lives in its own: :mod:`~dcp_s3.admin._listing` (ls, inspect),
:mod:`~dcp_s3.admin._verify`, :mod:`~dcp_s3.admin._copying` (cp), :mod:`~dcp_s3.admin._cleanup` (gc, rm),
:mod:`~dcp_s3.admin._convert`, :mod:`~dcp_s3.admin._local_tier` (ls of a tiered Checkpointer's local root);
:mod:`~dcp_s3.admin._locations` says what a location denotes.
"""

from __future__ import annotations

from dcp_s3.admin._cleanup import Garbage, Removal, collect_garbage, find_garbage, remove_checkpoint
from dcp_s3.admin._convert import ConvertReport, convert_checkpoint
from dcp_s3.admin._copying import CopyReport, copy_checkpoint
from dcp_s3.admin._listing import StepSummary, TensorInfo, inspect_checkpoint, list_steps
from dcp_s3.admin._local_tier import LocalStep, is_local_tier_root, list_local_tier, refused_rank_dirs
from dcp_s3.admin._locations import Progress, resolve
from dcp_s3.admin._verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "StepSummary",
    "TensorInfo",
    "Problem",
    "VerifyReport",
    "Garbage",
    "Removal",
    "CopyReport",
    "ConvertReport",
    "list_steps",
    "inspect_checkpoint",
    "verify_checkpoint",
    "find_garbage",
    "collect_garbage",
    "copy_checkpoint",
    "remove_checkpoint",
    "convert_checkpoint",
    "resolve",
    "Progress",
    "LocalStep",
    "list_local_tier",
    "is_local_tier_root",
    "refused_rank_dirs",
]
