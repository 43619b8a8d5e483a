"""URIs, credential files and client settings (no server needed)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from dcp_s3._dcp import open_store
from dcp_s3._dcp.options import Settings
from dcp_s3._objstore.config import ClientConfig, TransferConfig
from dcp_s3._objstore.uri import parse_s3_uri
from dcp_s3.errors import ConfigError, InvalidCheckpointIdError


def test_parse_s3_uri() -> None:
    uri = parse_s3_uri("s3://my-bucket/runs/a/step-1/")
    assert (uri.bucket, uri.key) == ("my-bucket", "runs/a/step-1")
    assert uri.join(".metadata") == "runs/a/step-1/.metadata"
    assert str(uri) == "s3://my-bucket/runs/a/step-1"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://bucket", "no key prefix"),
        ("s3:///key", "names no bucket"),
        ("gs://bucket/key", "scheme 'gs://'"),
        ("relative/path", "is not a URI"),
        ("s3://UPPER/key", "not a valid bucket name"),
        ("s3://bucket/../etc", "'..'"),
    ],
)
def test_bad_uris_name_the_problem(uri: str, message: str) -> None:
    with pytest.raises(InvalidCheckpointIdError, match=message):
        parse_s3_uri(uri)


def test_credential_file_values_and_overrides(tmp_path: Path) -> None:
    cred = tmp_path / "c.json"
    cred.write_text(
        json.dumps(
            {
                "aws_access_key_id": "AK",
                "aws_secret_access_key": "SK",
                "endpoint_url": "http://file:1",
                "region_name": "eu-west-1",
            }
        )
    )
    cred.chmod(0o600)
    cfg = ClientConfig(credential_path=str(cred), region="us-east-2")
    kwargs = cfg.client_kwargs()
    assert kwargs["aws_secret_access_key"] == "SK" and kwargs["endpoint_url"] == "http://file:1"
    assert kwargs["region_name"] == "us-east-2"  # explicit argument wins
    assert b"SK" not in pickle.dumps(cfg) and "SK" not in repr(cfg)


def test_credential_file_unknown_key_and_bad_json_do_not_leak(tmp_path: Path) -> None:
    cred = tmp_path / "c.json"
    cred.write_text(json.dumps({"aws_secret_access_key": "TOPSECRET", "secret_key": "x"}))
    with pytest.raises(ConfigError, match="unknown keys \\['secret_key'\\]") as info:
        ClientConfig(credential_path=str(cred)).client_kwargs()
    assert "TOPSECRET" not in str(info.value)
    cred.write_text('{"aws_secret_access_key": "TOPSECRET",')
    with pytest.raises(ConfigError, match="not readable JSON") as info:
        ClientConfig(credential_path=str(cred)).client_kwargs()
    assert "TOPSECRET" not in str(info.value)


def test_missing_credential_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ClientConfig(credential_path="/nonexistent/cred.json")


def test_world_readable_credential_file_warns(tmp_path: Path) -> None:
    cred = tmp_path / "c.json"
    cred.write_text(json.dumps({"aws_access_key_id": "AK", "aws_secret_access_key": "SK"}))
    cred.chmod(0o644)
    with pytest.warns(UserWarning, match="readable by other users") as record:
        ClientConfig(credential_path=str(cred)).client_kwargs()
    assert all("SK" not in str(w.message) for w in record)


def test_client_is_path_style_for_custom_endpoints() -> None:
    client = ClientConfig(endpoint_url="http://127.0.0.1:9", region="us-east-1").make_client()
    assert client.meta.config.s3["addressing_style"] == "path"
    assert client.meta.config.retries["mode"] == "standard"
    assert client.meta.config.connect_timeout == 10.0


def test_transfer_config_validation() -> None:
    with pytest.raises(ConfigError, match="part_size"):
        TransferConfig(part_size=1024)
    with pytest.raises(ConfigError, match="max_concurrency"):
        TransferConfig(max_concurrency=0)


def test_decode_threads_are_a_small_bounded_setting() -> None:
    """Not os.cpu_count(): a 192-core node with 8 ranks would start 1,536 decoder threads."""
    import os

    from dcp_s3 import S3StorageReader
    from dcp_s3._objstore.config import TransferConfig

    assert TransferConfig().decode_threads == min(4, os.cpu_count() or 1)
    assert S3StorageReader("s3://bucket/x", transfer=TransferConfig(decode_threads=3))._codec.threads == 3
    assert S3StorageReader("s3://bucket/x")._codec.threads <= 4
    with pytest.raises(ConfigError, match="decode_threads"):
        TransferConfig(decode_threads=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compression": "gzip"}, "compression='gzip'"),
        ({"compression": "zstd", "compression_threads": 0}, "compression_threads=0"),
        ({"key_prefixes": 0}, "key_prefixes=0"),
        ({"metadata_format": "zip"}, "metadata_format='zip'"),
        ({"allow_unsafe_byte_items": "yes"}, "allow_unsafe_byte_items='yes'"),
        ({"share_metadata": 1}, "share_metadata=1"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"bogus": 1}, "bogus"),  # S3: unknown; local: not an option that means something there
    ],
)
def test_storage_options_are_checked_when_a_store_opens(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    """One parser (storage.options) for both backends: a bad option is a ConfigError naming it, before any save."""
    for location in ("s3://bucket/run", str(tmp_path)):
        with pytest.raises(ConfigError, match=message):
            open_store(location, **options)


def test_storage_options_split_without_a_writer_or_reader() -> None:
    settings = Settings(
        part_size=8 << 20,
        share_metadata=False,
        connect_timeout=5.0,
        compression="zstd",
        endpoint_url="http://127.0.0.1:1",
    )
    assert settings.transfer.part_size == 8 << 20 and settings.client.connect_timeout == 5.0
    assert settings.client.endpoint_url == "http://127.0.0.1:1"
    assert settings.reading.share_metadata is False and settings.writing.compression == "zstd"
    with pytest.raises(ConfigError, match="s3:// locations only"):
        Settings(part_size=8 << 20).check_local("/tmp/x")
