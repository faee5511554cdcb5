"""The body of scripts/demo: a scripted day on the embedded control plane.

It starts `gpuloom up` on free ports with two simulated A100s (GPU 0 in MIG mode), then, each
step printed with the command a user would type:

1. the fleet (`gpuloom gpus`);
2. a kernel profile written and read back with grpcurl (the profile store has reflection);
3. a high-priority inference service and a low-priority batch job sharing GPU 1, each through
   `gpuloom run` and the launch shim (examples/serve.py on the fake driver), both assigned to
   the same GPU at the same time, seen in `gpuloom top --once`; the service's latency beside
   the batch against its latency alone, protected by the dispatcher's default admission policy
   (composed) and said so (more than 2x its latency alone fails the demo);
4. a MIG batch planned (FAR) on GPU 0 by its dispatcher, which reconfigures the GPU on the
   plan's schedule, and run by `gpuloom mig run`, which starts each task in its instance;

and stops the plane. Every step checks what it shows; the first that fails ends the demo with
exit code 1 and says why. The plane's state and log stay in the state directory.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from up_plane import UpFailed, UpPlane, up_environment

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPULOOM = str(BIN / "gpuloom")
SIM_GPUS = "A100-80GB:mig,A100-80GB"
START_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 120.0

KERNEL_PROFILE = {
    "profile": {
        "meta": {"key": "resnet50-infer", "gpu_model": "A100-80GB"},
        "measured_runs": 20,
        "kernels": [
            {
                "kernel_id": "42",
                "name": "sgemm",
                "grid": {"x": 128, "y": 1, "z": 1},
                "block": {"x": 256, "y": 1, "z": 1},
                "sample_count": 19,
                "mean_duration_ns": 500000,
                "p50_duration_ns": 480000,
                "p95_duration_ns": 610000,
                "mean_gap_after_ns": 2000000,
            }
        ],
    }
}
# Rodinia-like tasks: seconds by instance size (slices) for the planner, and a short command each.
MIG_TASKS = [
    ("bfs", {"1": 2.0, "2": 1.2, "3": 0.9, "4": 0.8, "7": 0.6}),
    ("srad", {"1": 3.0, "2": 1.7, "3": 1.3, "4": 1.1, "7": 0.8}),
    ("lud", {"1": 1.0, "2": 0.6, "3": 0.5, "4": 0.45, "7": 0.4}),
    ("nw", {"1": 0.8, "2": 0.6, "3": 0.55, "4": 0.5, "7": 0.5}),
]


class DemoFailed(Exception):
    """A step did not do what it shows; the message says what."""


def _mean_ms(output: str) -> float:
    """The mean latency examples/serve.py reports ("... mean M ms, p99 ...")."""
    match = re.search(r"mean ([0-9.]+) ms", output)
    if match is None:
        raise DemoFailed(f"no latency in the service's output: {output!r}")
    return float(match.group(1))


def say(text: str = "") -> None:
    print(text, flush=True)


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip("\n").splitlines())


def start_plane(state: Path) -> UpPlane:
    """`gpuloom up` on SIM_GPUS with its state in `state`, its endpoints printed."""
    plane = UpPlane(
        up_environment(
            state,
            SIM_GPUS,
            # Its own credentials (made on the plane's first start), which its CLI calls find
            # here too; a reader's `scripts/up` keeps them in ~/.config/gpuloom.
            GPULOOM_CREDENTIALS_DIR=str(state / "credentials"),
            GPULOOM_LOG_FORMAT="console",
        ),
        state / "plane.log",
    )
    try:
        plane.start(endpoints=5, timeout_s=START_TIMEOUT_S)  # store, profiler, placement, 2 GPUs
    except UpFailed as error:
        raise DemoFailed(str(error)) from None
    say(plane.header)
    for name, address in plane.endpoints.items():
        say(f"  {name:<34} {address}")
    return plane


class Day:
    def __init__(self, plane: UpPlane, state: Path, grpcurl: str) -> None:
        self.state = state
        self.grpcurl_path = grpcurl
        self.placement = plane.address("placement")
        self.store = plane.address("profile-store")
        self.mig_dispatcher = plane.address("dispatcher GPU 0")
        self.env = {**plane.env, "GPULOOM_PLACEMENT_ADDRESS": self.placement}
        del self.env["GPULOOM_DATA_DIR"]

    # -- helpers ---------------------------------------------------------------------------

    def gpuloom(self, *args: str, columns: int | None = None) -> str:
        say(f"$ gpuloom {shlex.join(args)}")
        env = self.env if columns is None else {**self.env, "COLUMNS": str(columns)}
        result = subprocess.run(
            [GPULOOM, *args], env=env, capture_output=True, text=True, timeout=60
        )
        if result.returncode != 0:
            raise DemoFailed(f"gpuloom {args[0]} exited {result.returncode}: {result.stderr}")
        say(indent(result.stdout))
        return result.stdout

    def grpcurl(self, address: str, method: str, body: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` at `address` with the admin token (what changes state needs one); every
        message of the answer, parsed."""
        token = (self.state / "credentials" / "admin.token").read_text().strip()
        header = ["-H", f"authorization: Bearer {token}"]
        args = ["-plaintext", *header, *(["-d", json.dumps(body)] if body is not None else [])]
        shown = [
            "-plaintext",
            '-H "authorization: Bearer $(gpuloom credentials token)"',
            *(["-d", "'...'"] if body is not None else []),
        ]
        say(f"$ grpcurl {' '.join(shown)} {address} {method}")
        result = subprocess.run(
            [self.grpcurl_path, *args, address, method],
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise DemoFailed(f"grpcurl {method} failed: {result.stderr.strip()}")
        messages, decoder, text = [], json.JSONDecoder(), result.stdout.strip()
        while text:
            message, end = decoder.raw_decode(text)
            messages.append(message)
            text = text[end:].lstrip()
        return messages

    def jobs(self, *states: str) -> list[dict[str, Any]]:
        body = {"states": list(states)} if states else {}
        result = subprocess.run(
            [
                self.grpcurl_path,
                "-plaintext",
                "-d",
                json.dumps(body),
                self.placement,
                "gpuloom.v1.Placement/ListJobs",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode != 0:
            raise DemoFailed(f"ListJobs failed: {result.stderr.strip()}")
        return json.loads(result.stdout or "{}").get("jobs", [])

    # -- the day ---------------------------------------------------------------------------

    def fleet(self) -> None:
        say("\n== 1. The fleet: two simulated A100s, GPU 0 in MIG mode (for batches)")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            listed = self.grpcurl_quiet(self.placement, "gpuloom.v1.Placement/ListGpus")
            if len(listed.get("gpus", [])) == 2:
                break
            if time.monotonic() > deadline:
                raise DemoFailed("the two GPUs did not register with placement")
            time.sleep(0.2)
        self.gpuloom("gpus")

    def grpcurl_quiet(self, address: str, method: str) -> dict[str, Any]:
        result = subprocess.run(
            [self.grpcurl_path, "-plaintext", address, method],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(result.stdout) if result.returncode == 0 and result.stdout else {}

    def profiles(self) -> None:
        say("\n== 2. A kernel profile into the profile store and back, with grpcurl")
        (put,) = self.grpcurl(
            self.store, "gpuloom.v1.ProfileStore/PutKernelProfile", KERNEL_PROFILE
        )
        meta = put.get("meta", {})
        key, model, version = meta.get("key"), meta.get("gpu_model"), meta.get("version")
        say(indent(f"stored {key} on {model}, version {version}"))
        (listed,) = self.grpcurl(
            self.store, "gpuloom.v1.ProfileStore/ListProfiles", {"kind": "PROFILE_KIND_KERNEL"}
        )
        summaries = listed.get("profiles", [])
        for summary in summaries:
            say(indent(json.dumps(summary)))
        wanted = KERNEL_PROFILE["profile"]["meta"]
        (got,) = self.grpcurl(self.store, "gpuloom.v1.ProfileStore/GetKernelProfile", wanted)
        kernels = got.get("kernels", [])
        say(indent(f"{len(kernels)} kernel(s): " + ", ".join(k["name"] for k in kernels)))
        if not summaries or [k["name"] for k in kernels] != ["sgemm"]:
            raise DemoFailed("the profile written is not the profile read back")

    def sharing(self) -> None:
        say(
            "\n== 3. An inference service (priority 1) and a batch job (priority 8) sharing"
            " GPU 1\n   through the shim (examples/serve.py; the fake driver where there is no GPU)"
        )
        common = ["--policy", "binpack", "--timeout", "60", "--"]
        # The service alone first (no shim, no dispatcher): the latency it keeps beside the batch.
        alone = subprocess.run(
            [sys.executable, "examples/serve.py"],
            env={**self.env, "SERVE_REQUESTS": "1000"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
        if alone.returncode != 0:
            raise DemoFailed(f"examples/serve.py alone failed: {alone.stdout}{alone.stderr}")
        alone_ms = _mean_ms(alone.stdout)
        say(f"    the service alone on the GPU: mean {alone_ms:g} ms")
        inference = [
            "run", "--kind", "inference", "--priority", "1", "--name", "infer-svc",
            "--sm", "50", "--quota", "60", "--quota-limit", "100", "--memory-gib", "8", *common,
            sys.executable, "examples/serve.py",
        ]  # fmt: skip
        batch = [
            "run", "--kind", "batch", "--priority", "8", "--name", "nightly-batch",
            "--sm", "30", "--quota", "30", "--memory-gib", "4", *common,
            sys.executable, "examples/serve.py",
        ]  # fmt: skip
        started = []
        for args, requests in ((inference, "3000"), (batch, "1500")):
            shown = shlex.join(args).replace(shlex.quote(sys.executable), "python")
            say(f"$ SERVE_REQUESTS={requests} gpuloom {shown} &")
            started.append(
                subprocess.Popen(
                    [GPULOOM, *args],
                    env={**self.env, "SERVE_REQUESTS": requests},
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            if args is inference:  # the service first: the batch job joins it
                self._wait_assigned({"infer-svc"})
        together = self._wait_assigned({"infer-svc", "nightly-batch"})
        gpus = {job["assignment"]["gpu"]["gpu_uuid"] for job in together}
        say(f"    both assigned at once, on {', '.join(sorted(gpus))}")
        self.gpuloom("jobs", "--state", "assigned")
        # The fleet at a glance, while both run (wide enough that no name is cut).
        frame = self.gpuloom("top", "--once", columns=200)
        missing = [job["spec"]["name"] for job in together if job["job_id"] not in frame]
        if missing:
            raise DemoFailed(f"gpuloom top --once does not show {missing}")
        outputs = []
        for process in started:
            out, _ = process.communicate(timeout=STEP_TIMEOUT_S)
            outputs.append(out)
            say(indent(out))
            if process.returncode != 0:
                raise DemoFailed(f"a gpuloom run exited {process.returncode}")
        if len(gpus) != 1:
            raise DemoFailed(f"the two jobs did not share a GPU: {sorted(gpus)}")
        shared_ms, batch_ms = _mean_ms(outputs[0]), _mean_ms(outputs[1])
        ratio = shared_ms / alone_ms
        say(
            f"    protected: the service (priority 1) ran at {ratio:.2f}x its latency alone"
            f" (mean {shared_ms:g} ms against {alone_ms:g} ms)\n    while the batch job"
            f" (priority 8) waited for its gaps (mean {batch_ms:g} ms a request), under the"
            " dispatcher's\n    default admission policy (composed: the FIKIT arbiter between"
            " priority levels, the quotas'\n    leases within a level; docs/dispatcher.md)"
        )
        # Loose: timings on a shared machine move by tens of percent; unprotected, a busy
        # neighbour's kernels queue ahead of each of the service's.
        if ratio > 2.0:
            raise DemoFailed(f"the service was not protected: {ratio:.2f}x its latency alone")
        self.gpuloom("jobs")

    def _wait_assigned(self, names: set[str]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            assigned = [j for j in self.jobs("JOB_STATE_ASSIGNED") if j["spec"]["name"] in names]
            if {j["spec"]["name"] for j in assigned} == names:
                return assigned
            if time.monotonic() > deadline:
                raise DemoFailed(f"not all of {sorted(names)} were assigned at once")
            time.sleep(0.05)

    def mig_batch(self) -> None:
        say(
            "\n== 4. A MIG batch on GPU 0: its dispatcher plans it (FAR) and reconfigures the GPU;"
            "\n   `gpuloom mig run`, the batch's runner, starts each task in the instance it gets"
        )
        batch = {
            "tasks": [
                {
                    "name": name,
                    "seconds_by_size": seconds,
                    "argv": ["sh", "-c", 'echo "$0 on $CUDA_VISIBLE_DEVICES"; sleep 0.3', name],
                }
                for name, seconds in MIG_TASKS
            ]
        }
        batch_file = self.state / "mig-batch.json"
        batch_file.write_text(json.dumps(batch, indent=2) + "\n")
        logs = self.state / "mig-logs"
        output = self.gpuloom(
            "mig", "run", "--dispatcher", self.mig_dispatcher, "--logs", str(logs), str(batch_file)
        )
        if "done:" not in output:
            raise DemoFailed("gpuloom mig run did not report the batch done")
        log = logs / "bfs.log"
        if log.exists():
            say(indent(f"{log.name}: {log.read_text().strip()}"))
        ran = {name for name, _ in MIG_TASKS if (logs / f"{name}.log").exists()}
        missing = sorted({name for name, _ in MIG_TASKS} - ran)
        if missing or "MIG-" not in (log.read_text() if log.exists() else ""):
            raise DemoFailed(f"MIG tasks that did not run in an instance: {', '.join(missing)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=ROOT / ".gpuloom" / "demo",
        help="directory for the plane's state and log, emptied first (default: .gpuloom/demo)",
    )
    options = parser.parse_args(argv)
    grpcurl = str(BIN / "grpcurl") if (BIN / "grpcurl").exists() else shutil.which("grpcurl")
    if grpcurl is None:
        say("scripts/demo: grpcurl not found (the test extra installs it into .venv)")
        return 1
    state = options.state.resolve()
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    plane = None
    failure = None
    try:
        plane = start_plane(state)
        day = Day(plane, state, grpcurl)
        say(f"(the CLI below runs with GPULOOM_PLACEMENT_ADDRESS={day.placement})")
        day.fleet()
        day.profiles()
        day.sharing()
        day.mig_batch()
    except (DemoFailed, subprocess.TimeoutExpired) as error:
        failure = str(error)
    finally:
        code = 0 if plane is None else plane.stop()
    if code is None:
        failure = failure or "gpuloom up did not stop within 30 s of SIGTERM"
    elif failure is None and code != 0:
        failure = f"gpuloom up exited {code} when stopped"
    say("\n== Where to look")
    say(f"  the plane's log:        {state / 'plane.log'}")
    say(f"  MIG task output:        {state}/mig-logs/")
    say("  more: docs/jobs.md (gpuloom run, jobs, gpus), docs/mig.md (gpuloom mig run),")
    say("        docs/profile-store.md, docs/deploy.md (compose and Kubernetes)")
    if failure is not None:
        say(f"\ndemo failed: {failure}")
        return 1
    say("\ndemo done: every step did what it showed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
