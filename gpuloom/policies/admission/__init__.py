"""Kernel admission on one GPU: who may launch a kernel now. One policy by default,
`composed` (FIKIT's priority across levels, time-quota leases within a level, every job bounded
by its quota limit); the baselines `fikit`, `token`, `fifo` and `sharing` for the simulator and
the benchmarks. Pure: integer ns from the caller, no clock, no I/O (the FIKIT core is C, reached
through ctypes)."""

from gpuloom.policies.admission.composed import ComposedAdmission
from gpuloom.policies.admission.fikit_only import FikitAdmission
from gpuloom.policies.admission.model import Kernel, KernelAdmission, TaskShare
from gpuloom.policies.admission.registry import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION,
    make_admission,
)
from gpuloom.policies.admission.sharing import SharingAdmission
from gpuloom.policies.admission.tokens_only import TokenAdmission

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_ADMISSION",
    "ComposedAdmission",
    "FikitAdmission",
    "Kernel",
    "KernelAdmission",
    "SharingAdmission",
    "TaskShare",
    "TokenAdmission",
    "make_admission",
]
