"""The checkpoint manager: :class:`Checkpointer`, and single objects without one.

:mod:`~dcp_s3._checkpointer.manager` is the :class:`Checkpointer`; :mod:`~dcp_s3._checkpointer.step_io` its
step I/O (locations, the parts' reusable writers/readers, load planning, loading one part);
:mod:`~dcp_s3._checkpointer.steps`
the on-store layout of its steps and how to find them in a listing;
:mod:`~dcp_s3._checkpointer.generations` all-or-nothing re-saves; :mod:`~dcp_s3._checkpointer.retention`
which steps ``keep_last`` deletes, and how; :mod:`~dcp_s3._checkpointer.ownership` what any rotation
or purge of dcp_s3 may delete at all; :mod:`~dcp_s3._checkpointer.training_state` what it
saves besides DCP parts; :mod:`~dcp_s3._checkpointer.legacy` single-file (Megatron-style)
checkpoints; :mod:`~dcp_s3._checkpointer.ranks` rank coordination; :mod:`~dcp_s3._checkpointer.objects`
``save_object``/``load_object``/``latest_checkpoint``. The node-local tier (``local_root=``):
:mod:`~dcp_s3._checkpointer.tiers` (local saves, status, retention), :mod:`~dcp_s3._checkpointer.local_layout`
(local shards and their layout), :mod:`~dcp_s3._checkpointer.promotion` (to S3),
:mod:`~dcp_s3._checkpointer.tier_load` (which step, from which tier), :mod:`~dcp_s3._checkpointer.rank_load`
(one rank's check of its local copy, and its load alone).
"""

from dcp_s3._checkpointer.manager import AsyncSave, Checkpointer
from dcp_s3._checkpointer.objects import latest_checkpoint, load_object, save_object

__all__ = [
    "AsyncSave",
    "Checkpointer",
    "latest_checkpoint",
    "load_object",
    "save_object",
]
