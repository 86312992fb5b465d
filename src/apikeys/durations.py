"""Human durations for the command line: `90s`, `15m`, `24h`, `30d`, `2w`, `1d12h`.

A duration is one or more `<whole number><unit>` parts, units `s`, `m`, `h`, `d` and `w`
(seconds, minutes, hours, days, weeks), each unit at most once, largest first. A bare `0`
means no time at all, where zero is allowed.
"""

from __future__ import annotations

import re
from datetime import timedelta

from apikeys.errors import InvalidKeyParameters

__all__ = ["MAX_DURATION", "MAX_DURATION_LENGTH", "format_duration", "parse_duration"]

MAX_DURATION = timedelta(days=36_500)
"""The longest duration accepted (about 100 years): later instants overflow some stores."""

MAX_DURATION_LENGTH = 64
"""The longest duration text read (`1w2d3h4m5s` and spaces to spare)."""
_UNITS: dict[str, int] = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "s": 1}
_DURATION_RE = re.compile("".join(rf"(?:(\d{{1,9}}){unit})?" for unit in _UNITS))
_HINT = "write it as a whole number and a unit (s, m, h, d or w), e.g. 90s, 15m, 24h, 30d, 2w"


def parse_duration(text: str, *, allow_zero: bool = False) -> timedelta:
    """Parse `text` (`30d`, `24h`, `1d12h` …) into a `timedelta`, or raise
    `InvalidKeyParameters` (a `ValueError`).

    The message says what is wrong and how to write a duration. Zero (`0`, `0s`) is
    refused unless `allow_zero`; nothing beyond `MAX_DURATION` is accepted, and no text
    over `MAX_DURATION_LENGTH` characters is read.
    """
    if not isinstance(text, str) or len(text) > MAX_DURATION_LENGTH:
        shown = repr(text)[:MAX_DURATION_LENGTH]
        raise InvalidKeyParameters(
            f"invalid duration {shown}: at most {MAX_DURATION_LENGTH} characters; {_HINT}"
        )
    cleaned = text.strip().lower().replace(" ", "")
    if allow_zero and cleaned == "0":
        return timedelta(0)
    match = _DURATION_RE.fullmatch(cleaned)
    if not cleaned or match is None:
        raise InvalidKeyParameters(f"invalid duration {text!r}: {_HINT}")
    seconds = sum(
        int(amount) * factor
        for amount, factor in zip(match.groups(), _UNITS.values(), strict=True)
        if amount is not None
    )
    if seconds == 0 and not allow_zero:
        raise InvalidKeyParameters(f"invalid duration {text!r}: it must be longer than zero")
    duration = timedelta(seconds=seconds)
    if duration > MAX_DURATION:
        raise InvalidKeyParameters(f"invalid duration {text!r}: at most {MAX_DURATION.days}d")
    return duration


def format_duration(duration: timedelta) -> str:
    """`duration` (whole seconds) as `parse_duration` reads it, in days and less: `1d12h`."""
    remaining = max(0, int(duration.total_seconds()))
    if remaining == 0:
        return "0s"
    parts: list[str] = []
    for unit, factor in _UNITS.items():
        if unit == "w":  # "30d" reads better than "4w2d"
            continue
        amount, remaining = divmod(remaining, factor)
        if amount:
            parts.append(f"{amount}{unit}")
    return "".join(parts)
