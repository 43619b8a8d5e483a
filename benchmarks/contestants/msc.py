"""NVIDIA multi-storage-client (MSC) as a contestant: its DCP integration
``multistorageclient.contrib.torch.filesystem`` (``MultiStorageFileSystemWriter``/``Reader``).

MSC reads its profiles from a config file; this writes one for the benchmark's server (an ``s3``
storage provider on the bucket, the benchmark's endpoint and credentials, path-style URLs and no
SHA-256 payload signing like the other boto3-based contestants, no cache) and points ``MSC_CONFIG``
at it before MSC is imported. Paths are ``msc://bench/<prefix>``.

What its path does (read from MSC 1.3's source): ``create_stream`` opens every file with
``prefetch_file=True``: a ``.distcp`` file of up to 512 MB (``memory_load_limit``) is downloaded whole
into a ``BytesIO`` before torch seeks to the items it wants (a partial load reads whole files), a larger
one is read by ``RemoteFileReader`` with one ranged GET per ``read()`` call, unbuffered, so every small
read ``torch.load`` makes is a request; a write buffers each whole file in a ``BytesIO`` and uploads it on close (boto3
``upload_fileobj``, 32 MiB parts, 8 threads, above 64 MiB); ``rename`` (torch's ``.metadata.tmp``
→ ``.metadata``) is a server-side copy and a delete, not atomic.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from typing import Any

__all__ = ["writer", "reader", "unavailable"]

PROFILE = "bench"


def _configure(t: Any) -> str:
    """Write the MSC config for target ``t`` (once per process) and return the checkpoint's MSC path."""
    if not os.environ.get("DCP_S3_BENCH_MSC_CONFIG"):
        config = {
            "profiles": {
                PROFILE: {
                    "storage_provider": {
                        "type": "s3",
                        "options": {
                            "base_path": t.bucket,
                            "endpoint_url": t.endpoint_url,
                            "region_name": t.region,
                            "s3": {"addressing_style": "path", "payload_signing_enabled": False},
                        },
                    },
                    "credentials_provider": {
                        "type": "S3Credentials",
                        "options": {
                            "access_key": os.environ.get("AWS_ACCESS_KEY_ID", ""),
                            "secret_key": os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
                        },
                    },
                }
            }
            # No "cache" section: MSC's cache is off.
        }
        fd, path = tempfile.mkstemp(prefix="msc-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        atexit.register(os.unlink, path)
        os.environ["MSC_CONFIG"] = os.environ["DCP_S3_BENCH_MSC_CONFIG"] = path
    return f"msc://{PROFILE}/{t.prefix}"


def writer(t: Any) -> Any:
    path = _configure(t)
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter

    return MultiStorageFileSystemWriter(path, sync_files=False)


def reader(t: Any) -> Any:
    path = _configure(t)
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

    return MultiStorageFileSystemReader(path)


def unavailable() -> str | None:
    try:
        from multistorageclient.contrib.torch.filesystem import (  # noqa: F401
            MultiStorageFileSystemReader,
            MultiStorageFileSystemWriter,
        )
    except Exception as exc:  # ImportError, or a dependency failing to load
        return (
            f"multi-storage-client is not usable here ({type(exc).__name__}: {exc}); "
            "pip install -r benchmarks/requirements.txt"
        )
    return None
