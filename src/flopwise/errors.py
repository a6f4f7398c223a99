"""The one error type flopwise reports to a user.

Every error a user can cause or fix -- a bad config, file, flag or value, a fault of the
machine (a full disk, too little memory, a dead rank) -- is a :class:`FlopwiseError`
(each module keeps its own subclass, which also derives from the built-in type callers
catch: ``ValueError`` for bad input, ``RuntimeError`` for a state of the world). Its message
names the file, field or value and what is wrong, in one line (a config error lists its
problems, one a line). The command line prints it and exits 2; a traceback only with
``--debug`` or ``FLOPWISE_DEBUG=1``. Any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import reprlib

MAX_VALUE_CHARS = 200  # the most of a value an error message shows


class FlopwiseError(Exception):
    """An error for the user, not a bug: the message says what is wrong and where."""


_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxstring = _SHORT.maxother = MAX_VALUE_CHARS
_SHORT.maxlong = 60


def shown(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``value`` for an error message: at most ``limit`` characters, its length said when cut.
    Built by :mod:`reprlib` with bounded depth and width, so a value of a billion shared
    elements (a YAML alias bomb) costs as little to show as a short one."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    text = _SHORT.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed: torch's ``OutOfMemoryError`` (CUDA), Python's
    ``MemoryError``, the CPU allocator's ``RuntimeError`` ("can't allocate memory"), or an
    error that says so in its message (a trial's, told by the process it ran in)."""
    text = str(e)
    return (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in text or "out of memory" in text.lower())
