"""Protobuf <-> domain for the profiler."""

from __future__ import annotations

import numpy as np

from gpuloom.convert.times import timestamp
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.profiles import Dim3
from gpuloom.services.profiler.domain import (
    KernelName,
    MeasurementBatch,
    Session,
    SessionState,
)
from gpuloom.v1 import profiler_pb2 as pb

_STATE_TO_PB = {
    SessionState.OPEN: pb.SESSION_STATE_OPEN,
    SessionState.COMPLETE: pb.SESSION_STATE_COMPLETE,
    SessionState.CANCELLED: pb.SESSION_STATE_CANCELLED,
    SessionState.FAILED: pb.SESSION_STATE_FAILED,
}
STATE_FROM_PB = {value: key for key, value in _STATE_TO_PB.items()}


def session_to_pb(session: Session) -> pb.Session:
    message = pb.Session(
        session_id=session.session_id,
        task_key=session.task_key,
        gpu_model=session.gpu_model,
        runs=session.runs,
        runs_received=len(session.runs_completed),
        records=session.records,
        state=_STATE_TO_PB[session.state],
        error=session.error,
        opened_at=timestamp(session.opened_at_unix_s),
        closed_at=timestamp(session.closed_at_unix_s),
        kernels=session.kernels,
    )
    if session.predictor is not None:
        message.predictor.chosen = session.predictor.chosen
        message.predictor.mae_ns.update(session.predictor.mae_ns)
    return message


def batch_from_pb(upload: pb.MeasurementUpload) -> MeasurementBatch:
    return MeasurementBatch(
        session_id=upload.session_id,
        kernels=tuple(
            KernelName(
                k.kernel_id,
                k.name,
                Dim3(k.grid.x, k.grid.y, k.grid.z),
                Dim3(k.block.x, k.block.y, k.block.z),
            )
            for k in upload.kernels
        ),
        kernel_ids=_column("kernel_ids", upload.kernel_ids, _U64),
        start_ns=_column("start_ns", upload.start_ns, _U64),
        end_ns=_column("end_ns", upload.end_ns, _U64),
        run_index=_column("run_index", upload.run_index, _U32),
        completed_runs=tuple(upload.completed_runs),
    )


_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")


def _column(field: str, data: bytes, dtype: np.dtype) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise InvalidArgument(
            field, f"{len(data)} bytes is not a whole number of {dtype.itemsize}-byte values"
        )
    return np.frombuffer(data, dtype=dtype)


def pack(values: object, dtype: str) -> bytes:
    """A column as MeasurementUpload carries it (for clients: pack(ids, "<u8"))."""
    return np.ascontiguousarray(values, dtype=np.dtype(dtype)).tobytes()
