"""torch_checkpointing (Meta's checkpoint library) saving to and loading from S3 through dcp_s3: one storage config.

:mod:`.storage` holds what a user chooses (``S3StorageConfig``, the ``S3Storage`` it builds, the ``KeepLast``
retention) and says what the storage owns and why; :mod:`.commit` the claims and the commit marker that stand in
for torch_checkpointing's ``rename``; :mod:`.paths` where a path of the library lies in the bucket;
:mod:`.retention` which checkpoints may be deleted; :mod:`.streams` the bounded-memory file streams;
:mod:`.writers` which writer id a save's files go under (a fresh one per save).
"""

from dcp_s3.integrations.torch_checkpointing._storage import KeepLast, S3Storage, S3StorageConfig

__all__ = ["S3StorageConfig", "S3Storage", "KeepLast"]
