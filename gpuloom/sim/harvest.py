"""How much of the idle GPU the lower-priority tasks harvest (docs/harvest.md, "Harvest").

For each mode beside `exclusive`: the high-priority tasks' (the best priority's) p99 and mean
over their exclusive figures, and each lower-priority task's harvest: its completed requests
over its exclusive ones, divided by what time sharing alone could give it,
`min(1, (1 - high busy) / its busy)`, where the busy shares are each task's alone (the union of
its kernels' time over the run). Co-running kernels can take a harvest above 1.

Beside it, each lower-priority task's *time-sharing ceiling*: the harvest a clairvoyant filler
would reach that knows every idle stretch of the high-priority tasks' exclusive run and puts
the task's kernels into them, in their stream's order, each only where it ends before the
holder's next kernel starts (never beside it). Time sharing without co-running cannot do
better on the same timeline (docs/harvest.md, "Why the harvest is low").
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
        "busy_alone": {t.name: round(b, 4) for t, b in zip(scenario.tasks, busy, strict=True)},
        "ceiling": time_sharing_ceiling(scenario, exclusive, busy),
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


def time_sharing_ceiling(
    scenario: Scenario, exclusive: ModeResult, busy: Sequence[float]
) -> dict[str, dict[str, float | None]]:
    """Per lower-priority task: `kept`, the share of its alone throughput (device time) a
    clairvoyant in-order filler of the holder's idle stretches gets, and `harvest`, that over
    its limit. Each task is packed as if it were the only filler (with several, an upper
    bound for each). Its kernels at their listed durations, its host never in the way."""
    end = round(scenario.duration_s * 1e9)
    best = min(t.priority for t in scenario.tasks)
    high = {i for i, t in enumerate(scenario.tasks) if t.priority == best}
    held = _merge([(s, min(e, end)) for s, e, i in exclusive.kernels if i in high and s < end])
    idle, at = [], 0
    for start, stop in held:
        if start > at:
            idle.append((at, start))
        at = max(at, stop)
    if at < end:
        idle.append((at, end))
    high_busy = sum(busy[i] for i in high)
    out: dict[str, dict[str, float | None]] = {}
    for index, task in enumerate(scenario.tasks):
        if index in high:
            continue
        alone = sum(min(e, end) - s for s, e, i in exclusive.kernels if i == index and s < end)
        durations = [k.duration_ns for k in task.kernels]
        begin = round(task.start_s * 1e9)
        if alone <= 0 or sum(durations) <= 0:
            out[task.name] = {"kept": None, "harvest": None}
            continue
        packed = next_kernel = 0
        for low, stop in idle:
            t = max(low, begin)
            while t + durations[next_kernel] <= stop:
                t += durations[next_kernel]
                packed += durations[next_kernel]
                next_kernel = (next_kernel + 1) % len(durations)
        kept = packed / alone
        limit = min(1.0, (1.0 - high_busy) / busy[index]) if busy[index] > 0 else 1.0
        out[task.name] = {
            "kept": round(kept, 4),
            "harvest": round(kept / limit, 4) if limit > 0 else None,
        }
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
