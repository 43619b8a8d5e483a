"""What a location given to the ``dcp-s3`` tools denotes: a store and the checkpoints in it.

A location may be a run directory holding several steps, one step of
:class:`~dcp_s3._checkpointer.manager.Checkpointer` (``.../0000100``, meaning ``0000100.pth`` and the
``0000100.*_model|_optim`` checkpoints), one part of a step (``.../0000100.model_model``: the directory
the step's marker names for it, a generation directory ``0000100.model_model.<token>`` since every save
has one), or one plain DCP checkpoint directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_s3._checkpointer.generations import settle
from dcp_s3._checkpointer.names import number
from dcp_s3._checkpointer.steps import MARKER_SUFFIX, PART_SUFFIX_RE, Part, Step, scan
from dcp_s3._dcp import Store, open_object, open_store
from dcp_s3._layout import METADATA_KEY
from dcp_s3._metadata.formats import load_metadata
from dcp_s3._objstore.uri import parse_s3_uri, s3_location
from dcp_s3.errors import CheckpointNotFoundError, DcpS3Error

__all__ = ["Progress", "resolve", "is_root", "read_metadata", "single"]

#: ``progress(done, total)`` in bytes, called by the ``verify`` and ``cp`` commands.
Progress = Callable[[int, int], None]


def resolve(uri: str, *, follow_symlinks: bool = False, **storage_options: Any) -> tuple[Store, list[Step]]:
    """(store, steps and DCP checkpoints) that ``uri`` denotes; ``CheckpointNotFoundError`` if none.

    A re-saved step's parts are the directories its marker names (:func:`dcp_s3._checkpointer.generations.settle`).

    ``follow_symlinks``: list linked directories of a local location too.
    """
    store = open_store(uri, follow_symlinks=follow_symlinks, **storage_options)
    steps = settle(store, scan(store.list_objects()))
    if steps:
        return store, steps
    parent, name = open_object(uri, follow_symlinks=follow_symlinks, **storage_options)
    if name.endswith(MARKER_SUFFIX):
        name = name[: -len(MARKER_SUFFIX)]
    found = settle(parent, [s for s in scan(parent.list_objects(f"{name}.")) if s.name == name])
    if found:
        return parent, found
    step, dot, part = name.rpartition(".")
    if dot and PART_SUFFIX_RE.fullmatch(part):  # <step>.<part>: the directory the step's marker names
        named = [
            s
            for s in settle(parent, [s for s in scan(parent.list_objects(f"{step}.")) if s.name == step])
            if part in s.parts and not s.error
        ]
        if named:
            store = open_store(
                parent.url(named[0].parts[part].name), follow_symlinks=follow_symlinks, **storage_options
            )
            return store, scan(store.list_objects())
    raise CheckpointNotFoundError(f"no checkpoint found at {uri}{_step_hint(uri)}")


def _step_hint(uri: str) -> str:
    """``"; did you mean .../0003000 ..."`` for a location ending in a number the Checkpointer would have
    written with seven digits (``run1/3000``), else ``""``."""
    parent, _, last = uri.rstrip("/").rpartition("/")
    iteration = number(last)
    if iteration is None or f"{iteration:07d}" == last:
        return ""
    return f"; did you mean {parent}/{iteration:07d} (the Checkpointer names steps with 7 digits)?"


def is_root(store: Store, uri: str) -> bool:
    """True if ``store`` is rooted at ``uri`` itself (not at its parent)."""
    s3 = s3_location(uri)
    if s3 is not None:
        return store.url() == str(parse_s3_uri(s3, require_key=False)).rstrip("/")
    return store.url() == os.path.abspath(uri)


def read_metadata(store: Store, part: Part) -> Metadata:
    """The checkpoint's ``.metadata``, loaded by the restricted unpickler."""
    name = f"{part.name}/{METADATA_KEY}" if part.name else METADATA_KEY
    return load_metadata(store.read(name), store.url(name))


def single(store: Store, steps: list[Step], uri: str) -> Step:
    """The one step ``uri`` denotes; an error listing a few if there are several."""
    if len(steps) != 1:
        listed = ", ".join(store.url(s.name) for s in steps[:5])
        more = ", ..." if len(steps) > 5 else ""
        raise DcpS3Error(f"{uri} holds {len(steps)} checkpoints ({listed}{more}); name one")
    return steps[0]
