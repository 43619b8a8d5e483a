"""dcp_s3 inside the frameworks people train with: one module per framework, imported only when used.

Importing this package imports no framework and nothing heavy; each module below imports its
framework (an optional dependency, never one of dcp_s3's) when the user imports that module:

- :mod:`dcp_s3.integrations.dcp_route`: an opt-in route that makes plain ``dcp.save``,
  ``dcp.load`` and ``dcp.async_save`` calls given only ``checkpoint_id="s3://..."`` use dcp_s3
  (a context manager, and a process-wide switch).
- :mod:`dcp_s3.integrations.torchtitan`: ``S3CheckpointManager``, torchtitan's ``CheckpointManager``
  with saves, loads, step discovery and ``keep_latest_k`` purges through dcp_s3, chosen with
  ``checkpoint=S3CheckpointManager.Config(...)`` in a torchtitan config.
- ``dcp_s3.integrations.lightning*`` and ``dcp_s3.integrations.accelerate``: Lightning strategies,
  and Accelerate / transformers ``Trainer`` FSDP saves (their own modules; the Trainer's local
  ``output_dir`` mapped to S3 by :mod:`dcp_s3.integrations._trainer_dirs`).
- :mod:`dcp_s3.integrations.nemo_automodel`: ``S3CheckpointingConfig``, NeMo AutoModel's ``Checkpointer`` with
  dcp_s3 as its storage (its commit in :mod:`~dcp_s3.integrations._nemo_commit`, its small files in
  :mod:`~dcp_s3.integrations._nemo_files`); :mod:`dcp_s3.integrations.nemo_recipe`: NeMo's recipes and ``automodel``
  command on S3, chosen with ``recipe: dcp_s3.integrations.nemo_recipe.S3<Name>`` in the YAML.
- :mod:`dcp_s3.integrations.torch_checkpointing`: ``S3StorageConfig``, torch_checkpointing's ``Storage`` on S3
  (its staged-write ``rename`` mapped onto a commit marker), chosen with
  ``CheckpointManager.Config(storage_config=S3StorageConfig("s3://..."))``.
- :mod:`dcp_s3.integrations.megatron`: Megatron-core ``dist_checkpointing`` ``save`` and ``load`` (the
  ``torch_dist`` format, sync and async) with dcp_s3's writer and reader, Megatron's common state inside the
  same commit (its write and commit steps in :mod:`dcp_s3.integrations._megatron_async`).

What every integration shares is the kit, private modules of this package: ``_locations`` (is a path an
``s3://`` location, pathlib's ``s3:/`` fold included), ``_patching`` (scoped replacement of a framework's function),
``_committed`` (which checkpoints are committed, which is the latest), ``_side_state`` (a framework's non-tensor
state inside the DCP commit) and ``_bounded_upload``; the commit itself is :mod:`dcp_s3._commit`.

Every integration takes its storage settings as ``options`` (a :class:`dcp_s3.StorageOptions` or a
mapping of its keywords), one set for saving and loading.
"""
