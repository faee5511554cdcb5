"""The default admission policy live, the user's way, on the fake driver (scripts/bench_fikit's
last part).

`gpuloom up` with its default settings (one simulated A100, no GPULOOM_DISPATCHER_ setting) on
free ports; the two tasks' kernel profiles put in its store (what the profiler would measure:
the fake kernels' own durations and the inference's host work as the gap after each); then
`--pair-rounds` rounds of three phases, odd rounds in reverse order so that a drift biases no
phase, each on a fresh fake GPU (its own GPULOOM_FAKE_CUDA_DIR):

    alone        the inference (`shim/build/cudart_like`: requests of three kernels of
                 300/200/300 us, 400 us of host work between them, 2 ms between requests)
                 without gpuloom or the shim
    train alone  the training loop (150 us kernels back to back, a stream sync after each) for
                 TRAIN_ALONE_S without gpuloom
    pair         both through `gpuloom run`: the training at priority 8 started first, then the
                 inference at priority 1, each asking half the GPU's time up to all of it

Per round: the inference's mean and p99 as multiples of its own alone figures, the
training's work beside it (its kernels started while the inference ran, per second, from the
fake GPU's log) as a share of its rate alone (`kept`), and its harvest (docs/harvest.md): kept
over `min(1, (1 - inference busy alone) / training busy alone)`, what time sharing alone could
give it, each busy share measured from its own alone phase on the fake GPU's log (the union of
its kernels' time over the span from its first kernel's start to its last one's end).
Reported: each round, and the medians. The target (docs/benchmarks.md): the median mean at
most 1.05x alone.

`mps=True` gives every phase's fake GPU an MPS server (GPULOOM_FAKE_CUDA_MPS=1): kernels of the
two processes co-run under the simulator's model instead of taking turns. The default run is
without: `gpuloom up`'s simulated GPU starts no MPS daemon (docs/dispatcher.md, "MPS")."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def _profiles(gpu_model: str):
    from gpuloom.policies.profiling.kernels import kernel_id
    from gpuloom.v1 import common_pb2, profile_store_pb2

    one = (1, 1, 1)

    def stats(name: str, us: float, gap_us: float) -> profile_store_pb2.KernelStats:
        return profile_store_pb2.KernelStats(
            kernel_id=kernel_id(name, one, one), name=name, sample_count=100,
            grid=common_pb2.Dim3(x=1, y=1, z=1), block=common_pb2.Dim3(x=1, y=1, z=1),
            mean_duration_ns=us * 1e3, p50_duration_ns=us * 1e3, p95_duration_ns=us * 1e3,
            mean_gap_after_ns=gap_us * 1e3,
        )  # fmt: skip

    gaps = (GAP_US, GAP_US, PAUSE_US)  # the last kernel's gap is the pause to the next request
    infer = [stats(n, us, g) for n, us, g in zip(HIGH, HIGH_US, gaps, strict=True)]
    for key, kernels in (("pair-infer", infer), ("pair-train", [stats(LOW, LOW_US, 0)])):
        yield profile_store_pb2.PutKernelProfileRequest(
            profile=profile_store_pb2.KernelProfile(
                meta=profile_store_pb2.ProfileMeta(key=key, gpu_model=gpu_model),
                measured_runs=10,
                kernels=kernels,
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


def _one_round(
    state: Path, n: int, env: dict[str, str], requests: int, train_s: float, mps: bool
) -> dict:
    def alone() -> dict:
        fake = state / f"alone-{n}"
        out = _run(_infer_args(requests), _fake_env(env, fake, mps))
        return {
            "mean_ms": _value(out, "infer", "mean_ms"),
            "p99_ms": _value(out, "infer", "p99_ms"),
            "busy": busy_share([(s, e) for name, s, e in _engine(fake) if name in HIGH]),
        }

    def train_alone() -> dict:
        fake = state / f"train-{n}"
        _run(_train_args(TRAIN_ALONE_S), _fake_env(env, fake, mps))
        runs = [(s, e) for name, s, e in _engine(fake) if name == LOW]
        return {
            "kernels_per_s": len(runs) / ((runs[-1][1] - runs[0][0]) / 1e9),
            "busy": busy_share(runs),
        }

    def pair() -> dict:
        fake_env = _fake_env(env, state / f"pair-{n}", mps)
        training = subprocess.Popen(
            _gpuloom_run("pair-train", 8, "training") + _train_args(train_s), env=fake_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while not (state / f"pair-{n}" / "runs.log").exists():  # the training is on the GPU
            if training.poll() is not None:
                raise RuntimeError(f"the training's gpuloom run ended: {training.communicate()}")
            time.sleep(0.05)
        out = _run(_gpuloom_run("pair-infer", 1, "inference") + _infer_args(requests), fake_env)
        _, err = training.communicate(timeout=train_s + 60)
        if training.returncode != 0:
            raise RuntimeError(f"the training's gpuloom run exited {training.returncode}: {err}")
        runs = _engine(state / f"pair-{n}")
        high = [(s, e) for name, s, e in runs if name in HIGH]
        begin, end = high[0][0], high[-1][1]
        if max(e for name, _, e in runs if name == LOW) < end:
            raise RuntimeError("the training ended before the inference: raise --pair-train-s")
        low = sum(1 for name, s, _ in runs if name == LOW and begin <= s < end)
        return {
            "mean_ms": _value(out, "infer", "mean_ms"),
            "p99_ms": _value(out, "infer", "p99_ms"),
            "train_kernels_per_s": low / ((end - begin) / 1e9),
        }

    phases = [("alone", alone), ("train_alone", train_alone), ("pair", pair)]
    result = {}
    for name, phase in phases if n % 2 == 0 else reversed(phases):
        result[name] = phase()
    result["mean_x_alone"] = result["pair"]["mean_ms"] / result["alone"]["mean_ms"]
    result["p99_x_alone"] = result["pair"]["p99_ms"] / result["alone"]["p99_ms"]
    result["be_work_share"] = (
        result["pair"]["train_kernels_per_s"] / result["train_alone"]["kernels_per_s"]
    )
    result["harvest"] = harvest(
        result["be_work_share"], result["alone"]["busy"], result["train_alone"]["busy"]
    )
    return result


def run_pair(
    rounds: int, requests: int, train_s: float, mps: bool = False
) -> tuple[list[dict], bool]:
    """The rounds (module docstring), printed as markdown; returns them and whether the median
    mean met the target."""
    import grpc

    from gpuloom.v1 import profile_store_pb2_grpc

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
        with grpc.insecure_channel(plane.address("profile-store")) as channel:
            store = profile_store_pb2_grpc.ProfileStoreStub(channel)
            for request in _profiles("A100-80GB"):
                store.PutKernelProfile(request)
        env = {k: v for k, v in plane.env.items() if k != "GPULOOM_DATA_DIR"}
        env["GPULOOM_PLACEMENT_ADDRESS"] = plane.address("placement")
        results = [_one_round(state, n, env, requests, train_s, mps) for n in range(rounds)]
    finally:
        plane.stop()
        shutil.rmtree(state, ignore_errors=True)
    gpu = "with MPS (GPULOOM_FAKE_CUDA_MPS=1)" if mps else "without MPS"
    print(
        f"\nThe default policy live (`gpuloom up`, default settings; `gpuloom run` at priority 1 "
        f"and 8; fake driver {gpu}), {requests} requests, {rounds} alternating rounds, load "
        f"average {os.getloadavg()[0]:.2f}:\n"
    )
    print("| round | alone mean / p99 ms | paired mean / p99 ms | hp mean x alone "
          "| hp p99 x alone | busy alone hp / be | best-effort work share | harvest |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in enumerate(results):
        print(
            f"| {n + 1} | {r['alone']['mean_ms']:.3f} / {r['alone']['p99_ms']:.3f} "
            f"| {r['pair']['mean_ms']:.3f} / {r['pair']['p99_ms']:.3f} | {r['mean_x_alone']:.3f} "
            f"| {r['p99_x_alone']:.3f} "
            f"| {r['alone']['busy']:.3f} / {r['train_alone']['busy']:.3f} "
            f"| {r['be_work_share']:.3f} | {r['harvest']:.3f} |"
        )
    median = {k: statistics.median(r[k] for r in results)
              for k in ("mean_x_alone", "p99_x_alone", "be_work_share", "harvest")}  # fmt: skip
    print(
        f"| median | | | {median['mean_x_alone']:.3f} | {median['p99_x_alone']:.3f} | "
        f"| {median['be_work_share']:.3f} | {median['harvest']:.3f} |"
    )
    met = median["mean_x_alone"] <= TARGET
    print(
        f"\nTarget: the high-priority mean at most {TARGET}x alone (median of the rounds): "
        f"{'met' if met else 'MISSED'} ({median['mean_x_alone']:.3f}x)"
    )
    return results, met
