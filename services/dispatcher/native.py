"""The dispatcher's native library (libglfikit.so: the admission engine, the heartbeat): one
handle that keeps errno for its calls, and counter structs read into the dataclasses that
name them."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any, TypeVar

from gpuloom.policies.fikit.core import library_path

T = TypeVar("T")


@functools.cache
def native_library() -> ctypes.CDLL:
    # Its own handle on the library (not the simulator's): errno must be kept for these calls.
    return ctypes.CDLL(str(library_path()), use_errno=True)


def counters_struct(view: type[Any], u32: tuple[str, ...]) -> type[ctypes.Structure]:
    """The C struct of a stats dataclass: its fields in order, u64 but for those in `u32`."""
    fields = [
        (f.name, ctypes.c_uint32 if f.name in u32 else ctypes.c_uint64)
        for f in dataclasses.fields(view)
    ]
    return type(f"_{view.__name__}Struct", (ctypes.Structure,), {"_fields_": fields})


def read_counters(view: type[T], raw: ctypes.Structure) -> T:
    return view(*(getattr(raw, name) for name, _ in raw._fields_))
