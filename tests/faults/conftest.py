"""The fault suite: services killed and dependencies lost mid-work, real processes, bounded in
time (the whole folder runs in about a minute)."""

from tests.placement.conftest import short_dir

__all__ = ["short_dir"]
