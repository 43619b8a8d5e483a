"""Lightning 2.6 (Fabric and the Trainer) with ``s3://`` checkpoints through dcp_s3: the public names.

- :class:`S3FabricStrategy`: Fabric's ``ModelParallelStrategy``
  (:mod:`~dcp_s3.integrations._lightning_fabric`).
- :class:`S3TrainerStrategy` and :class:`S3ModelCheckpoint`: the Trainer's ``ModelParallelStrategy`` and
  ``ModelCheckpoint`` (:mod:`~dcp_s3.integrations._lightning_trainer`).

Each checkpoint is one DCP checkpoint holding the shards and Lightning's non-tensor state
(:mod:`~dcp_s3.integrations._lightning_io`).
"""

from __future__ import annotations

from dcp_s3.integrations._lightning_fabric import S3FabricStrategy
from dcp_s3.integrations._lightning_trainer import S3ModelCheckpoint, S3TrainerStrategy

__all__ = ["S3FabricStrategy", "S3TrainerStrategy", "S3ModelCheckpoint"]
