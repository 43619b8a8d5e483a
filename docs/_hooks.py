"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``), run at build time so that nothing is copied
by hand and nothing goes stale:

- the benchmark plot is taken from where the benchmarks write it, ``benchmarks/results/run.png``, and served
  as ``assets/run.png``;
- the docstrings' Sphinx roles (``:class:`X```, ``:mod:`X```...), which mkdocstrings leaves as text, are
  dropped from the rendered pages, so the name reads as code;
- ``<!-- dcp-s3 help -->`` on a page becomes the ``--help`` text of the ``dcp-s3`` command and of each of its
  commands, from the parser the command line itself builds.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
PLOTS = {"assets/run.png": ROOT / "benchmarks" / "results" / "run.png"}
HELP_MARKER = "<!-- dcp-s3 help -->"
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj):(?=<code>)")
# The checkout's package, as mkdocstrings (``paths: ["."]``) reads it, whatever is installed.
sys.path.insert(0, str(ROOT))


def on_files(files, config):
    for uri, source in PLOTS.items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files


def _help_text() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal width: the same text on every machine
    from dcp_s3._cli.commands import build_parser

    parser = build_parser()
    out = ["## `dcp-s3 --help`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [f"## `dcp-s3 {name} --help`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    if HELP_MARKER in markdown:
        markdown = markdown.replace(HELP_MARKER, _help_text())
    return markdown


def on_page_content(html, page, config, files):
    return SPHINX_ROLE.sub("", html)
