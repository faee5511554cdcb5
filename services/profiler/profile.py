"""From a finished session's records to the kernel profile and its gap predictor."""

from __future__ import annotations

import json

import numpy as np

from gpuloom.domain.gpus import find_model
from gpuloom.domain.profiles import GapPredictorModel, KernelProfile, KernelStats
from gpuloom.policies.profiling.gaps import choose_predictor
from gpuloom.policies.profiling.kernels import Runs, order_runs, summarise
from gpuloom.policies.profiling.shape import sm_usage
from gpuloom.services.profiler.domain import KernelName, PredictorSummary, Session


def build_kernel_profile(
    session: Session,
    columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    names: dict[int, KernelName],
) -> tuple[KernelProfile, PredictorSummary]:
    """Per-kernel statistics over the T runs (FIKIT) and the gap predictor that did best on
    held-out runs. Each kernel's SM usage comes from its launch shape where the GPU model is
    one the catalogue knows (0, unknown, otherwise); its bound class stays unknown: the shim
    measures no hardware counters (docs/harvest.md)."""
    model = find_model(session.gpu_model)
    runs = order_runs(*columns, session.runs)
    table = summarise(runs)
    choice = choose_predictor(_for_cross_validation(runs))
    kernels = []
    for row in table.rows():
        name = names[row.kernel_id]
        kernels.append(
            KernelStats(
                kernel_id=row.kernel_id,
                name=name.name,
                grid=name.grid,
                block=name.block,
                sample_count=row.sample_count,
                mean_duration_ns=row.mean_duration_ns,
                p50_duration_ns=row.p50_duration_ns,
                p95_duration_ns=row.p95_duration_ns,
                mean_gap_after_ns=row.mean_gap_after_ns,
                sm_usage=0 if model is None else sm_usage(name.grid, name.block, model),
            )
        )
    profile = KernelProfile(
        key=session.task_key,
        gpu_model=session.gpu_model,
        measured_runs=session.runs,
        kernels=tuple(kernels),
        gap_predictor=GapPredictorModel(
            kind=choice.name,
            mae_ns=choice.mae_ns[choice.name],
            candidates_mae_ns=dict(choice.mae_ns),
            model_json=json.dumps(choice.predictor.to_dict()),
        ),
    )
    return profile, PredictorSummary(choice.name, dict(choice.mae_ns))


# Cross-validation fits every candidate once per fold; on long runs that dominates the cost of
# a profile (3.5 s for 1M records here). It runs on whole runs spread over the session, about
# CV_RECORD_BUDGET records and at least MIN_CV_RUNS runs; the reported MAEs are over those.
CV_RECORD_BUDGET = 250_000
MIN_CV_RUNS = 5


def _for_cross_validation(runs: Runs) -> Runs:
    lengths = runs.lengths
    if lengths.sum() <= CV_RECORD_BUDGET:
        return runs
    fits = int(np.searchsorted(np.cumsum(lengths), CV_RECORD_BUDGET, side="right"))
    # Runs spread over the session, not the first few (warm-up effects fade later).
    chosen = np.linspace(0, runs.count - 1, max(fits, MIN_CV_RUNS)).round().astype(int)
    return runs.select(np.unique(chosen))
