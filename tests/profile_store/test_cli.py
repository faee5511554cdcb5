"""`gpuloom profile list|show|put|delete` against a running store, and the answers to bad
input."""

from __future__ import annotations

import asyncio
import json
import re

from click.testing import CliRunner, Result

from gpuloom.clients.cli import cli
from gpuloom.domain import profiles as d
from gpuloom.services.profile_store.app import ProfileStoreApp
from tests.conftest import free_port
from tests.profile_store import samples


async def invoke(*args: str) -> Result:
    # The store serves on this event loop, so the blocking CLI runs in a worker thread.
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args))


async def test_list_and_show_print_readable_tables(store_app: ProfileStoreApp) -> None:
    store = f"--store=127.0.0.1:{store_app.port}"
    await store_app.store.put(samples.kernel_profile())
    await store_app.store.put(samples.throughput_profile())

    listed = await invoke("profile", "list", store)
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["KIND", "KEY", "GPU", "MODEL", "VERSION", "ENTRIES", "UPDATED"]
    assert any(line.startswith("kernel") and "resnet50-train" in line for line in lines[2:])
    assert any(line.startswith("throughput") and "resnet-infer" in line for line in lines[2:])

    shown = await invoke("profile", "show", "kernel", "resnet50-train", "A100", store)
    assert shown.exit_code == 0, shown.output
    assert "measured runs: 20" in shown.output
    assert "128x1x1" not in shown.output and "130x2x1" in shown.output  # the third kernel
    header = shown.output.splitlines()[2].split()
    assert header[-2:] == ["SMs", "BOUND"]
    assert [line.split()[-2:] for line in shown.output.splitlines()[4:]] == [
        ["16", "compute"],
        ["17", "memory"],
        ["18", "unknown"],
    ]
    # Kernel IDs as gRPC's JSON writes them (a uint64 in decimal), not in hex.
    kernel_json = await invoke(
        "profile", "show", "kernel", "resnet50-train", "A100", store, "--json"
    )
    ids = [k["kernel_id"] for k in json.loads(kernel_json.output)["kernels"]]
    assert ids[2] == str(0xFEED000000000002)
    table_ids = [line.split()[0] for line in shown.output.splitlines()[4:]]
    assert table_ids == ids and "feed000000000002" not in shown.output

    as_json = await invoke("profile", "show", "throughput", "resnet-infer", "A100", store, "--json")
    document = json.loads(as_json.output)  # the protos' JSON mapping, as grpcurl shows it
    assert document["meta"]["kind"] == "PROFILE_KIND_THROUGHPUT"
    assert document["meta"]["key"] == "resnet-infer" and len(document["points"]) == 3
    assert document["meta"]["updated_at"].endswith("Z")

    summaries = await invoke("profile", "list", store, "--json")
    kinds = {json.loads(line)["meta"]["kind"] for line in summaries.stdout.splitlines()}
    assert kinds == {"PROFILE_KIND_KERNEL", "PROFILE_KIND_THROUGHPUT"}

    filtered = await invoke("profile", "list", store, "--kind", "mig")
    assert filtered.output.strip() == "no profiles match"


async def test_cli_errors_are_clear(store_app: ProfileStoreApp) -> None:
    store = f"--store=127.0.0.1:{store_app.port}"
    missing = await invoke("profile", "show", "job", "nobody", "A100", store)
    assert missing.exit_code == 1
    assert "no job profile 'nobody' on 'A100'" in missing.output

    bad_kind = await invoke("profile", "show", "gizmo", "x", "A100", store)
    assert bad_kind.exit_code == 2 and "gizmo" in bad_kind.output

    dead = await invoke("profile", "list", f"--store=127.0.0.1:{free_port()}")
    assert dead.exit_code == 1 and "failed to connect" in dead.output


async def test_delete_removes_a_profile_and_checks_its_version(store_app: ProfileStoreApp) -> None:
    store = f"--store=127.0.0.1:{store_app.port}"
    stored = await store_app.store.put(samples.kernel_profile())
    stale = await invoke(
        "profile", "delete", "kernel", "resnet50-train", "A100", store,
        "--expected-version", str(stored.version + 1),
    )  # fmt: skip
    assert stale.exit_code == 1 and "stale version" in stale.stderr
    deleted = await invoke("profile", "delete", "kernel", "resnet50-train", "A100", store)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout == (
        f"deleted kernel profile 'resnet50-train' on 'A100' (version {stored.version + 1})\n"
    )
    gone = await invoke("profile", "show", "kernel", "resnet50-train", "A100", store)
    assert gone.exit_code == 1
    again = await invoke("profile", "delete", "kernel", "resnet50-train", "A100", store)
    assert again.exit_code == 1 and "resnet50-train" in again.stderr


