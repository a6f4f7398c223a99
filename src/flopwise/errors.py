"""The one error type flopwise reports to a user.

Every error a user can cause or fix -- a bad config, file, flag or value, a fault of the
machine (a full disk, too little memory, a dead rank) -- is a :class:`FlopwiseError`
(each module keeps its own subclass, which also derives from the built-in type callers
catch: ``ValueError`` for bad input, ``RuntimeError`` for a state of the world). Its message
names the file, field or value and what is wrong, in one line (a config error lists its
problems, one a line). The command line prints it and exits 2; a traceback only with
``--debug`` or ``FLOPWISE_DEBUG=1``. Any other exception is a bug and keeps its traceback."""

from __future__ import annotations

MAX_VALUE_CHARS = 200  # the most of a value an error message shows


class FlopwiseError(Exception):
    """An error for the user, not a bug: the message says what is wrong and where."""


def shown(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the full size said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"
