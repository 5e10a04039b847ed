"""A user's value quoted in an error message, cut short: one bad value (a megabyte string, a list
that YAML aliases made millions long, a 4000-digit integer) must not make a message megabytes
long, slow to build or more than one line."""
from __future__ import annotations

import math
import reprlib

LIMIT = 80  # characters of the quoted form, "…" included
CONTAINERS = (list, tuple, dict, set, frozenset)


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr (a few items per list or mapping, a few levels deep), with strings
    cut at their end rather than in the middle, and integers never converted to text whole
    (Python refuses to print one of more than 4300 digits)."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, LIMIT, LIMIT

    def repr_str(self, x, level):
        return repr(x[:LIMIT])  # reprs of at most LIMIT characters (plus escapes); cut below

    def repr_int(self, x, level):
        if x.bit_length() > 200:  # about 60 digits: say how many instead
            return f"<an integer of {decimal_digits(x)} digits>"
        return repr(x)

    def repr_bytes(self, x, level):
        return repr(x[:LIMIT])


_REPR = _ShortRepr()


def decimal_digits(x: int) -> int:
    """len(str(abs(x))) without printing x (Python refuses to print more than 4300 digits): those of
    2 ** (bit_length - 1), or one more."""
    x = abs(x)
    digits = int((x.bit_length() - 1) * math.log10(2)) + 1 if x else 1
    return digits + (x >= 10**digits)


def shown_name(name: str) -> str:
    """A file name, path or key as written, unless it is long or holds a line break or other
    control character (a user's may): then quoted and cut short, so the message stays one line."""
    return name if len(name) <= 200 and name.isprintable() else short_repr(name)


def short_repr(value) -> str:
    """repr(value) in at most LIMIT characters; when cut, ends in "…" and says how long the
    value was (characters of a string, items of a list or mapping)."""
    text = _REPR.repr(value)
    if len(text) <= LIMIT and not _was_cut(value):
        return text
    text = text[:LIMIT - 1] + "…" if len(text) > LIMIT else text
    size = _size(value)
    return f"{text} ({size})" if size else text


def _was_cut(value) -> bool:
    if isinstance(value, (str, bytes)):
        return len(value) > LIMIT
    return isinstance(value, CONTAINERS) and len(value) > 4  # reprlib shows 4 to 6 items


def _size(value) -> str:
    if isinstance(value, str):
        return f"{len(value)} characters"
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if isinstance(value, CONTAINERS):
        return f"{len(value)} item{'s' * (len(value) != 1)}"
    return ""
