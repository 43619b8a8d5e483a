"""The User-Agent of dcp_s3's S3 requests: fixed once per process.

botocore otherwise rebuilds the User-Agent from some twenty parts on every request, about 850 of the
~6,300 Python calls of an UploadPart (benchmarks/README.md, "A leaner request path"); every client
``ClientConfig.make_client`` builds sends this one instead, in botocore's legacy form.
"""

from __future__ import annotations

import importlib.metadata
import platform

import boto3

__all__ = ["USER_AGENT"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


#: The User-Agent of dcp_s3's requests (botocore's legacy form, fixed: see ``make_client``), to which botocore
#: appends ``Botocore/<version>``.
USER_AGENT = (
    f"dcp_s3/{_version('dcp_s3')} Boto3/{boto3.__version__} "
    f"Python/{platform.python_version()} {platform.system()}/{platform.release()}"
)
