"""Keep secrets out of log files: a filter on botocore's (and urllib3's) loggers.

At DEBUG, botocore logs every request it sends (``botocore.endpoint``: the headers,
including ``X-Amz-Security-Token`` and ``Authorization``) and the SigV4 steps
(``botocore.auth``: the canonical request with ``x-amz-security-token:<token>``, the
signature). A user who turns on botocore debugging to chase a dcp_s3 problem would write
a session token into their logs. Every time dcp_s3 makes a client it installs
:class:`RedactSecrets` on the loggers of botocore, boto3, s3transfer and urllib3 that exist
by then (and on ``dcp_s3``'s own): the values of the session token, of request signatures
and of ``aws_secret_access_key``/``aws_session_token`` settings are replaced by
``<redacted>`` before any handler sees the record. Header names, access key ids, URLs and
everything else stay as they were. The filter holds no secrets: it works by pattern.
"""

from __future__ import annotations

import logging
import re

__all__ = ["RedactSecrets", "redact", "install_log_redaction"]

REDACTED = "<redacted>"

_PATTERNS = (
    # x-amz-security-token:VALUE (canonical request), 'X-Amz-Security-Token': b'VALUE' (headers),
    # X-Amz-Security-Token=VALUE (presigned URL query)
    re.compile(r"""(x-amz-security-token['"]?\s*[:=]\s*b?['"]?)[^'"\s&,;}]+""", re.IGNORECASE),
    # Authorization: ... Signature=HEX; X-Amz-Signature=HEX
    re.compile(r"""(signature=)[0-9a-f]+""", re.IGNORECASE),
    # botocore.auth: "Signature:\nHEX"
    re.compile(r"""(signature:\s*)[0-9a-f]{16,}""", re.IGNORECASE),
    # aws_secret_access_key / aws_session_token settings (a dict repr, a config file, an env dump)
    re.compile(
        r"""((?:aws_secret_access_key|aws_session_token|secret_access_key|session_token)['"]?\s*[:=]\s*b?['"]?)"""
        r"""[^'"\s,;}]+""",
        re.IGNORECASE,
    ),
)

#: Loggers whose records can carry request headers or credentials, and their children.
_LOGGER_ROOTS = ("botocore", "boto3", "s3transfer", "urllib3", "dcp_s3")
#: Loggers known to emit such records, created up front so they get the filter even if
#: the module that logs to them is imported later.
_KNOWN = (
    "botocore.endpoint",
    "botocore.auth",
    "botocore.awsrequest",
    "botocore.hooks",
    "botocore.parsers",
    "botocore.httpsession",
    "botocore.credentials",
    "botocore.retryhandler",
    "urllib3.connectionpool",
)


def redact(text: str) -> str:
    """``text`` with session tokens, signatures and secret keys replaced by ``<redacted>``."""
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    return text


class RedactSecrets(logging.Filter):
    """Rewrites a record's message with :func:`redact`; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted: leave it to the handler to report
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_FILTER = RedactSecrets()  # stateless: one instance, so installing twice is a no-op


def install_log_redaction() -> None:
    """Add the filter to every existing botocore/boto3/s3transfer/urllib3/dcp_s3 logger (idempotent).

    Logger filters apply to records logged on that logger only (not to records propagated
    from children), hence one filter per logger.
    """
    names = set(_KNOWN) | set(_LOGGER_ROOTS)
    names.update(n for n in list(logging.root.manager.loggerDict) if n.split(".", 1)[0] in _LOGGER_ROOTS)
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
