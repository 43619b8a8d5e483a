"""Checks of untrusted stored bytes before anything acts on them: nothing stored executes code.

:mod:`~dcp_s3._untrusted.metadata_pickle` (the restricted unpickler of ``.metadata``, resolving the
names of :mod:`~dcp_s3._untrusted.pinned_names`), :mod:`~dcp_s3._untrusted.metadata_check` (every field
of an unpickled ``.metadata``), :mod:`~dcp_s3._untrusted.weights_only` with
:mod:`~dcp_s3._untrusted.weights_only_calls` (a symbolic check of ``torch.save`` archives),
:mod:`~dcp_s3._untrusted.byte_items` (byte items before a planner sees them),
:mod:`~dcp_s3._untrusted.foreign_items` (bounded decoding of torch ``FileSystemWriter`` items),
:mod:`~dcp_s3._untrusted.torch_files` (small ``torch.save`` files, checked before loading).
"""

__all__: list[str] = []
