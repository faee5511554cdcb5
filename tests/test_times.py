"""How the clients write instants and lengths of time."""

from __future__ import annotations

import pytest

from gpuloom.clients.times import duration, rfc3339


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (59.9, "59s"),
        (60, "1m00s"),
        (3599, "59m59s"),
        (3725, "1h02m"),
        (90_061, "1d01h"),
        (-0.5, "-"),
    ],
)
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_rfc3339_is_utc_and_never_is_a_dash() -> None:
    assert rfc3339(0) == "-"
    assert rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20Z"
    assert rfc3339(1_700_000_000.25, millis=True) == "2023-11-14T22:13:20.250Z"
