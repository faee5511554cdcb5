"""Stopping asyncio tasks for sure."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any], retry_s: float = 0.5) -> None:
    """Cancel `tasks` and return once every one has ended; what they ended with (a result, an
    exception, the cancellation) is theirs, not raised here.

    One `cancel()` is not always enough: on Python 3.11, `asyncio.wait_for` swallows a
    cancellation that arrives just as the future it awaits completes (fixed in 3.12,
    python/cpython#86296), so a task looping around it runs on, and `cancel(); await task`
    then waits for ever. Here the cancellation is repeated every `retry_s` until each ends."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit
