"""The shim's interposition without a dispatcher: every launch path lands in a hook with the
right name, grid, block and kernel ID, and reaches the matching real (fake) function; cudart-
style resolution through cuGetProcAddress lands in the hooks too; a socket or token the shim
cannot register with is reported and refuses the process."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gpuloom.policies.profiling.kernels import GRAPH_NODE_KERNEL, graph_kernel_id, graph_name
from tests.shim.conftest import (
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    Runner,
    kernel_id,
    launch,
)

MODULE = "k_small_100us,k_big:200"
LAUNCHES = [
    *launch("kernel", "k_small_100us", 2, (4, 1, 1), (128, 1, 1)),
    *launch("ex", "k_big", 1, (1, 2, 3), (4, 5, 6)),
    *launch("coop", "k_big", 1, (7, 1, 1), (32, 2, 1)),
]
EXPECTED = [  # (entry point, name, grid, block) in launch order
    ("cuLaunchKernel", "k_small_100us", (4, 1, 1), (128, 1, 1)),
    ("cuLaunchKernel", "k_small_100us", (4, 1, 1), (128, 1, 1)),
    ("cuLaunchKernelEx", "k_big", (1, 2, 3), (4, 5, 6)),
    ("cuLaunchCooperativeKernel", "k_big", (7, 1, 1), (32, 2, 1)),
]


def _launches(trace: list[str]) -> list[tuple[str, int, str, tuple, tuple]]:
    out = []
    for line in trace:
        parts = line.split()
        if parts[0] == "launch" and not parts[3].startswith("<graph"):
            dims = tuple(int(p) for p in parts[4:10])
            out.append((parts[1], int(parts[2], 16), parts[3], dims[:3], dims[3:]))
    return out


def _fake_launches(trace: list[str]) -> list[tuple[str, str, tuple, tuple]]:
    out = []
    for line in trace:
        parts = line.split()
        if parts[1].startswith(("cuLaunch",)) and "captured" not in parts:
            dims = tuple(int(p) for p in parts[3:9])
            out.append((parts[1], parts[2], dims[:3], dims[3:]))
    return out


@pytest.mark.parametrize(
    ("flags", "suffix"),
    [([], ""), (["--ptds"], "_ptsz"), (["--proc"], ""), (["--proc", "--ptds"], "_ptsz")],
    ids=["direct", "direct-ptsz", "cudart-style", "cudart-style-ptsz"],
)
def test_every_launch_path_is_seen_with_name_dims_and_id(
    run: Runner, flags: list[str], suffix: str
) -> None:
    result = run(*flags, "module", MODULE, *LAUNCHES, "sync")
    assert result.returncode == 0, result.stderr
    seen = _launches(result.shim_trace)
    assert seen == [
        (entry + suffix, kernel_id(name, grid, block), name, grid, block)
        for entry, name, grid, block in EXPECTED
    ]
    # ... and each reached the same flavour of the real function: _ptsz stays _ptsz.
    assert _fake_launches(result.fake_trace) == [
        (entry + suffix, name, grid, block) for entry, name, grid, block in EXPECTED
    ]
    if "--proc" in flags:
        # cudart asks for cuGetProcAddress through cuGetProcAddress_v2: it gets the hook.
        assert "resolve cuGetProcAddress same" in result.stdout
        assert "dlsym cuGetProcAddress_v2 hooked" in result.shim_trace
        assert "procaddr cuGetProcAddress hooked" in result.shim_trace


def test_kernel_ids_are_stable_and_distinguish_dimensions() -> None:
    a = kernel_id("k", (1, 1, 1), (32, 1, 1))
    assert a == kernel_id("k", (1, 1, 1), (32, 1, 1))
    assert a != kernel_id("k", (1, 1, 1), (1, 32, 1))
    assert a != kernel_id("j", (1, 1, 1), (32, 1, 1))


def _graph_launches(trace: list[str], suffix: str = "") -> list[tuple[int, str]]:
    """(ID, name) of each graph launch the shim traced."""
    return [
        (int(parts[2], 16), parts[3])
        for parts in (line.split() for line in trace)
        if parts[:2] == ["launch", f"cuGraphLaunch{suffix}"]
    ]


def _graph_of(name: str, count: int) -> tuple[int, str]:
    """What the shim names a graph of `count` 1x1 launches of `name`: its ID and name."""
    node = (GRAPH_NODE_KERNEL, kernel_id(name, (1, 1, 1), (1, 1, 1)))
    graph = graph_name([node] * count)
    return graph_kernel_id(graph), graph


@pytest.mark.parametrize(
    ("flags", "suffix"),
    [([], ""), (["--ptds"], "_ptsz"), (["--proc"], "")],
    ids=["legacy", "ptsz", "cudart-style"],
)
def test_graph_launch_is_one_unit_named_by_its_kernels_and_captures_are_not_blocked(
    run: Runner, flags: list[str], suffix: str
) -> None:
    result = run(*flags, "module", "k_g_50us", "stream", "capture", "k_g_50us", "3", "ssync")
    assert result.returncode == 0, result.stderr
    assert "capture rc=0" in result.stdout and "graph rc=0" in result.stdout
    # Its ID is its structure's, as the profile and admission compute it.
    assert _graph_launches(result.shim_trace, suffix) == [_graph_of("k_g_50us", 3)]
    assert f"fake cuGraphLaunch{suffix} 3" in result.fake_trace
    # The engine ran the three captured kernels once, when the graph was launched.
    assert [name for _, name, _, _ in run.engine_runs()] == ["k_g_50us"] * 3


def test_a_graph_has_one_id_across_processes_and_another_graph_another(run: Runner) -> None:
    module = ["module", "k_a_10us,k_b_10us", "stream"]
    first = run(*module, "capture", "k_a_10us", "2", "ssync")
    again = run(*module, "capture", "k_a_10us", "2", "ssync")
    longer = run(*module, "capture", "k_a_10us", "3", "ssync")
    other = run(*module, "capture", "k_b_10us", "2", "ssync")
    ids = [_graph_launches(r.shim_trace)[0][0] for r in (first, again, longer, other)]
    assert ids[0] == ids[1] and len(set(ids[1:])) == 3


def test_a_graph_whose_kernels_change_loses_its_id_and_an_update_gives_one_back(
    run: Runner,
) -> None:
    result = run(
        "module", "k_a_10us,k_b_10us", "stream", "capture", "k_a_10us", "2", "ssync",
        "gsetparams", "k_b_10us", "glaunch", "ssync",  # the executable now runs k_b, k_a
        "gupdate", "glaunch", "ssync",  # back to its graph's kernels
        "gdestroy",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "gsetparams rc=0" in result.stdout and "gupdate rc=0" in result.stdout
    graph = _graph_of("k_a_10us", 2)
    # Changed in place, it is a graph of unknown length (ID 0), never taken for the old one.
    assert _graph_launches(result.shim_trace) == [graph, (0, "<graph>"), graph]
    assert [name for _, name, _, _ in run.engine_runs()] == [
        "k_a_10us", "k_a_10us", "k_b_10us", "k_a_10us", "k_a_10us", "k_a_10us",
    ]  # fmt: skip


def test_names_without_cuFuncGetName_come_from_the_module_and_library_tables(
    run: Runner,
) -> None:
    """An older driver (no cuFuncGetName/cuKernelGetName/cuLaunchKernelEx): names come from the
    cuModuleGetFunction / cuLibraryGetKernel / cuKernelGetFunction hooks; a missing real symbol
    answers CUDA_ERROR_NOT_FOUND instead of calling NULL."""
    result = run(
        "module",
        "k_mod_10us",
        "library",
        "k_lib_10us",
        *launch("kernel", "k_mod_10us", 1),
        *launch("kernel", "k_lib_10us", 1, (2, 1, 1)),
        *launch("ex", "k_mod_10us", 1),
        "sync",
        fake="fake_min",
    )
    assert result.returncode == 3  # the cuLaunchKernelEx launch failed, as it should
    assert f"launch ex k_mod_10us rc={CUDA_ERROR_NOT_FOUND}" in result.stdout
    names = [(entry, name) for entry, _, name, _, _ in _launches(result.shim_trace)]
    assert names[:2] == [("cuLaunchKernel", "k_mod_10us"), ("cuLaunchKernel", "k_lib_10us")]


def test_module_unload_evicts_names(run: Runner) -> None:
    result = run(
        "module",
        "k_gone_10us",
        *launch("kernel", "k_gone_10us", 1),
        "sync",
        "unload",
        *launch("kernel", "k_gone_10us", 1),
        "sync",
        fake="fake_min",
    )
    assert result.returncode == 0, result.stderr
    names = [name for _, _, name, _, _ in _launches(result.shim_trace)]
    assert names == ["k_gone_10us", "?"]


@pytest.mark.parametrize(
    ("load", "unload"), [("module", "unload"), ("library", "unloadlib")], ids=["module", "library"]
)
@pytest.mark.parametrize("fake", ["fake", "fake_min"])
def test_a_function_address_reused_after_an_unload_gets_the_new_kernels_id(
    run: Runner, load: str, unload: str, fake: str
) -> None:
    """The driver may give a later module the function addresses of an unloaded one; the
    shim's per-thread kernel-ID cache (keyed by address) must then hash the new name."""
    result = run(
        load,
        "k_first_10us",
        *launch("kernel", "k_first_10us", 2),
        "sync",
        unload,
        load,
        "k_second_20us",
        *launch("kernel", "k_second_20us", 2),
        "sync",
        fake=fake,
    )
    assert result.returncode == 0, result.stderr
    handles = [line.split()[-1] for line in result.stdout.splitlines() if "handle=" in line]
    assert len(handles) == 2 and handles[0] == handles[1], result.stdout  # the address reused
    seen = [(kid, name) for _, kid, name, _, _ in _launches(result.shim_trace)]
    dims = ((1, 1, 1), (1, 1, 1))
    assert (
        seen
        == [(kernel_id("k_first_10us", *dims), "k_first_10us")] * 2
        + [(kernel_id("k_second_20us", *dims), "k_second_20us")] * 2
    )


async def test_the_fake_engine_charges_a_context_switch_between_processes(run: Runner) -> None:
    """GPULOOM_FAKE_CUDA_SWITCH_US: a kernel after another process's starts that much later
    (how tests make packed jobs interfere); one after its own process's does not."""
    switch_us = 3000
    env = {"GPULOOM_FAKE_CUDA_SWITCH_US": str(switch_us)}
    args = ("module", "k_sw_1000us", "loop", "0.3", "k_sw_1000us", "1")
    results = await asyncio.gather(*(run.run_async(*args, env=env) for _ in range(2)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    runs = sorted(run.engine_runs(), key=lambda r: r[2])
    assert len({pid for pid, *_ in runs}) == 2
    changes = [b[2] - a[3] for a, b in itertools.pairwise(runs) if a[0] != b[0]]
    assert changes and min(changes) >= switch_us * 1000 - 50_000, changes


def test_events_measure_kernel_time_on_the_fake(run: Runner) -> None:
    result = run("module", "k_t_2000us", "stream", "timed", "k_t_2000us", "5")
    assert result.returncode == 0, result.stderr
    elapsed = float(result.value("timed", "ms"))
    # What the engine really took (a loaded machine oversleeps the fake's kernels): the events
    # measure that, from the first kernel's start to the last one's end.
    runs = sorted(run.engine_runs(), key=lambda r: r[2])
    assert len(runs) == 5
    truth_ms = (runs[-1][3] - runs[0][2]) / 1e6
    assert elapsed >= 10.0 and elapsed == pytest.approx(truth_ms, abs=1.0), (elapsed, truth_ms)


def test_no_configuration_passes_through_silently(run: Runner) -> None:
    result = run(
        "module",
        "k_p_10us",
        *launch("kernel", "k_p_10us", 3),
        "alloc",
        "alloc",
        str(60 << 30),
        "sync",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "config passthrough" in result.shim_trace
    assert f"alloc alloc {60 << 30} rc=0" in result.stdout  # no cap without a dispatcher


TOKEN = "a" * 40


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"GPULOOM_ASSIGNMENT_TOKEN": "short"}, "GPULOOM_ASSIGNMENT_TOKEN is not"),
        ({"GPULOOM_ASSIGNMENT_TOKEN": ""}, "GPULOOM_DISPATCHER_SOCKET is set but"),
        ({"GPULOOM_DISPATCHER_SOCKET": ""}, "GPULOOM_ASSIGNMENT_TOKEN is set but"),
        ({"GPULOOM_DISPATCHER_SOCKET": "/tmp/" + "x" * 120}, "longer than a Unix socket"),
    ],
)
@pytest.mark.parametrize("policy", ["open", "closed"])
def test_a_socket_or_token_it_cannot_register_with_refuses_the_process(
    run: Runner, env: dict[str, str], complaint: str, policy: str
) -> None:
    """Set but unusable: named once, and the process is refused (whatever the loss policy):
    its launches fail, it allocates nothing. Never passed through uncapped."""
    environment = {
        "GPULOOM_DISPATCHER_SOCKET": "/nonexistent/socket",
        "GPULOOM_ASSIGNMENT_TOKEN": TOKEN,
        "GPULOOM_ON_DISPATCHER_LOSS": policy,
        **env,
    }
    result = run(
        "module",
        "k_c_10us",
        *launch("kernel", "k_c_10us", 2),
        "alloc",
        "alloc",
        "4096",
        env=environment,
    )
    assert result.returncode == 3, result.stderr
    complaints = [line for line in result.stderr.splitlines() if "bad configuration" in line]
    assert len(complaints) == 1 and complaint in complaints[0], result.stderr
    assert "cannot register with the dispatcher" in result.stderr
    assert "config bad" in result.shim_trace and "refused" in result.shim_trace
    assert f"launch kernel k_c_10us rc={CUDA_ERROR_NOT_PERMITTED}" in result.stdout
    assert f"alloc alloc 4096 rc={CUDA_ERROR_OUT_OF_MEMORY}" in result.stdout
    assert not any(line.startswith("fake cuLaunchKernel") for line in result.fake_trace)


