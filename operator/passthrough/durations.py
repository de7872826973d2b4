"""Durations as admins write them: `300`, `90s`, `5m`, `1h30m`."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


class DurationError(ValueError):
    pass


def parse_duration(text: str | float | int) -> float:
    """Seconds in `text`; a bare number is seconds. Raises DurationError saying what is accepted."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        raw = text.strip()
        try:
            value = float(raw)
        except ValueError:
            parts = _PART.findall(raw)
            if not parts or "".join(n + u for n, u in parts) != raw:
                raise DurationError(f"{text!r} is not a duration; write e.g. 300, 90s, 5m or 1h30m") from None
            value = sum(float(n) * _UNITS[u] for n, u in parts)
    if value <= 0:
        raise DurationError(f"{text!r} must be longer than zero")
    return value
