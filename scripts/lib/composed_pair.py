"""The default admission policy live, the user's way, on the fake driver (scripts/bench_fikit's
last part).

`gpuloom up` with its default settings (one simulated A100, no GPULOOM_DISPATCHER_ setting) on
free ports; the two tasks' kernel profiles put in its store, of one or both kinds:

    measured     what a deployment's profiler measures: each task run once alone on a fresh
                 fake GPU before the rounds (the inference's requests, the training loop for
                 TRAIN_ALONE_S), and per kernel its launches, mean duration and mean gap to the
                 task's next kernel taken from the fake GPU's log (`measured`). The fake
                 kernels and host work last longer than their names say, by the late wake-ups
                 of the fake GPU's and the program's sleeps (about 100 us a kernel on a loaded
                 two-core machine).
    nominal      the durations the kernels' names give, 300/200/300 us and 150 us, with the
                 inference's host work as the gap after each (`nominal`)

then `--pair-rounds` rounds of the phases below, odd rounds in reverse order so that a drift
biases no phase, each on a fresh fake GPU (its own GPULOOM_FAKE_CUDA_DIR):

    alone        the inference (`shim/build/cudart_like`: requests of three kernels of
                 300/200/300 us, 400 us of host work between them, 2 ms between requests)
                 without gpuloom or the shim
    train alone  the training loop (150 us kernels back to back, a stream sync after each) for
                 TRAIN_ALONE_S without gpuloom
    pair         both through `gpuloom run`: the training at priority 8 started first, then the
                 inference at priority 1, each asking half the GPU's time up to all of it; one
                 such phase per kind of profile, under task keys of its own

Per round: the inference's mean and p99 as multiples of its own alone figures, the
training's work beside it (its kernels started while the inference ran, per second, from the
fake GPU's log) as a share of its rate alone (`kept`), and its harvest (docs/harvest.md): kept
over `min(1, (1 - inference busy alone) / training busy alone)`, what time sharing alone could
give it, each busy share measured from its own alone phase on the fake GPU's log (the union of
its kernels' time over the span from its first kernel's start to its last one's end); and
where the inference's extra time goes (`gap_delays`): each gap between two of its kernels
beside the training over the same gap alone, split by whether a training kernel was running
when its next kernel would have started alone. With `apart`, a control phase more per
round: the inference without gpuloom beside the training loop (TRAIN_ALONE_S) on a fake GPU of
its own, so that they share the CPUs and no GPU; its mean over alone and its gaps over alone
say what the CPUs alone cost it. With `solo`, another: the inference alone through `gpuloom
run` (its own profile, no training), which says what gpuloom's launch path costs it by itself,
so that the pair's extra over solo is what the second task's presence costs. Reported: each
round, and the medians per kind of profile. The target (docs/benchmarks.md): the median mean
at most 1.05x alone, for each kind run.

`mps=True` gives every phase's fake GPU an MPS server (GPULOOM_FAKE_CUDA_MPS=1): kernels of the
two processes co-run under the simulator's model instead of taking turns. The default run is
without: `gpuloom up`'s simulated GPU starts no MPS daemon (docs/dispatcher.md, "MPS")."""

from __future__ import annotations

import bisect
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from up_plane import UpPlane, up_environment

ROOT = Path(__file__).resolve().parents[2]
GPULOOM = str(Path(sys.executable).parent / "gpuloom")
PROGRAM = ROOT / "shim" / "build" / "cudart_like"
HIGH = ("k_h1_300us", "k_h2_200us", "k_h3_300us")
HIGH_US = (300, 200, 300)
LOW, LOW_US = "k_lo_150us", 150
GAP_US, PAUSE_US = 400, 2000
TRAIN_ALONE_S = 2.0
TARGET = 1.05

if TYPE_CHECKING:
    from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc


