"""Finding a checkpoint's stored objects in tests: data object names carry a per-save token."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

TOKEN = r"[0-9a-f]{16}"


def object_keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    """Every key under ``prefix``."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def data_keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    """The data objects (``*.distcp``) under ``prefix``, sorted."""
    return sorted(k for k in object_keys(client, bucket, prefix) if k.endswith(".distcp"))


def data_key(client: Any, bucket: str, prefix: str, rank: int = 0, n: int = 0) -> str:
    """The key of ``rank``'s ``n``-th data object of the checkpoint at ``prefix`` (exactly one must exist)."""
    pattern = re.compile(rf"(^|/)__{rank}_{n}\.{TOKEN}\.distcp$")
    found = [k for k in data_keys(client, bucket, prefix.rstrip("/") + "/") if pattern.search(k)]
    assert len(found) == 1, f"expected one __{rank}_{n}.<token>.distcp under {prefix}, found {found}"
    return found[0]


def data_name(key: str) -> str:
    """``__r_n.<token>.distcp`` -> ``__r_n`` (what a test compares across saves)."""
    base = key.rpartition("/")[2]
    return base.split(".", 1)[0]


@contextmanager
def hooked(storage: Any, event: str, handler: Callable[..., Any]) -> Iterator[None]:
    """Register a botocore event handler on a writer's/reader's client for the block only.

    Clients are shared by every writer/reader with the same settings in a process, so a
    handler left registered would see (and break) other tests' requests.
    """
    events = storage._session.object_store.client.meta.events
    events.register(event, handler)
    try:
        yield
    finally:
        events.unregister(event, handler)


def untokened(name: str) -> str:
    """``.../__r_n.<token>.distcp`` -> ``.../__r_n.distcp``: names as a test can predict them."""
    return re.sub(rf"\.{TOKEN}\.distcp$", ".distcp", name)
