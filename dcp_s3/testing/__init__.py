"""Test suites another backend runs to show it behaves as dcp_s3 expects (like ``zarr.testing``).

Two pytest suites, subclassed in a test module (``class TestMine(StoreConformance)``), each with
one fixture a subclass must define and nothing else taken from dcp_s3's own ``tests/`` folder:

- :class:`ObjectStoreConformance`: the object-store interface (:class:`dcp_s3._objstore.ObjectStore`)
  itself. Hook: the ``objstore`` fixture, the backend on a fresh, empty container; optional: the
  ``base`` fixture (a key prefix of a shared bucket) and ``strict = False`` (ETags on HEAD and
  ``If-None-Match`` recorded rather than required).
- :class:`StoreConformance`: checkpoints through the public API (``dcp.save`` / ``dcp.load``,
  :class:`~dcp_s3.Checkpointer`, :mod:`dcp_s3.admin`) at one location. Hook: the ``target``
  fixture, a :class:`Target` (a fresh root, the storage options that reach it and :class:`Raw`
  access to its objects that bypasses dcp_s3: :class:`S3Raw`, :class:`LocalRaw` or the backend's own).

:class:`LocalS3Server` (the same class as :mod:`dcp_s3._local_server`'s) starts a throw-away
SeaweedFS or moto server on 127.0.0.1 to run them against. pytest is not a dependency of dcp_s3:
install the ``testing`` extra (``pip install 'dcp-s3[testing]'``).
"""

from __future__ import annotations

try:
    import pytest
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by tests/test_testing_package.py
    if exc.name != "pytest":
        raise
    raise ImportError(
        "dcp_s3.testing needs pytest, which dcp_s3 does not install: pip install 'dcp-s3[testing]'"
    ) from exc

# The suites' plain asserts get pytest's explanations when a run imports them (before their import).
pytest.register_assert_rewrite("dcp_s3.testing._store_conformance", "dcp_s3.testing._objstore_conformance")

from dcp_s3._local_server import LocalS3Server  # noqa: E402
from dcp_s3.testing._objstore_conformance import ObjectStoreConformance  # noqa: E402
from dcp_s3.testing._store_conformance import StoreConformance  # noqa: E402
from dcp_s3.testing._targets import LocalRaw, Raw, S3Raw, Target  # noqa: E402

__all__ = [
    "LocalRaw",
    "LocalS3Server",
    "ObjectStoreConformance",
    "Raw",
    "S3Raw",
    "StoreConformance",
    "Target",
]
