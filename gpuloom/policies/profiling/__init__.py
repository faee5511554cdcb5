"""The analytics of the profiler service: FIKIT kernel statistics and gap predictors, and
Gandiva's mini-batch cycle in a training job's memory use.

Pure code: measurement arrays in, statistics and fitted predictors (plain data when
serialised) out. `kernel_id` is the shim's kernel ID; `choose_predictor` picks a gap predictor
by cross-validation, `fit_predictor(name, runs)` fits one by name (`PREDICTORS`, the family's
`Registry`). `synth` builds synthetic runs from Orion kernel traces (reading a trace file is
the package's only I/O).
"""

from gpuloom.policies.profiling.cycles import Cycle, CycleOptions, NoCycle, detect_cycle
from gpuloom.policies.profiling.gaps import (
    PREDICTOR_NAMES,
    PREDICTORS,
    GapPredictor,
    InvalidPredictorError,
    MeanGap,
    PairGap,
    PositionGap,
    PredictorChoice,
    PredictorKind,
    choose_predictor,
    fit_predictor,
    load_predictor,
)
from gpuloom.policies.profiling.kernels import (
    KernelAccumulator,
    KernelSummary,
    KernelTable,
    Runs,
    aggregate,
    kernel_id,
    order_runs,
    summarise,
)

__all__ = [
    "PREDICTORS",
    "PREDICTOR_NAMES",
    "Cycle",
    "CycleOptions",
    "GapPredictor",
    "InvalidPredictorError",
    "KernelAccumulator",
    "KernelSummary",
    "KernelTable",
    "MeanGap",
    "NoCycle",
    "PairGap",
    "PositionGap",
    "PredictorChoice",
    "PredictorKind",
    "Runs",
    "aggregate",
    "choose_predictor",
    "detect_cycle",
    "fit_predictor",
    "kernel_id",
    "load_predictor",
    "order_runs",
    "summarise",
]
