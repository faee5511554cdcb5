"""Where the launch shim (`libgpuloom.so`) is, for commands that preload it into a child."""

from __future__ import annotations

import os
from pathlib import Path

# Where scripts/test and scripts/up build the shim in a checkout.
CHECKOUT_SHIM = Path(__file__).resolve().parents[1] / "shim" / "build" / "libgpuloom.so"
SHIM_PATH_ENV = "GPULOOM_SHIM_PATH"


def default_shim_path() -> str | None:
    """GPULOOM_SHIM_PATH when set, else the checkout's shim/build/libgpuloom.so if it is built,
    else None (no shim known)."""
    configured = os.environ.get(SHIM_PATH_ENV)
    if configured:
        return configured
    return str(CHECKOUT_SHIM) if CHECKOUT_SHIM.is_file() else None
