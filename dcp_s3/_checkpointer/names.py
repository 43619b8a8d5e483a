"""Step and checkpoint names: one ASCII grammar for every naming scheme dcp_s3 deletes or resumes by.

A number in a stored name is ASCII digits ``[0-9]``, nothing else. ``str.isdigit``, ``int()`` and the regular
expression ``\\d`` all accept the digits of other scripts (``"٣"``, ``"３"``): with them, a foreign directory
named ``٠٠٠٠٩٩٩`` passes for step 999 and is resumed from, or deleted by a rotation. So no scheme here uses
them on a name read from a listing: every scheme is a pattern of this module (or a user's pattern compiled by
:func:`scheme`, which makes ``\\d`` ASCII), matched in full, and a name's number is read by :func:`number`
only once the name matched.
"""

from __future__ import annotations

import re

__all__ = ["DIGITS", "scheme", "number", "CHECKPOINTER_STEPS", "step_iteration"]

#: One or more ASCII digits: the only digits a stored name holds.
DIGITS = "[0-9]+"
_NUMBER = re.compile(DIGITS)

#: The Checkpointer's (and its local tier's) step names, exactly as ``f"{iteration:07d}"`` makes them: seven
#: digits, or more without a leading zero (``00000123`` is no iteration's name).
CHECKPOINTER_STEPS = re.compile(r"[0-9]{7}|[1-9][0-9]{7,}")


def scheme(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    """``pattern`` (a scheme's or a user's naming pattern) compiled ASCII-only: ``\\d`` and ``\\w`` match ASCII
    digits and word characters only."""
    if isinstance(pattern, re.Pattern):
        return (
            pattern if pattern.flags & re.ASCII else re.compile(pattern.pattern, pattern.flags & ~re.UNICODE | re.ASCII)
        )
    return re.compile(pattern, re.ASCII)


def number(text: str) -> int | None:
    """The value of ``text`` when it is ASCII digits only (``"0000100"`` -> 100), else None (``"٣"``, ``"1e3"``,
    ``" 1"``, ``"+1"``, ``""``)."""
    return int(text) if isinstance(text, str) and _NUMBER.fullmatch(text) else None


def step_iteration(name: str) -> int | None:
    """The iteration of a Checkpointer step name (``"0000100"`` -> 100), or None for a name the Checkpointer
    does not make."""
    return int(name) if CHECKPOINTER_STEPS.fullmatch(name) else None
