"""A profiler session to and from its protobuf message, and its JSON (the protos' JSON
mapping), for the clients."""

from __future__ import annotations

from typing import Any

from gpuloom.convert.json_mapping import message_json
from gpuloom.convert.times import timestamp, unix_s
from gpuloom.domain.profiler import SessionState, SessionView
from gpuloom.v1 import profiler_pb2 as pb

STATE_TO_PB = {
    state: pb.SessionState.Value("SESSION_STATE_" + state.name) for state in SessionState
}
STATE_FROM_PB = {code: state for state, code in STATE_TO_PB.items()}


def session_from_pb(msg: pb.Session) -> SessionView:
    return SessionView(
        session_id=msg.session_id,
        task_key=msg.task_key,
        gpu_model=msg.gpu_model,
        runs=msg.runs,
        runs_received=msg.runs_received,
        records=msg.records,
        state=STATE_FROM_PB.get(msg.state, SessionState.OPEN),
        opened_at=unix_s(msg, "opened_at"),
        closed_at=unix_s(msg, "closed_at"),
        error=msg.error,
        predictor=msg.predictor.chosen,
        predictor_mae_ns=dict(msg.predictor.mae_ns),
        kernels=msg.kernels,
    )


def session_to_pb(session: SessionView) -> pb.Session:
    msg = pb.Session(
        session_id=session.session_id,
        task_key=session.task_key,
        gpu_model=session.gpu_model,
        runs=session.runs,
        runs_received=session.runs_received,
        records=session.records,
        state=STATE_TO_PB[session.state],
        error=session.error,
        opened_at=timestamp(session.opened_at),
        closed_at=timestamp(session.closed_at),
        kernels=session.kernels,
    )
    if session.predictor or session.predictor_mae_ns:
        msg.predictor.chosen = session.predictor
        msg.predictor.mae_ns.update(session.predictor_mae_ns)
    return msg


def session_json(session: SessionView) -> dict[str, Any]:
    return message_json(session_to_pb(session))
