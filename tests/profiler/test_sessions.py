"""Measurement sessions over real gRPC: opening, listing, cancelling, and what bad uploads get."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gpuloom.services.profiler.convert import pack
from gpuloom.v1 import common_pb2, profiler_pb2, profiler_pb2_grpc
from tests.rpc import refusal


async def _open(stub: profiler_pb2_grpc.ProfilerStub, key: str = "resnet50", runs: int = 10):
    return await stub.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key=key, gpu_model="A100-80GB", runs=runs)
    )


async def test_sessions_open_list_and_cancel(profiler: profiler_pb2_grpc.ProfilerStub) -> None:
    default = await profiler.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key="bert", gpu_model="A100-80GB")
    )
    assert default.runs == 20 and default.state == profiler_pb2.SESSION_STATE_OPEN
    other = await _open(profiler, "resnet50", 10)
    code, details = await refusal(_open(profiler, "resnet50", 30))
    assert code == grpc.StatusCode.ALREADY_EXISTS and other.session_id in details

    listed = await profiler.ListSessions(
        profiler_pb2.ListSessionsRequest(state=profiler_pb2.SESSION_STATE_OPEN)
    )
    assert {s.task_key for s in listed.sessions} == {"bert", "resnet50"}
    cancelled = await profiler.CancelSession(
        profiler_pb2.CancelSessionRequest(session_id=other.session_id)
    )
    assert cancelled.state == profiler_pb2.SESSION_STATE_CANCELLED
    code, _ = await refusal(
        profiler.CancelSession(profiler_pb2.CancelSessionRequest(session_id=other.session_id))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    again = await _open(profiler, "resnet50", 10)  # a cancelled session frees the task
    assert again.session_id != other.session_id
    code, _ = await refusal(profiler.GetSession(profiler_pb2.GetSessionRequest(session_id="x")))
    assert code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("runs", "key", "field"), [(9, "k", "runs"), (1001, "k", "runs"), (10, "", "task_key")]
)
async def test_bad_sessions_are_refused(
    profiler: profiler_pb2_grpc.ProfilerStub, runs: int, key: str, field: str
) -> None:
    code, details = await refusal(_open(profiler, key, runs))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field)


def _upload(session_id: str, **columns: object) -> profiler_pb2.MeasurementUpload:
    upload = profiler_pb2.MeasurementUpload(
        session_id=session_id,
        kernels=[
            profiler_pb2.KernelInfo(
                kernel_id=7,
                name="sgemm",
                grid=common_pb2.Dim3(x=1, y=1, z=1),
                block=common_pb2.Dim3(x=1, y=1, z=1),
            )
        ],
        kernel_ids=pack([7, 7], "<u8"),
        start_ns=pack([100, 300], "<u8"),
        end_ns=pack([200, 400], "<u8"),
        run_index=pack([0, 0], "<u4"),
    )
    for name, value in columns.items():
        if name == "completed_runs":
            upload.completed_runs.extend(value)  # type: ignore[arg-type]
        elif isinstance(value, bytes):
            setattr(upload, name, value)
        else:
            setattr(upload, name, pack(value, "<u4" if name == "run_index" else "<u8"))
    return upload


async def _upload_all(stub: profiler_pb2_grpc.ProfilerStub, *uploads: object):
    async def stream():  # type: ignore[no-untyped-def]
        for upload in uploads:
            yield upload

    return await stub.UploadMeasurements(stream())


@pytest.mark.parametrize(
    ("columns", "field"),
    [
        ({"end_ns": [50, 400]}, "end_ns[0]"),
        ({"run_index": [0, 10]}, "run_index[1]"),
        ({"start_ns": [1]}, "kernel_ids"),
        ({"kernel_ids": [7, 8]}, "kernels"),
        ({"completed_runs": [12]}, "completed_runs[0]"),
        ({"start_ns": b"\x01\x02\x03"}, "start_ns"),
    ],
)
async def test_bad_uploads_are_refused_whole(
    profiler: profiler_pb2_grpc.ProfilerStub, columns: dict, field: str
) -> None:
    session = await _open(profiler)
    good = _upload(session.session_id)
    code, details = await refusal(
        _upload_all(profiler, good, _upload(session.session_id, **columns))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field)
    after = await profiler.GetSession(profiler_pb2.GetSessionRequest(session_id=session.session_id))
    assert after.records == 2  # the good batch before it stays, the bad one left no trace
    assert after.state == profiler_pb2.SESSION_STATE_OPEN


async def test_uploads_for_unknown_or_closed_sessions(
    profiler: profiler_pb2_grpc.ProfilerStub,
) -> None:
    code, details = await refusal(_upload_all(profiler, _upload("nope")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("session_id")
    session = await _open(profiler)
    await profiler.CancelSession(profiler_pb2.CancelSessionRequest(session_id=session.session_id))
    code, _ = await refusal(_upload_all(profiler, _upload(session.session_id)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_broken_stream_keeps_what_arrived_and_the_session_continues(
    profiler: profiler_pb2_grpc.ProfilerStub,
) -> None:
    session = await _open(profiler)
    sent = asyncio.Event()

    async def stream_then_hang():  # type: ignore[no-untyped-def]
        yield _upload(session.session_id)
        sent.set()
        await asyncio.sleep(3600)  # the uploader dies here, mid-stream

    call = profiler.UploadMeasurements(stream_then_hang())
    await sent.wait()
    for _ in range(100):  # the first batch is applied while the stream is still open
        state = await profiler.GetSession(
            profiler_pb2.GetSessionRequest(session_id=session.session_id)
        )
        if state.records == 2:
            break
        await asyncio.sleep(0.02)
    call.cancel()
    after = await profiler.GetSession(profiler_pb2.GetSessionRequest(session_id=session.session_id))
    assert after.records == 2 and after.state == profiler_pb2.SESSION_STATE_OPEN
    # A new stream carries on where the broken one stopped.
    more = _upload(session.session_id, run_index=[1, 1])
    summary = await _upload_all(profiler, more)
    assert summary.records == 2
    final = await profiler.GetSession(profiler_pb2.GetSessionRequest(session_id=session.session_id))
    assert final.records == 4
