"""Tables for the CLI. On a terminal: a rich table, states in colour (running green, pending
yellow, failed red, ...). Anywhere else (a pipe, a file, the tests): plain text, columns sized
to their content, numbers right-aligned, no escape codes. rich decides what a terminal is:
stdout a TTY, or FORCE_COLOR set; NO_COLOR and TERM=dumb turn the colour off."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

# Columns whose values are states, and the colour of each state (job, GPU, session, lease).
STATE_COLUMNS = frozenset({"STATE", "STATUS"})
STATE_STYLES = {
    "assigned": "green",
    "running": "green",
    "holding": "green",
    "open": "green",
    "schedulable": "green",
    "succeeded": "cyan",
    "complete": "cyan",
    "pending": "yellow",
    "binding": "yellow",
    "waiting": "yellow",
    "unschedulable": "yellow",
    "failed": "red",
    "lost": "red",
    "evicted": "red",
    "blocked": "red",
    "cancelled": "dim",
}


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The plain-text table."""
    cells = [[_text(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = _numeric(headers, rows)

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def rich_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    """The same table for a terminal: bold headers, states coloured. Cells are plain text
    (names come from users and must not be read as rich markup)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for header, right in zip(headers, _numeric(headers, rows), strict=True):
        table.add_column(
            header, justify="right" if right else "left", no_wrap=header != headers[-1]
        )
    states = [header in STATE_COLUMNS for header in headers]
    for row in rows:
        table.add_row(
            *(
                Text(_text(value), style=STATE_STYLES.get(str(value), "") if state else "")
                for value, state in zip(row, states, strict=True)
            )
        )
    return table


def echo_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], console: Console | None = None
) -> None:
    """Print the table to stdout: rich on a terminal, plain text otherwise."""
    console = console or Console(file=sys.stdout)
    plain = render_table(headers, rows)
    if not console.is_terminal:
        click.echo(plain)
        return
    # No cell is cut short on a narrow terminal: the lines wrap there as plain text would.
    console.width = max(console.width, max(len(line) for line in plain.splitlines()))
    console.print(rich_table(headers, rows), crop=False, highlight=False)


def _numeric(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[bool]:
    return [
        bool(rows)
        and all(isinstance(row[i], int | float) and not isinstance(row[i], bool) for row in rows)
        for i in range(len(headers))
    ]


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
