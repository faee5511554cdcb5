"""The fault suite: services killed and dependencies lost mid-work, real processes, bounded in
time (the whole folder runs in about a minute)."""

from tests.shim.conftest import run, shim_build

__all__ = ["run", "shim_build"]
