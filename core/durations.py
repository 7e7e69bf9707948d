"""Durations written as `<n><unit>` (s, m, h, d): `90s`, `15m`, `1h`, `7d`."""

import re
from datetime import timedelta

_DURATION = re.compile(r"([0-9]+)([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(text: str) -> timedelta | None:
    """The duration, or None when `text` is not a positive one. OverflowError when it is absurdly large."""
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        return None
    return timedelta(**{_UNITS[match[2]]: int(match[1])})
