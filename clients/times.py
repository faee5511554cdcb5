"""Times as the clients show them: instants in RFC 3339 (UTC), lengths of time in short units."""

from __future__ import annotations

import time


def rfc3339(unix_s: float, millis: bool = False) -> str:
    """2026-11-25T21:04:05Z (with millis: 2026-11-25T21:04:05.123Z); '-' for 0 (never)."""
    if not unix_s:
        return "-"
    seconds = int(unix_s)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return f"{text}.{int((unix_s - seconds) * 1000):03d}Z" if millis else f"{text}Z"


def duration(seconds: float) -> str:
    """42s, 3m07s, 2h05m, 3d04h (rounded down); '-' for a negative length."""
    if seconds < 0:
        return "-"
    whole = int(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
