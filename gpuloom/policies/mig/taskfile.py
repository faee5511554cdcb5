"""The task file format of `gpuloom mig plan`: one task per line, `name t1 t2 ...` with the
seconds the task takes on an instance of each size of the GPU, smallest size first (A30:
t1 t2 t4; A100/H100: t1 t2 t3 t4 t7). `inf` marks a size the task cannot run on; `#` starts
a comment. Text in, tasks out: reading files is the caller's business."""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig.plan import MigTask


class TaskFileError(ValueError):
    """A task file that cannot be used; `line` is 1-based (None: the file as a whole)."""

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


def columns(gpu: MigGeometry) -> str:
    return "name " + " ".join(f"t{size}" for size in gpu.sizes)


def parse_tasks(text: str, gpu: MigGeometry) -> list[MigTask]:
    tasks = []
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        name, values = fields[0], fields[1:]
        if len(values) != len(gpu.sizes):
            raise TaskFileError(
                number,
                f"expected {len(gpu.sizes)} times after the name ({columns(gpu)} on "
                f"{gpu.name}), got {len(values)}",
            )
        times = {}
        for size, value in zip(gpu.sizes, values, strict=True):
            try:
                seconds = float(value)
            except ValueError:
                raise TaskFileError(
                    number, f"{name}: t{size} = {value!r} is not a number"
                ) from None
            if math.isnan(seconds) or seconds <= 0:
                raise TaskFileError(
                    number,
                    f"{name}: t{size} = {value!r}; times must be positive seconds or inf",
                )
            times[size] = seconds
        if all(math.isinf(seconds) for seconds in times.values()):
            raise TaskFileError(number, f"{name} cannot run on any instance size (all inf)")
        tasks.append(MigTask(name, times))
    if not tasks:
        raise TaskFileError(None, "no tasks (the file is empty or holds only comments)")
    return tasks


def format_tasks(tasks: Sequence[MigTask], gpu: MigGeometry, header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    lines.append(f"# {columns(gpu)}")
    for task in tasks:
        times = " ".join(format(task.time(size), ".10g") for size in gpu.sizes)
        lines.append(f"{task.name} {times}")
    return "\n".join(lines) + "\n"