def kernel_stats(
    name: str, samples: int, duration_ns: float, gap_ns: float
) -> profile_store_pb2.KernelStats:
    """One kernel's entry in a profile (launch shape 1x1x1, as cudart_like launches)."""
    from gpuloom.policies.profiling.kernels import kernel_id
    from gpuloom.v1 import common_pb2, profile_store_pb2

    one = common_pb2.Dim3(x=1, y=1, z=1)
    return profile_store_pb2.KernelStats(
        kernel_id=kernel_id(name, (1, 1, 1), (1, 1, 1)), name=name, sample_count=samples,
        grid=one, block=one, mean_duration_ns=duration_ns, p50_duration_ns=duration_ns,
        p95_duration_ns=duration_ns, mean_gap_after_ns=gap_ns,
    )  # fmt: skip


def measured(runs: list[tuple[str, int, int]]) -> list[profile_store_pb2.KernelStats]:
    """One process's kernel profile from its run alone on the fake GPU's log (`_engine`'s
    rows, in order), as the profiler measures one: per kernel its launches, mean duration and
    mean gap from its end to the process's next kernel's start."""
    if not runs:
        raise ValueError("no kernel ran")
    durations: dict[str, list[int]] = {}
    gaps: dict[str, list[int]] = {}
    for (name, start, end), following in zip(runs, [*runs[1:], None], strict=True):
        durations.setdefault(name, []).append(end - start)
        if following is not None:
            gaps.setdefault(name, []).append(max(0, following[1] - end))
    return [
        kernel_stats(name, len(spans), statistics.mean(spans), statistics.mean(gaps.get(name, [0])))
        for name, spans in durations.items()
    ]


def nominal(task: str) -> list[profile_store_pb2.KernelStats]:
    """The profile the kernels' names give (`task` "infer" or "train"): 300/200/300 us with the
    host work as the gaps (the last one's the pause to the next request), 150 us with none."""
    if task == "train":
        return [kernel_stats(LOW, 100, LOW_US * 1e3, 0)]
    if task != "infer":
        raise ValueError(f"no task {task!r}")
    gaps = (GAP_US, GAP_US, PAUSE_US)
    return [
        kernel_stats(name, 100, us * 1e3, gap * 1e3)
        for name, us, gap in zip(HIGH, HIGH_US, gaps, strict=True)
    ]


def put_profile(
    store: profile_store_pb2_grpc.ProfileStoreStub,
    key: str,
    gpu_model: str,
    kernels: list[profile_store_pb2.KernelStats],
) -> None:
    """Puts `kernels` in the store as task `key`'s profile on `gpu_model`."""
    from gpuloom.v1 import profile_store_pb2

    store.PutKernelProfile(
        profile_store_pb2.PutKernelProfileRequest(
            profile=profile_store_pb2.KernelProfile(
                meta=profile_store_pb2.ProfileMeta(key=key, gpu_model=gpu_model),
                measured_runs=1,
                kernels=kernels,
            )
        )
    )


def _fake_env(base: dict[str, str], fake: Path, mps: bool) -> dict[str, str]:
    fake.mkdir()
    return {
        **base,
        "LD_LIBRARY_PATH": str(ROOT / "shim" / "build" / "fake"),
        "GPULOOM_FAKE_CUDA_DIR": str(fake),
        "GPULOOM_FAKE_CUDA_MPS": "1" if mps else "0",
    }


def busy_share(spans: list[tuple[int, int]]) -> float:
    """The share of the time from the first span's start to the last end covered by spans."""
    if not spans:
        raise ValueError("no kernel ran")
    ordered = sorted(spans)
    covered, reach = 0, ordered[0][0]
    for start, end in ordered:
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / (max(end for _, end in ordered) - ordered[0][0])


def harvest(kept: float, high_busy: float, low_busy: float) -> float:
    """The best-effort task's kept share over what time sharing alone could give it
    (docs/harvest.md, "Harvest figures"); co-running can take it above 1."""
    if not 0 < low_busy <= 1 or not 0 <= high_busy < 1:
        raise ValueError(f"busy shares out of range: high {high_busy}, low {low_busy}")
    return kept / min(1.0, (1.0 - high_busy) / low_busy)


