"""StorageOptions: one set of options, each side of a checkpoint gets its own share."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import ConfigError, S3StorageReader, S3StorageWriter, StorageOptions
from dcp_s3._local_server import LocalS3Server


def test_writer_and_reader_each_get_their_own_options(bucket: str, s3_env: LocalS3Server) -> None:
    options = StorageOptions(
        endpoint_url=s3_env.endpoint_url,
        part_size=5 << 20,
        compression="zstd",
        share_metadata=False,
        max_concurrency=3,
        retry_attempts=2,
    )
    # Neither class takes all of these as its own: given to S3StorageReader directly, compression is refused.
    with pytest.raises(ConfigError, match="compression"):
        S3StorageReader(f"s3://{bucket}/c", **options.as_dict())
    writer = options.writer(f"s3://{bucket}/c")
    assert isinstance(writer, S3StorageWriter)
    assert writer._session.transfer.part_size == 5 << 20 and writer._session.transfer.max_concurrency == 3
    assert writer._codec is not None
    assert writer._session.client_config.retry_attempts == 2
    reader = options.reader(f"s3://{bucket}/c")
    assert isinstance(reader, S3StorageReader) and reader.share_metadata is False
    assert reader._session.transfer.max_concurrency == 3

    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    dcp.save(state, storage_writer=writer)
    back = {"w": torch.zeros(100_000)}
    dcp.load(back, storage_reader=reader)
    assert torch.equal(back["w"], state["w"])


def test_local_paths_take_the_options_that_mean_something_there(tmp_path) -> None:
    options = StorageOptions(compression="zstd", max_concurrency=2)
    state = {"w": torch.randn(1000)}
    dcp.save(state, storage_writer=options.writer(tmp_path / "c"))
    back = {"w": torch.zeros(1000)}
    dcp.load(back, storage_reader=options.reader(tmp_path / "c"))
    assert torch.equal(back["w"], state["w"])
    assert options.store(tmp_path).size("c/.metadata")
    with pytest.raises(ConfigError, match="endpoint_url"):
        StorageOptions(endpoint_url="http://127.0.0.1:1").writer(tmp_path / "d")
    # An S3-only option left at None means nothing on a local path, and is no error there.
    assert StorageOptions(endpoint_url=None, compression="zstd").writer(tmp_path / "e") is not None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"part_sise": 1}, "part_sise"),
        ({"compression": "lz4"}, "compression"),
        ({"max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_bad_options_are_refused_when_made_naming_the_option(options: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        StorageOptions(**options)
    with pytest.raises(ConfigError, match=named):
        StorageOptions.of(options)


def test_of_replace_and_equality() -> None:
    base = StorageOptions(part_size=8 << 20)
    assert StorageOptions.of(base) is base
    assert StorageOptions.of(None) == StorageOptions()
    assert StorageOptions.of({"part_size": 8 << 20}) == base
    assert base.replace(compression="zstd").as_dict() == {"part_size": 8 << 20, "compression": "zstd"}
    assert base.replace(part_size=None) == StorageOptions()
    with pytest.raises(ConfigError, match="StorageOptions"):
        StorageOptions.of(["part_size"])  # type: ignore[arg-type]


def test_repr_leaves_out_request_argument_values() -> None:
    key_id = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    options = StorageOptions(
        request_args={"SSEKMSKeyId": key_id, "SSEKMSEncryptionContext": "eyJ0ZWFtIjoiYSJ9"}, part_size=1 << 24
    )
    text = repr(options)
    assert "111122223333" not in text and "eyJ0" not in text
    assert "request_args=<2 keys>" in text and "part_size=16777216" in text
