"""FIKIT kernel admission (Fill Inter-Kernel Idle Time): the ctypes binding of the native
decision core `shim/src/fikit.c`, which the dispatcher's arbiter and the simulator share."""

from gpuloom.policies.fikit.core import (
    MAX_TASKS,
    PRIORITIES,
    UNKNOWN,
    FikitConfig,
    FikitCore,
    FikitCounters,
    FikitLibraryMissingError,
    load_library,
)

__all__ = [
    "MAX_TASKS",
    "PRIORITIES",
    "UNKNOWN",
    "FikitConfig",
    "FikitCore",
    "FikitCounters",
    "FikitLibraryMissingError",
    "load_library",
]