def _infer_args(requests: int) -> list[str]:
    kernels = ",".join([*HIGH, LOW])
    return [str(PROGRAM), "module", kernels, "infer", str(requests), str(PAUSE_US), str(GAP_US),
            ",".join(HIGH)]  # fmt: skip


def _train_args(seconds: float) -> list[str]:
    return [str(PROGRAM), "module", ",".join([*HIGH, LOW]), "loop", f"{seconds:g}", LOW, "1"]


def _value(out: str, prefix: str, key: str) -> float:
    match = re.search(rf"^{prefix} .*\b{key}=([0-9.]+)", out, re.M)
    if match is None:
        raise RuntimeError(f"no {prefix} {key}= in:\n{out}")
    return float(match.group(1))


def gap_delays(alone: list[tuple[str, int, int]], paired: list[tuple[str, int, int]]) -> dict:
    """Where the inference's time beside the training goes, from the fake GPU's logs (`_engine`'s
    rows) of its alone phase and a pair phase: each gap between two of its kernels in the pair
    over the median of the same gap alone (the same next kernel). A gap is *overrun* where a
    training kernel was running at the moment the next kernel would have started alone (it
    waited for it: no preemption), *clean* otherwise (the launch path and the host work slower
    beside the training). Returns the median extra of the clean gaps and the mean of the
    overrun ones, in us, and the overrun gaps' share."""

    def gaps(runs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        high = [r for r in runs if r[0] in HIGH]
        return [(nxt[0], prev[2], nxt[1]) for prev, nxt in itertools.pairwise(high)]

    own: dict[str, list[int]] = {}
    for name, end, start in gaps(alone):
        own.setdefault(name, []).append(start - end)
    ref = {name: statistics.median(spans) for name, spans in own.items()}
    low = sorted((s, e) for name, s, e in paired if name == LOW)  # one stream: none overlap
    starts = [s for s, _ in low]
    clean, overrun = [], []
    for name, end, start in gaps(paired):
        due = end + ref[name]
        extra = (start - end - ref[name]) / 1e3
        last = bisect.bisect_left(starts, due) - 1  # the last training kernel started before
        (overrun if last >= 0 and low[last][1] > due else clean).append(extra)
    if not clean and not overrun:
        raise ValueError("the inference ran fewer than two kernels")
    return {
        "clean_us": statistics.median(clean) if clean else 0.0,
        "overrun_us": statistics.mean(overrun) if overrun else 0.0,
        "overrun_share": len(overrun) / (len(clean) + len(overrun)),
    }


def _engine(fake: Path) -> list[tuple[str, int, int]]:
    """The fake GPU's log: (kernel, start ns, end ns) of every kernel it ran."""
    runs = []
    for line in (fake / "runs.log").read_text().splitlines():
        _, _pid, name, start, end = line.split()
        runs.append((name, int(start), int(end)))
    return runs


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{args[:3]} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def _gpuloom_run(key: str, priority: int, kind: str) -> list[str]:
    return [GPULOOM, "run", "--task-key", key, "--priority", str(priority), "--kind", kind,
            "--name", key, "--sm", "100", "--quota", "50", "--quota-limit", "100",
            "--memory-gib", "1", "--timeout", "60", "--"]  # fmt: skip


def profile_alone(
    state: Path, env: dict[str, str], requests: int, mps: bool
) -> dict[str, list[profile_store_pb2.KernelStats]]:
    """Each task's profile measured as a deployment measures it, from its own run alone on a
    fresh fake GPU (`measured`): the inference's `requests` requests, the training loop's
    TRAIN_ALONE_S. Keyed "infer" and "train"."""
    profiles = {}
    for task, args in (("infer", _infer_args(requests)), ("train", _train_args(TRAIN_ALONE_S))):
        fake = state / f"profile-{task}"
        _run(args, _fake_env(env, fake, mps))
        profiles[task] = measured(_engine(fake))
    return profiles


def _one_round(
    state: Path,
    n: int,
    env: dict[str, str],
    requests: int,
    train_s: float,
    mps: bool,
    profiles: tuple[str, ...],
    controls: tuple[str, ...],
) -> dict:
    def alone() -> dict:
        fake = state / f"alone-{n}"
        out = _run(_infer_args(requests), _fake_env(env, fake, mps))
        runs = _engine(fake)
        return {
            "mean_ms": _value(out, "infer", "mean_ms"),
            "p99_ms": _value(out, "infer", "p99_ms"),
            "busy": busy_share([(s, e) for name, s, e in runs if name in HIGH]),
            "runs": runs,
        }

    def train_alone() -> dict:
        fake = state / f"train-{n}"
        _run(_train_args(TRAIN_ALONE_S), _fake_env(env, fake, mps))
        runs = [(s, e) for name, s, e in _engine(fake) if name == LOW]
        return {
            "kernels_per_s": len(runs) / ((runs[-1][1] - runs[0][0]) / 1e9),
            "busy": busy_share(runs),
        }

    def pair(kind: str) -> dict:
        fake = state / f"pair-{kind}-{n}"
        fake_env = _fake_env(env, fake, mps)
        training = subprocess.Popen(
            _gpuloom_run(f"pair-train-{kind}", 8, "training") + _train_args(train_s),
            env=fake_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while not (fake / "runs.log").exists():  # the training is on the GPU
            if training.poll() is not None:
                raise RuntimeError(f"the training's gpuloom run ended: {training.communicate()}")
            time.sleep(0.05)
        out = _run(
            _gpuloom_run(f"pair-infer-{kind}", 1, "inference") + _infer_args(requests), fake_env
        )
        _, err = training.communicate(timeout=train_s + 60)
        if training.returncode != 0:
            raise RuntimeError(f"the training's gpuloom run exited {training.returncode}: {err}")
        runs = _engine(fake)
        high = [(s, e) for name, s, e in runs if name in HIGH]
        begin, end = high[0][0], high[-1][1]
        if max(e for name, _, e in runs if name == LOW) < end:
            raise RuntimeError("the training ended before the inference: raise --pair-train-s")
        low = sum(1 for name, s, _ in runs if name == LOW and begin <= s < end)
        return {
            "mean_ms": _value(out, "infer", "mean_ms"),
            "p99_ms": _value(out, "infer", "p99_ms"),
            "train_kernels_per_s": low / ((end - begin) / 1e9),
            "runs": runs,
        }

    def apart() -> dict:
        # The training loop running beside, on a fake GPU of its own, without gpuloom: the
        # inference shares only the CPUs with it.
        fake_train, fake = state / f"apart-train-{n}", state / f"apart-infer-{n}"
        training = subprocess.Popen(
            _train_args(TRAIN_ALONE_S), env=_fake_env(env, fake_train, mps),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while not (fake_train / "runs.log").exists():
            if training.poll() is not None:
                raise RuntimeError(f"the training ended: {training.communicate()}")
            time.sleep(0.05)
        out = _run(_infer_args(requests), _fake_env(env, fake, mps))
        _, err = training.communicate(timeout=TRAIN_ALONE_S + 60)
        if training.returncode != 0:
            raise RuntimeError(f"the training exited {training.returncode}: {err}")
        runs = _engine(fake)
        if _engine(fake_train)[-1][2] < runs[-1][2]:
            raise RuntimeError("the training ended before the inference: fewer requests")
        return {"mean_ms": _value(out, "infer", "mean_ms"), "runs": runs}

    def solo() -> dict:
        # The inference through gpuloom with no training: the shim, the dispatcher and the
        # arbiter on its path, nobody to arbitrate against.
        fake = state / f"solo-{n}"
        args = _gpuloom_run(f"pair-infer-{profiles[0]}", 1, "inference") + _infer_args(requests)
        out = _run(args, _fake_env(env, fake, mps))
        return {"mean_ms": _value(out, "infer", "mean_ms"), "runs": _engine(fake)}

    phases = [("alone", alone), ("train_alone", train_alone)]
    phases += [(kind, lambda kind=kind: pair(kind)) for kind in profiles]
    phases += [(name, {"apart": apart, "solo": solo}[name]) for name in controls]
    result: dict = {}
    for name, phase in phases if n % 2 == 0 else reversed(phases):
        result[name] = phase()
    alone_, train = result["alone"], result["train_alone"]
    for kind in profiles:
        paired = result[kind]
        paired["mean_x_alone"] = paired["mean_ms"] / alone_["mean_ms"]
        paired["p99_x_alone"] = paired["p99_ms"] / alone_["p99_ms"]
        paired["be_work_share"] = paired["train_kernels_per_s"] / train["kernels_per_s"]
        paired["harvest"] = harvest(paired["be_work_share"], alone_["busy"], train["busy"])
        paired.update(gap_delays(alone_["runs"], paired.pop("runs")))
    for name in controls:
        control = result[name]
        control["mean_x_alone"] = control["mean_ms"] / alone_["mean_ms"]
        control["clean_us"] = gap_delays(alone_["runs"], control.pop("runs"))["clean_us"]
    alone_.pop("runs")
    return result


PROFILES = ("measured", "nominal")
CONTROLS = {
    "apart": "Apart: the training beside on a fake GPU of its own, without gpuloom (the CPUs "
    "shared, no GPU)",
    "solo": "Solo: the inference alone through `gpuloom run` (the shim, the dispatcher and its "
    "arbiter on its path; no training)",
}
FIGURES = ("mean_x_alone", "p99_x_alone", "be_work_share", "harvest", "clean_us", "overrun_share",
           "overrun_us")  # fmt: skip


def _gaps(figures: dict) -> str:
    return (
        f"{figures['clean_us']:+.0f} us / {figures['overrun_us']:+.0f} us "
        f"({figures['overrun_share']:.1%})"
    )


def run_pair(
    rounds: int,
    requests: int,
    train_s: float,
    mps: bool = False,
    profiles: tuple[str, ...] = ("measured",),
    controls: tuple[str, ...] = (),
) -> tuple[list[dict], bool]:
    """The rounds (module docstring), printed as markdown, one pair phase per entry of
    `profiles` ("measured", "nominal"), and a control phase per entry of `controls` ("apart",
    "solo"); returns them and whether every pair's median mean met the target."""
    import grpc

    from gpuloom.v1 import profile_store_pb2_grpc

    if not profiles or set(profiles) - set(PROFILES) or len(set(profiles)) != len(profiles):
        raise ValueError(f"profiles: some of {PROFILES}, each once, not {profiles}")
    if set(controls) - set(CONTROLS) or len(set(controls)) != len(controls):
        raise ValueError(f"controls: some of {CONTROLS}, each once, not {controls}")
    state = Path(tempfile.mkdtemp(prefix="gl-bench-pair-", dir="/tmp"))
    plane = UpPlane(
        up_environment(
            state,
            "A100-80GB",
            # No GPULOOM_ setting but where the native builds are: the dispatcher's defaults.
            keep=("GPULOOM_FIKIT_LIB", "GPULOOM_SHIM_PATH"),
            # Served open, on purpose (a benchmark on a machine of its own; docs/security.md).
            GPULOOM_INSECURE="true",
            GPULOOM_LOG_LEVEL="warning",
        ),
        state / "plane.log",
    )
    try:
        plane.start(endpoints=4)  # store, profiler, placement, the GPU's dispatcher
        env = {k: v for k, v in plane.env.items() if k != "GPULOOM_DATA_DIR"}
        env["GPULOOM_PLACEMENT_ADDRESS"] = plane.address("placement")
        alone = profile_alone(state, env, requests, mps) if "measured" in profiles else {}
        with grpc.insecure_channel(plane.address("profile-store")) as channel:
            store = profile_store_pb2_grpc.ProfileStoreStub(channel)
            for kind in profiles:
                for task in ("infer", "train"):
                    kernels = alone[task] if kind == "measured" else nominal(task)
                    put_profile(store, f"pair-{task}-{kind}", "A100-80GB", kernels)
        results = [
            _one_round(state, n, env, requests, train_s, mps, profiles, controls)
            for n in range(rounds)
        ]
    finally:
        plane.stop()
        shutil.rmtree(state, ignore_errors=True)
    gpu = "with MPS (GPULOOM_FAKE_CUDA_MPS=1)" if mps else "without MPS"
    print(
        f"\nThe default policy live (`gpuloom up`, default settings; `gpuloom run` at priority 1 "
        f"and 8; fake driver {gpu}), {requests} requests, {rounds} alternating rounds, load "
        f"average {os.getloadavg()[0]:.2f}:\n"
    )
    if alone:
        for task in ("infer", "train"):
            print(f"Measured {task} profile: " + ", ".join(
                f"{k.name} {k.mean_duration_ns / 1e3:.0f} us (gap {k.mean_gap_after_ns / 1e3:.0f})"
                for k in alone[task]
            ))  # fmt: skip
        print()
    print("| round | profiles | alone mean / p99 ms | paired mean / p99 ms | hp mean x alone "
          "| hp p99 x alone | busy alone hp / be | best-effort work share | harvest "
          "| hp gaps over alone: clean / overrun (share) |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, r in enumerate(results):
        for kind in profiles:
            p = r[kind]
            print(
                f"| {n + 1} | {kind} | {r['alone']['mean_ms']:.3f} / {r['alone']['p99_ms']:.3f} "
                f"| {p['mean_ms']:.3f} / {p['p99_ms']:.3f} | {p['mean_x_alone']:.3f} "
                f"| {p['p99_x_alone']:.3f} "
                f"| {r['alone']['busy']:.3f} / {r['train_alone']['busy']:.3f} "
                f"| {p['be_work_share']:.3f} | {p['harvest']:.3f} | {_gaps(p)} |"
            )
    medians = {
        kind: {k: statistics.median(r[kind][k] for r in results) for k in FIGURES}
        for kind in profiles
    }
    for kind, m in medians.items():
        print(
            f"| median | {kind} | | | {m['mean_x_alone']:.3f} | {m['p99_x_alone']:.3f} | "
            f"| {m['be_work_share']:.3f} | {m['harvest']:.3f} | {_gaps(m)} |"
        )
    print()
    met = True
    for kind, m in medians.items():
        ok = m["mean_x_alone"] <= TARGET
        met = met and ok
        print(
            f"Target, {kind} profiles: the high-priority mean at most {TARGET}x alone (median of "
            f"the rounds): {'met' if ok else 'MISSED'} ({m['mean_x_alone']:.3f}x)"
        )
    if len(profiles) == 2:
        ratio = statistics.median(
            r["measured"]["mean_ms"] / r["nominal"]["mean_ms"] for r in results
        )
        print(f"Paired mean, measured over nominal profiles, median of the rounds: {ratio:.3f}")
    for name in controls:
        print(f"\n{CONTROLS[name]}:\n")
        print("| round | hp mean x alone | clean gaps over alone |")
        print("|---:|---:|---:|")
        for n, r in enumerate(results):
            print(f"| {n + 1} | {r[name]['mean_x_alone']:.3f} | {r[name]['clean_us']:+.0f} us |")
        x = statistics.median(r[name]["mean_x_alone"] for r in results)
        clean = statistics.median(r[name]["clean_us"] for r in results)
        print(f"| median | {x:.3f} | {clean:+.0f} us |")
    return results, met
