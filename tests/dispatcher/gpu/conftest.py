"""Fixtures of the GPU backend tests."""

from __future__ import annotations

import pytest

from .helpers import SleepRecorder


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()
