"""The public names and the documented paths keep working whatever moves inside the package."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest

import dcp_s3

#: Paths the README documents, and what each must hold.
DOCUMENTED = {
    "dcp_s3.admin": [
        "list_steps",
        "inspect_checkpoint",
        "verify_checkpoint",
        "find_garbage",
        "collect_garbage",
        "copy_checkpoint",
        "remove_checkpoint",
        "convert_checkpoint",
        "list_local_tier",
    ],
    "dcp_s3.testing": ["LocalS3Server", "StoreConformance", "ObjectStoreConformance", "ObjectStore"],
    # Stored .metadata pickles name these (tests/test_pinned_names.py checks the objects themselves).
    "dcp_s3.layout": ["ItemLocation"],
    "dcp_s3.codec": ["FrameIndex"],
}


#: Paths 0.3.0 documented, kept for a release with a DeprecationWarning (the internals moved to ``_`` modules).
DEPRECATED = {
    "dcp_s3.local_server": ["LocalS3Server"],
    "dcp_s3.objstore": ["ObjectStore", "ClientConfig", "TransferConfig"],
    "dcp_s3.checkpointer": ["Checkpointer", "save_object", "load_object", "latest_checkpoint"],
}


@pytest.mark.parametrize("module", sorted(DEPRECATED))
def test_deprecated_paths_warn_and_hold_the_public_objects(module: str) -> None:
    code = (
        "import importlib, warnings, dcp_s3, dcp_s3.testing\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    mod = importlib.import_module({module!r})\n"
        "assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught\n"
        f"for name in {DEPRECATED[module]!r}:\n"
        "    public = getattr(dcp_s3, name, None) or getattr(dcp_s3.testing, name)\n"
        "    assert getattr(mod, name) is public, name\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", dcp_s3.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(dcp_s3, name) is not None
    assert name in dir(dcp_s3)


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_documented_paths_hold_their_names(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in DOCUMENTED[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lost {missing}"


def test_public_classes_are_the_subpackages_ones() -> None:
    from dcp_s3._checkpointer import Checkpointer
    from dcp_s3._dcp import S3StorageReader, S3StorageWriter
    from dcp_s3._objstore import ClientConfig

    assert (dcp_s3.S3StorageWriter, dcp_s3.S3StorageReader) == (S3StorageWriter, S3StorageReader)
    assert (dcp_s3.Checkpointer, dcp_s3.ClientConfig) == (Checkpointer, ClientConfig)


def test_the_console_script_and_python_m_reach_the_cli() -> None:
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "dcp-s3"]
    from dcp_s3._cli import main

    assert script.value == "dcp_s3._cli:main" and script.load() is main
    out = subprocess.run([sys.executable, "-m", "dcp_s3", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: dcp-s3" in out.stdout, out.stderr
    # `python -m dcp_s3._demo` itself runs in tests/test_demo.py (it starts a server and two ranks).
    assert callable(importlib.import_module("dcp_s3._demo").main)
