"""Kubernetes resource quantities ("4Gi", "500m", "1e3"), as the API server writes them:
a decimal number, then a binary (Ki..Ei) or decimal (n, u, m, k, M..E) suffix or an exponent."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exponent>[eE][+-]?\d+)|(?P<decimal>[numkMGTPE]?))"
)
MAX_TEXT = 64


def parse_quantity(text: object) -> Decimal:
    """The quantity's value; ValueError saying why for anything that is not one. A number
    (as YAML or JSON may carry it) counts as its decimal text."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"must be a quantity such as 4Gi or 40, got {text!r}")
    text = str(text)
    match = _QUANTITY.fullmatch(text) if len(text) <= MAX_TEXT else None
    if match is None:
        raise ValueError(f"must be a quantity such as 4Gi or 40, got {text[:MAX_TEXT]!r}")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"not a number: {text!r}") from None
    if match["binary"]:
        return number * (1024 ** _BINARY[match["binary"]])
    if match["exponent"]:
        exponent = int(match["exponent"][1:])
        if abs(exponent) > 30:
            raise ValueError(f"exponent out of range in {text!r}")
        return number.scaleb(exponent)
    return number.scaleb(_DECIMAL[match["decimal"] or ""])


def parse_whole(text: object) -> int:
    """A quantity that must be a whole number (as extended resources are)."""
    value = parse_quantity(text)
    if value != value.to_integral_value():
        raise ValueError(f"must be a whole number, got {text!r}")
    return int(value)
