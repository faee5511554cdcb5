"""How much of the idle GPU the lower-priority tasks harvest (docs/harvest.md, "Harvest").

For each mode beside `exclusive`: the high-priority tasks' (the best priority's) p99 and mean
over their exclusive figures, and each lower-priority task's harvest: its completed requests
over its exclusive ones, divided by what time sharing alone could give it,
`min(1, (1 - high busy) / its busy)`, where the busy shares are each task's alone (the union of
its kernels' time over the run). Co-running kernels can take a harvest above 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuloom.sim.kernels import ModeResult, _merge
from gpuloom.sim.scenario import Scenario


def busy_alone(scenario: Scenario, exclusive: ModeResult) -> list[float]:
    """Each task's busy share of the run alone, from the `exclusive` result."""
    end = round(scenario.duration_s * 1e9)
    shares = []
    for index in range(len(scenario.tasks)):
        spans = _merge(
            [(s, min(e, end)) for s, e, i in exclusive.kernels if i == index and s < end]
        )
        shares.append(sum(e - s for s, e in spans) / end)
    return shares


def harvest_figures(scenario: Scenario, results: Sequence[ModeResult]) -> dict:
    """The figures per mode; empty without an `exclusive` result to compare with."""
    by_mode = {r.mode: r for r in results}
    exclusive = by_mode.get("exclusive")
    if exclusive is None:
        return {}
    busy = busy_alone(scenario, exclusive)
    best = min(t.priority for t in scenario.tasks)
    high = [i for i, t in enumerate(scenario.tasks) if t.priority == best]
    high_busy = sum(busy[i] for i in high)
    alone = [t.stats() for t in exclusive.tasks]
    out: dict = {
        "busy_alone": {t.name: round(b, 4) for t, b in zip(scenario.tasks, busy, strict=True)}
    }
    for result in results:
        if result.mode == "exclusive":
            continue
        stats = [t.stats() for t in result.tasks]
        entry: dict = {"high": {}, "harvest": {}}
        for i in high:
            entry["high"][scenario.tasks[i].name] = {
                "p99_over_alone": _ratio(stats[i]["jct_p99_ms"], alone[i]["jct_p99_ms"]),
                "mean_over_alone": _ratio(stats[i]["jct_mean_ms"], alone[i]["jct_mean_ms"]),
            }
        for i, task in enumerate(scenario.tasks):
            if i in high:
                continue
            limit = min(1.0, (1.0 - high_busy) / busy[i]) if busy[i] > 0 else 1.0
            kept = _ratio(stats[i]["completed"], alone[i]["completed"])
            entry["harvest"][task.name] = {
                "kept": kept,
                "limit": round(limit, 4),
                "harvest": None if kept is None or limit <= 0 else round(kept / limit, 4),
            }
        out[result.mode] = entry
    return out


def _ratio(value: float | int | None, base: float | int | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 4)


def least_harvest(figures: dict, mode: str) -> dict[str, float | None]:
    """{"harvest": the least harvest of the mode's lower-priority tasks} (None: none, or no
    figures), the figure shown beside the high-priority p99 over alone."""
    entry = figures.get(mode)
    if not entry or not entry["harvest"]:
        return {"harvest": None}
    values = [h["harvest"] for h in entry["harvest"].values()]
    return {"harvest": None if None in values else min(values)}