async def test_put_stores_what_show_json_prints(store_app: ProfileStoreApp, tmp_path) -> None:
    store = f"--store=127.0.0.1:{store_app.port}"
    mig = tmp_path / "lud.json"
    mig.write_text(
        json.dumps(
            {
                "meta": {"key": "lud", "gpu_model": "A100-80GB"},
                "times": [{"slices": 1, "exec_time_s": 40}, {"slices": 7, "exec_time_s": 9}],
            }
        )
    )
    put = await invoke("profile", "put", "mig", str(mig), store)
    assert put.exit_code == 0, put.output
    # The store runs in this process: its first call's log line may land in the same stdout.
    printed = [line for line in put.stdout.splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert printed == ["stored mig profile 'lud' on 'A100-80GB' (version 1)"]
    stored = await store_app.store.get(d.ProfileId(d.ProfileKind.MIG, "lud", "A100-80GB"))
    assert [(t.slices, t.exec_time_s) for t in stored.times] == [(1, 40.0), (7, 9.0)]

    # A round trip: what show --json prints, put takes back (a new version).
    shown = await invoke("profile", "show", "mig", "lud", "A100-80GB", store, "--json")
    mig.write_text(shown.stdout)
    again = await invoke("profile", "put", "mig", str(mig), store, "--expected-version", "1")
    assert again.exit_code == 0 and "(version 2)" in again.stdout
    stale = await invoke("profile", "put", "mig", str(mig), store, "--expected-version", "1")
    assert stale.exit_code == 1 and "stale version" in stale.stderr

    for content, problem in (
        ("{not json", "not a mig profile"),
        ('{"meta": {"kind": "PROFILE_KIND_JOB", "key": "lud"}}', "not a mig profile"),
        ('{"colour": 1}', "colour"),
    ):
        mig.write_text(content)
        bad = await invoke("profile", "put", "mig", str(mig), store)
        assert bad.exit_code == 2, bad.output
        (line,) = bad.stderr.splitlines()
        assert line.startswith("Error: ") and str(mig) in line and problem in line
    refused = tmp_path / "empty.json"
    refused.write_text('{"meta": {"key": "lud", "gpu_model": "A100-80GB"}, "times": []}')
    no_times = await invoke("profile", "put", "mig", str(refused), store)
    assert no_times.exit_code == 1 and "times" in no_times.stderr


async def test_kernel_ids_as_printed_are_taken_back(store_app: ProfileStoreApp, tmp_path) -> None:
    """The kernel IDs the table shows are the JSON's (decimal), and `put` reads that JSON: the
    same kernels, IDs above 2^63 included, come back."""
    store = f"--store=127.0.0.1:{store_app.port}"
    original = await store_app.store.put(samples.kernel_profile())
    shown = await invoke("profile", "show", "kernel", "resnet50-train", "A100", store, "--json")
    document = json.loads(shown.stdout)
    assert all(isinstance(k["kernel_id"], str) for k in document["kernels"])
    document["measured_runs"] = 21  # a change, so that the new version is visibly this file
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(document))
    put = await invoke("profile", "put", "kernel", str(path), store)
    assert put.exit_code == 0, put.output
    stored = await store_app.store.get(d.ProfileId(d.ProfileKind.KERNEL, "resnet50-train", "A100"))
    assert stored.measured_runs == 21
    assert [k.kernel_id for k in stored.kernels] == [k.kernel_id for k in original.kernels]
    assert max(k.kernel_id for k in stored.kernels) >= 2**63
    # The launch shape's SMs and the bound class travel as the JSON mapping writes them.
    assert [(k["sm_usage"], k["bound"]) for k in document["kernels"]] == [
        (16, "KERNEL_BOUND_COMPUTE"),
        (17, "KERNEL_BOUND_MEMORY"),
        (18, "KERNEL_BOUND_UNKNOWN"),
    ]
    assert [(k.sm_usage, k.bound) for k in stored.kernels] == [
        (k.sm_usage, k.bound) for k in original.kernels
    ]
    document["kernels"][0]["bound"] = 7  # a number the JSON mapping takes, no class we know
    path.write_text(json.dumps(document))
    refused = await invoke("profile", "put", "kernel", str(path), store)
    assert refused.exit_code == 2
    assert "profile.kernels[0].bound" in refused.stderr and "unknown" in refused.stderr