def test_unreachable_dispatcher_fails_open_without_waiting(run: Runner) -> None:
    environment = {
        "GPULOOM_DISPATCHER_SOCKET": "/nonexistent/socket",
        "GPULOOM_ASSIGNMENT_TOKEN": TOKEN,
        "GPULOOM_SHIM_WAIT_MS": "200",
    }
    result = run("module", "k_u_10us", "loop", "0.3", "k_u_10us", "1", env=environment)
    assert result.returncode == 0, result.stderr
    assert "UNTHROTTLED" in result.stderr
    assert float(result.value("loop", "max_launch_ms")) < 100
    assert int(result.value("loop", "launches")) > 10


def test_the_fake_driver_slows_kernels_below_their_sm_need(run: Runner) -> None:
    """The fake's MPS timing model: a kernel that can use 50% of the SMs takes its duration
    at a share of 50% or more, and need/share times longer below; one that needs 10% never
    slows down in this range. Kernel time is monotonic (non-increasing) in the share."""
    durations: dict[int, dict[str, float]] = {}
    for share in (10, 25, 50, 100):
        result = run(
            "module",
            "k_half:20000:50,k_small:5000:10",
            *launch("kernel", "k_half", 1),
            *launch("kernel", "k_small", 1),
            "sync",
            env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)},
            preload=False,
        )
        assert result.returncode == 0, result.stderr
        runs = [r for r in run.engine_runs() if r[0] == int(result.value("init", "pid"))]
        durations[share] = {name: (end - start) / 1e6 for _, name, start, end in runs}
    # A kernel never ends early; the host's scheduler may wake it late (a loaded machine).
    for share, expected in ((10, 100.0), (25, 40.0), (50, 20.0), (100, 20.0)):
        assert expected <= durations[share]["k_half"] < expected * 1.25 + 5, durations
        assert 5.0 <= durations[share]["k_small"] < 5.0 * 1.25 + 5, durations
    half = {share: times["k_half"] for share, times in durations.items()}
    assert half[10] > half[25] > half[50] and half[25] > half[100]
