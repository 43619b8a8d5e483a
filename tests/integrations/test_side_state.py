"""The integrations' one way to carry side state inside the DCP commit (``dcp_s3.integrations._side_state``):
rank 0's side objects become items of the same checkpoint, read back from the one save loaded. Megatron's
``common.pt``/``metadata.json`` and Lightning's ``meta.pt`` use it (``test_megatron.py``, ``test_lightning.py``)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import CheckpointFormatError, ConfigError
from dcp_s3._dcp.storage_options import StorageOptions
from dcp_s3._local_server import LocalS3Server
from dcp_s3.integrations._side_state import as_dict, carry


def test_rank_zero_carries_the_side_state_inside_one_commit(s3_env: LocalS3Server, bucket: str) -> None:
    location = f"s3://{bucket}/run/ckpt"
    options = StorageOptions.of({"endpoint_url": s3_env.endpoint_url})
    state = carry({"w": torch.arange(4.0)}, {"side.pt": {"step": 7}}, location, rank=0)
    assert isinstance(state["side.pt"], io.BytesIO)
    dcp.save(state, storage_writer=options.writer(location), no_dist=True)
    back = {"w": torch.zeros(4), "side.pt": io.BytesIO()}
    dcp.load(back, storage_reader=options.reader(location), no_dist=True)
    assert as_dict(back["side.pt"], location, "side.pt") == {"step": 7}
    assert torch.equal(back["w"], torch.arange(4.0))


def test_other_ranks_carry_nothing_and_reserved_keys_are_refused() -> None:
    assert carry({"w": 1}, {"side.pt": {"a": 1}}, "loc", rank=1) == {"w": 1}
    tensor = carry({}, {"meta.pt": {"a": 1}}, "loc", rank=0, as_tensor=True)["meta.pt"]
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.numel() > 0
    with pytest.raises(ConfigError, match="side.pt"):
        carry({"side.pt": 1}, {"side.pt": {}}, "loc", rank=1)  # every rank refuses, not only rank 0
    with pytest.raises(ConfigError, match="config.pt"):
        carry({"config.pt": 1}, {"side.pt": {}}, "loc", rank=0, reserved=["config.pt"])
    with pytest.raises(CheckpointFormatError, match="side.pt"):
        as_dict([1, 2], "loc", "side.pt")
