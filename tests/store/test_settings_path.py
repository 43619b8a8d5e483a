"""One settings path: each storage setting is declared once, keywords are never learned from a
signature, and ``StorageOptions`` is a frozen value whose overrides merge once.

The first two tests read the package's source (no server); the others use a real local server only
where a writer or a store talks to one.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_s3
from dcp_s3 import ClientConfig, ConfigError, S3StorageReader, S3StorageWriter, StorageOptions, TransferConfig
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._dcp import open_store
from dcp_s3._dcp.options import KEYWORDS, ReaderSettings, Settings, WriterSettings
from dcp_s3._local_server import LocalS3Server

PACKAGE = Path(dcp_s3.__file__).parent
#: The classes that declare the settings (their fields, with defaults and checks).
PARTS = (ClientConfig, TransferConfig, WriterSettings, ReaderSettings)
#: Parameters and fields that share a setting's name but are another thing: (module, function or class, name).
OTHER_MEANINGS = {
    ("_layout.py", "rank_prefix", "key_prefixes"),  # the layout's own function of a count, 1 = flat
    ("_metadata/formats.py", "dump_metadata", "metadata_format"),  # the function's format, "dcp" = torch's
    ("admin/_convert.py", "convert_checkpoint", "overwrite"),  # a conversion's rule for its destination
    ("admin/_copying.py", "copy_checkpoint", "overwrite"),  # a copy's rule for its destination
    ("_dcp/store.py", "write", "overwrite"),  # one object's write, not a checkpoint's
    ("testing/_targets.py", "writer", "overwrite"),  # the conformance targets' call, passed on as given
    ("_local_server.py", "LocalS3Server", "region"),  # the local server's own region, which it reports
}


def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _declared_default(node: ast.expr | None) -> bool:
    """A default that states a value (a literal other than None), not one naming a constant or None."""
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return False
    return not isinstance(node, (ast.Name, ast.Attribute))


def test_each_setting_is_declared_once() -> None:
    fields = [f.name for part in PARTS for f in dataclasses.fields(part)]
    twice = sorted({n for n in fields if fields.count(n) > 1})
    assert not twice, f"settings declared by two parts: {twice}"
    assert {*fields, "client", "transfer"} == KEYWORDS
    part_names = {p.__name__ for p in PARTS}
    again = []
    for module, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name not in part_names:
                again += [
                    f"{module}:{st.lineno} {node.name}.{st.target.id}"
                    for st in node.body
                    if isinstance(st, ast.AnnAssign)
                    and isinstance(st.target, ast.Name)
                    and st.target.id in KEYWORDS
                    and _declared_default(st.value)
                    and (module, node.name, st.target.id) not in OTHER_MEANINGS
                ]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                defaults = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
                defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
                again += [
                    f"{module}:{node.lineno} {node.name}({a.arg}=...)"
                    for a, d in defaults
                    if a.arg in KEYWORDS and _declared_default(d) and (module, node.name, a.arg) not in OTHER_MEANINGS
                ]
    assert not again, f"settings declared again outside {sorted(part_names)} (take a Settings instead): {again}"


def test_no_keyword_is_learned_from_a_signature() -> None:
    """Only the torch fence may read signatures (of torch's own functions, to know its version's API)."""
    found = []
    for module, tree in _sources():
        if module == "_torch_compat.py":
            continue
        found += [
            f"{module}:{node.lineno}"
            for node in ast.walk(tree)
            if (isinstance(node, ast.Attribute) and node.attr in ("signature", "getfullargspec"))
            or (isinstance(node, ast.ImportFrom) and node.module == "inspect")
        ]
    assert not found, f"keywords learned from a signature: {found}"


def test_a_frozen_value_of_four_parts() -> None:
    options = StorageOptions(endpoint_url="http://127.0.0.1:1", part_size=8 << 20, compression="zstd")
    assert (options.client.endpoint_url, options.transfer.part_size) == ("http://127.0.0.1:1", 8 << 20)
    assert options.writing.compression == "zstd" and options.reading == ReaderSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.client = ClientConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.writing.compression = None  # type: ignore[misc]
    given = options.as_dict()
    given["part_size"] = 1
    assert options.transfer.part_size == 8 << 20 and options.as_dict()["part_size"] == 8 << 20
    assert pickle.loads(pickle.dumps(options)) == options


@pytest.mark.parametrize("make", [StorageOptions, Settings, lambda **kw: S3StorageWriter("s3://bkt/x", **kw)])
def test_an_unknown_option_is_refused_by_name(make) -> None:
    with pytest.raises(ConfigError, match="part_sise"):
        make(part_sise=8 << 20)


def test_each_side_refuses_the_others_options_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="S3StorageReader.*compression"):
        S3StorageReader("s3://bkt/x", compression="zstd")
    with pytest.raises(ConfigError, match="S3StorageWriter.*replica_group"):
        S3StorageWriter("s3://bkt/x", replica_group=object())
    with pytest.raises(ConfigError, match="client="):
        StorageOptions(client={"read_timeout": 3})
    with pytest.raises(ConfigError, match="endpoint_url"):
        open_store(tmp_path, endpoint_url="http://127.0.0.1:1")


def test_overrides_merge_once_whole_part_first_then_fields() -> None:
    base = StorageOptions(
        client=ClientConfig(read_timeout=5.0, endpoint_url="http://a:1"),
        transfer=TransferConfig(part_size=6 << 20, max_concurrency=3),
        connect_timeout=3.0,
        max_concurrency=4,
    )
    assert (base.client.read_timeout, base.client.connect_timeout) == (5.0, 3.0)
    assert (base.transfer.part_size, base.transfer.max_concurrency) == (6 << 20, 4)
    over = StorageOptions.of(base, endpoint_url="http://b:2", part_size=7 << 20)
    assert over.client == dataclasses.replace(base.client, endpoint_url="http://b:2")
    assert over.transfer == dataclasses.replace(base.transfer, part_size=7 << 20)
    assert base.client.endpoint_url == "http://a:1"  # the value it came from is unchanged
    assert over.replace(part_size=None).transfer.part_size == 6 << 20  # back to the given transfer's
    # The writer takes the options and its own overrides, merged once; its pool is the larger of the
    # client's and what its threads need, not grown again by each layer it passes through.
    writer = S3StorageWriter("s3://bkt/x", options=over, max_concurrency=2, overwrite=False)
    session = writer._session
    assert (session.transfer.max_concurrency, session.transfer.part_size) == (2, 7 << 20)
    assert session.client_config == dataclasses.replace(over.client, max_pool_connections=10)
    assert writer.overwrite is False
    store = open_store("s3://bkt/run", options=over, max_pool_connections=64)
    assert store.session.client_config.max_pool_connections == 64
    assert store.writer("x")._session.client_config.max_pool_connections == 64
    assert store.reader("x")._session.transfer == over.transfer
    # An override left at None changes nothing: the options' overwrite=False holds (a Store passes overwrite=None).
    kept = StorageOptions(overwrite=False)
    assert S3StorageWriter("s3://bkt/x", options=kept, overwrite=None).overwrite is False
    assert kept.writer("s3://bkt/x").overwrite is False and kept.writer("s3://bkt/x", overwrite=True).overwrite
    assert StorageOptions.of(kept, overwrite=None) == kept


def test_a_transfer_setting_reaches_every_path_by_its_field_alone(
    tmp_path: Path, bucket: str, s3_env: LocalS3Server
) -> None:
    """A TransferConfig field is a keyword everywhere (coalesce_gap was listed nowhere else, and refused)."""
    gap = 3 << 20
    assert StorageOptions(coalesce_gap=gap).transfer.coalesce_gap == gap
    assert S3StorageReader("s3://bkt/x", coalesce_gap=gap)._session.transfer.coalesce_gap == gap
    assert S3StorageWriter("s3://bkt/x", coalesce_gap=gap)._session.transfer.coalesce_gap == gap
    assert open_store(tmp_path, coalesce_gap=gap).session.transfer.coalesce_gap == gap
    ckpt = Checkpointer(tmp_path / "run", coalesce_gap=gap)
    assert ckpt.store.session.transfer.coalesce_gap == gap
    ckpt = Checkpointer(tmp_path / "run", options=StorageOptions(coalesce_gap=gap), max_concurrency=2)
    assert (ckpt.store.session.transfer.coalesce_gap, ckpt.store.session.transfer.max_concurrency) == (gap, 2)
    with pytest.raises(ConfigError, match="coalesce_gap"):
        StorageOptions(coalesce_gap=-1)
    # And it works end to end: a load with it reads back what was saved.
    options = StorageOptions(endpoint_url=s3_env.endpoint_url, coalesce_gap=gap)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    location = f"s3://{bucket}/gap"
    dcp.save(state, storage_writer=options.writer(location), no_dist=True)
    back = {"w": torch.zeros(1000)}
    dcp.load(back, storage_reader=options.reader(location), no_dist=True)
    assert torch.equal(back["w"], state["w"])


def test_reprs_never_show_request_argument_values() -> None:
    key_id = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    secret = {"SSEKMSKeyId": key_id, "SSEKMSEncryptionContext": "eyJ0ZWFtIjoiYSJ9"}
    for value in (
        StorageOptions(client=ClientConfig(request_args=secret)),
        StorageOptions(request_args=secret),
        Settings(request_args=secret),
        ClientConfig(request_args=secret),
        StorageOptions(request_args=secret).client,
    ):
        text = repr(value)
        assert "111122223333" not in text and "eyJ0" not in text, text
        assert "request_args=<2 keys>" in text
