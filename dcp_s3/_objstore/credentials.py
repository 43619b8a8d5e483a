"""Where a client's credentials come from when ``ClientConfig(credential_path=...)`` names a file.

The file is a JSON object of boto3 client keyword arguments (the form training codebases already keep:
``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``, ``endpoint_url``,
``region_name``). It is read each time a client is made, never kept in a settings object, so a writer
pickled into an ``async_save`` child re-reads it there. Its errors name the file, never its content
(a JSON error's message can quote it), and a file holding secrets that other users can read is warned
about.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from typing import Any

from dcp_s3.errors import ConfigError

__all__ = ["CREDENTIAL_FILE_KEYS", "read_credential_file"]

#: Keys a credential file may hold: boto3 client keyword arguments.
CREDENTIAL_FILE_KEYS = frozenset(
    {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "endpoint_url", "region_name"}
)


def read_credential_file(path: str) -> dict[str, Any]:
    """The boto3 client arguments in the credential file at ``path`` (None values left out); ``ConfigError``
    naming the file if it is missing, unreadable, not a JSON object or holds an unknown key."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"credential file {path!r} does not exist") from None
    except (OSError, ValueError) as exc:
        # The message of a JSON error can quote the file's content: name only the position.
        where = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(f"credential file {path!r} is not readable JSON{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"credential file {path!r} must hold a JSON object of boto3 client arguments")
    unknown = sorted(set(data) - CREDENTIAL_FILE_KEYS)
    if unknown:
        raise ConfigError(
            f"credential file {path!r} has unknown keys {unknown}; allowed: {sorted(CREDENTIAL_FILE_KEYS)}"
        )
    secrets = sorted(k for k in ("aws_secret_access_key", "aws_session_token") if data.get(k))
    if mode & (stat.S_IRGRP | stat.S_IROTH) and secrets:
        # warnings, not only logging: library users see it without configuring logging.
        warnings.warn(
            f"credential file {path!r} holds {' and '.join(secrets)} and is readable by other users; chmod 600 it",
            UserWarning,
            stacklevel=2,
        )
    return {k: v for k, v in data.items() if v is not None}
