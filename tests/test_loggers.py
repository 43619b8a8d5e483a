"""Loggers by module (``logging.getLogger(__name__)``), all below the ``dcp_s3`` logger a user configures."""

from __future__ import annotations

import re
from pathlib import Path

import dcp_s3

PACKAGE = Path(dcp_s3.__file__).parent
#: Where the package's own root logger is named: its NullHandler, the command line's error report.
ROOT_LOGGER_USERS = {"__init__.py", "cli/commands.py"}


def test_every_module_logs_under_its_own_name() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            module_logger = re.match(r"\w+ = logging\.getLogger\((.*)\)$", line)
            if module_logger and module_logger[1] != "__name__":
                offenders.append(f"{rel}:{n}: {line}")
            if 'getLogger("dcp_s3' in line and rel not in ROOT_LOGGER_USERS:
                offenders.append(f"{rel}:{n}: {line}")
    assert offenders == []
