"""Polling with a deadline, for tests that must pass on a loaded machine: wait until a
condition holds, never sleep a fixed time and hope (DEVELOPERS brief)."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest


def holds_within(
    condition: Callable[[], object], timeout_s: float = 2.0, pause_s: float = 0.0005
) -> bool:
    """Whether `condition()` comes true within `timeout_s` (asked once more at the deadline),
    for an `assert` that says what it waited for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(pause_s)
    return bool(condition())


def wait_for(
    condition: Callable[[], object], what: str, timeout_s: float = 15.0, pause_s: float = 0.05
) -> None:
    """Block until `condition()` holds; fail naming `what` once `timeout_s` has passed."""
    if not holds_within(condition, timeout_s, pause_s):
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


async def eventually(
    condition: Callable[[], object | Awaitable[object]],
    what: str = "the condition",
    timeout_s: float = 10.0,
    pause_s: float = 0.01,
) -> Any:
    """Await until `condition()` (a value, or an awaitable of one) is true and return it; fail
    naming `what` once `timeout_s` has passed."""
    if not isinstance(what, str):
        raise TypeError(f"eventually(condition, what, timeout_s): what is {what!r}, not a str")
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(pause_s)


def alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
