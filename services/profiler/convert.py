"""Protobuf <-> domain for the profiler."""

from __future__ import annotations

import numpy as np

from gpuloom.convert.profiler import session_to_pb as view_to_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.profiler import SessionView
from gpuloom.domain.profiles import Dim3
from gpuloom.services.profiler.domain import KernelName, MeasurementBatch, Session
from gpuloom.v1 import profiler_pb2 as pb


def session_to_pb(session: Session) -> pb.Session:
    """A session as its clients see it, in the one converter of the message."""
    predictor = session.predictor
    return view_to_pb(
        SessionView(
            session_id=session.session_id,
            task_key=session.task_key,
            gpu_model=session.gpu_model,
            runs=session.runs,
            runs_received=len(session.runs_completed),
            records=session.records,
            state=session.state,
            opened_at=session.opened_at_unix_s,
            closed_at=session.closed_at_unix_s,
            error=session.error,
            predictor="" if predictor is None else predictor.chosen,
            predictor_mae_ns={} if predictor is None else dict(predictor.mae_ns),
            kernels=session.kernels,
        )
    )


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
