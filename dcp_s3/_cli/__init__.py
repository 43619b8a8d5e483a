"""The ``dcp-s3`` command line (:mod:`~dcp_s3._cli.commands`; what each sub-command does:
:mod:`~dcp_s3._cli.handlers`; text in and out: :mod:`~dcp_s3._cli.text`)."""

from dcp_s3._cli.commands import main

__all__ = [
    "main",
]
