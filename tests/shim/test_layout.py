"""The shared-memory layout is the same in C and in Python: the admission region's magic,
version, size and every field offset (the lease words, the FIKIT words, the lease request words
and the memory sample ring), and the values of the mode, state, FIKIT role and lease request
flag enums.

The C values come from the compiler, not from reading the header: a small program that includes
`shim/src/wire.h` prints each constant. The names to compare are every region constant
`wire.h` defines and every one `gpuloom/shimwire.py` has, so a field added, moved or renumbered
on either side alone fails here. The FIKIT arm words and the priority boards (their size and
word offsets) are compared the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuloom import shimwire
from gpuloom.shimwire import AdmissionState, FikitPost, FikitRole, LeaseRequestFlag, ShimMode
from gpuloom.v1 import shim_pb2

WIRE_H = Path(__file__).resolve().parents[2] / "shim" / "src" / "wire.h"
# A region constant in wire.h: the region's own constants, field offsets, modes, states, the
# dispatcher's heartbeat period and bound, and the FIKIT roles and post kinds.
C_NAME = r"GL_(?:(?:REGION|OFF|MODE|STATE|ROLE|POST|LR|BOARD|BEAT)_[A-Z0-9_]+|BOARDS|ARM_KERNELS)"


def c_names(header: str) -> list[str]:
    """Every region constant the header defines (macros and enum members)."""
    defined = re.findall(rf"^#define\s+({C_NAME})\b", header, re.MULTILINE)
    enumerated = re.findall(rf"\b({C_NAME})\s*=", header)
    return sorted(set(defined) | set(enumerated))


def c_layout(names: list[str], work: Path) -> dict[str, int]:
    """The values the C compiler gives `names`, by compiling and running a program."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert compiler, "no C compiler (cc or gcc): the layout test needs one"
    source = work / "layout.c"
    lines = [
        f'    printf("{name} %llu\\n", (unsigned long long)({name}));' for name in names
    ]  # fmt: skip
    source.write_text(
        '#include <stdio.h>\n#include "wire.h"\n\nint main(void) {\n'
        + "\n".join(lines)
        + "\n    return 0;\n}\n"
    )
    program = work / "layout"
    build = subprocess.run(
        [compiler, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", str(WIRE_H.parent),
         "-o", str(program), str(source)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, f"cannot compile the layout program:\n{build.stderr}"
    output = subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout
    return {name: int(value) for name, value in (line.split() for line in output.splitlines())}


def python_layout() -> dict[str, int]:
    """The same constants as gpuloom/shimwire.py has them, under the C names."""
    values = {
        "GL_REGION_MAGIC": shimwire.REGION_MAGIC,
        "GL_REGION_VERSION": shimwire.REGION_VERSION,
        "GL_REGION_BYTES": shimwire.REGION_BYTES,
        "GL_REGION_SAMPLES": shimwire.REGION_SAMPLES,
    }
    values.update(
        {f"GL{name}": value for name, value in vars(shimwire).items() if name.startswith("_OFF_")}
    )
    # The FIKIT words (public: the arbiter's tests and the reference client write them).
    values.update(
        {f"GL_{name}": value for name, value in vars(shimwire).items() if name.startswith("OFF_")}
    )
    # The arm's size and the priority boards (docs/fikit.md, the one-wake-up path).
    values.update(
        {
            f"GL_{name}": getattr(shimwire, name)
            for name in ("ARM_KERNELS", "BOARD_BYTES", "BOARD_LAUNCH", "BOARD_FIRED", "BOARDS")
        }
    )
    # The dispatcher's heartbeat: its period and the fewest periods a shim's bound spans.
    values.update(
        {f"GL_{name}": getattr(shimwire, name) for name in ("BEAT_PERIOD_NS", "BEAT_MIN_PERIODS")}
    )
    values.update({f"GL_ROLE_{role.name}": role.value for role in FikitRole})
    values.update({f"GL_POST_{post.name}": post.value for post in FikitPost})
    values.update({f"GL_LR_{flag.name}": flag.value for flag in LeaseRequestFlag})
    values.update({f"GL_MODE_{mode.name}": mode.value for mode in ShimMode})
    values.update({f"GL_STATE_{state.name}": state.value for state in AdmissionState})
    return values


def test_c_and_python_agree(tmp_path: Path) -> None:
    names = c_names(WIRE_H.read_text())
    assert "GL_OFF_ADMIT_UNTIL" in names and "GL_STATE_EVICTED" in names, names
    c = c_layout(names, tmp_path)
    python = python_layout()
    assert sorted(c) == sorted(python), (
        f"only in wire.h: {sorted(set(c) - set(python))}; "
        f"only in shimwire.py: {sorted(set(python) - set(c))}"
    )
    differing = {name: (c[name], python[name]) for name in c if c[name] != python[name]}
    assert not differing, f"(C, Python) values differ: {differing}"


@pytest.mark.parametrize(
    ("python_enum", "proto_enum", "prefix"),
    [(ShimMode, shim_pb2.ShimMode, "SHIM_MODE_"),
     (AdmissionState, shim_pb2.AdmissionState, "ADMISSION_STATE_")],
)  # fmt: skip
def test_enums_mirror_the_proto(python_enum, proto_enum, prefix: str) -> None:
    proto = {
        name.removeprefix(prefix): value
        for name, value in proto_enum.items()
        if not name.endswith("_UNSPECIFIED")
    }
    assert {member.name: member.value for member in python_enum} == proto
