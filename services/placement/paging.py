"""Page tokens of ListJobs and ListGpus: opaque to clients, checked when they come back."""

from __future__ import annotations

import base64

from gpuloom.domain.errors import InvalidArgument


def encode_token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def decode_text(token: str) -> str:
    if not token:
        return ""
    try:
        return base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeError):
        raise InvalidArgument("page_token", "is not a token this service handed out") from None


def decode_seq(token: str) -> int:
    text = decode_text(token)
    if not text:
        return 0
    if not text.isdigit():
        raise InvalidArgument("page_token", "is not a token this service handed out")
    return int(text)
