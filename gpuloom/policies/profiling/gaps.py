"""Predictors of the idle gap after each kernel of a run, and choosing one by cross-validation.

- "mean" (FIKIT's SG, Section 3.2): the mean gap after the kernel ID over all its occurrences;
- "pair": the mean gap between this kernel ID and the next one, "mean" for unseen pairs;
- "position": the mean gap at the same launch index, for runs that repeat the measured
  sequence (the most common one among the measured runs); "pair" elsewhere.

"pair" and "position" need the next kernel's ID or the launch index. While the task runs, the
scheduler knows both only by following the measured sequence (launch i is expected to be the
profile's kernel i): when the launches stray from it, a caller should fall back to "mean".

A fitted predictor is plain data: `to_dict()` gives JSON-ready tables (kernel IDs as 16 hex
digits, gaps in ns) that `load_predictor` turns back into the same predictor. Their size is
bounded: one entry per kernel ID, at most MAX_PAIRS pairs (the most frequent), at most
MAX_POSITIONS positions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from gpuloom.policies.profiling.kernels import Runs, _lookup

FORMAT_VERSION = 1
MAX_PAIRS = 100_000
MAX_POSITIONS = 100_000
# A sequence seen in fewer runs than this has no per-position mean worth the name.
MIN_RUNS_PER_SEQUENCE = 2
# Simplest first: ties in choose_predictor go to the earliest.
PREDICTOR_NAMES = ("mean", "pair", "position")
# A predictor must beat every simpler one by more than this share of MAE to be chosen.
TIE_TOLERANCE = 0.02


class InvalidPredictorError(ValueError):
    """Serialised predictor data that cannot be loaded."""


class GapPredictor(Protocol):
    @property
    def name(self) -> str: ...

    def predict(self, runs: Runs) -> np.ndarray:
        """The predicted gap after each kernel of `runs` (NaN after each run's last kernel)."""
        ...

    def gap_after(
        self, kernel_id: int, next_kernel_id: int | None = None, position: int | None = None
    ) -> float:
        """One prediction, for a scheduler that sees one launch at a time."""
        ...

    def to_dict(self) -> dict[str, Any]: ...


def _hex(ids: np.ndarray) -> list[str]:
    return [f"{int(i):016x}" for i in ids]


def _unhex(values: object, field: str) -> np.ndarray:
    if not isinstance(values, list):
        raise InvalidPredictorError(f"{field} must be a list")
    try:
        ids = [int(v, 16) for v in values]
    except (TypeError, ValueError):
        raise InvalidPredictorError(f"{field} must hold hexadecimal kernel IDs") from None
    if any(not 0 <= i < 1 << 64 for i in ids):
        raise InvalidPredictorError(f"{field}: kernel IDs must fit 64 bits")
    return np.array(ids, dtype=np.uint64)


def _gaps(values: object, field: str, length: int) -> np.ndarray:
    if not isinstance(values, list) or len(values) != length:
        raise InvalidPredictorError(f"{field} must be a list of {length} numbers")
    try:
        gaps = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidPredictorError(f"{field} must hold numbers") from None
    if gaps.size and not (np.all(np.isfinite(gaps)) and gaps.min() >= 0):
        raise InvalidPredictorError(f"{field}: gaps must be finite and >= 0")
    return gaps


def _header(data: object, name: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise InvalidPredictorError("predictor data must be a mapping")
    if data.get("format") != FORMAT_VERSION:
        raise InvalidPredictorError(f"unknown predictor format {data.get('format')!r}")
    if data.get("predictor") != name:
        raise InvalidPredictorError(f"expected a {name!r} predictor, got {data.get('predictor')!r}")
    return data


def _next_ids(runs: Runs) -> tuple[np.ndarray, np.ndarray]:
    """For each kernel: the next kernel's ID and whether there is one (same run)."""
    # From the offsets, not the gaps: runs built for prediction have no gaps measured.
    has_next = np.ones(len(runs.kernel_ids), dtype=bool)
    has_next[runs.offsets[1:][runs.lengths > 0] - 1] = False
    following = np.zeros(len(runs.kernel_ids), dtype=np.uint64)
    following[:-1] = runs.kernel_ids[1:]
    return following, has_next


def _measured(runs: Runs) -> np.ndarray:
    return ~np.isnan(runs.gaps_ns)


@dataclass(frozen=True, slots=True, eq=False)
class MeanGap:
    """FIKIT's predictor: the mean gap after each kernel ID; `default_ns` (the mean of all
    gaps) for kernel IDs never measured."""

    kernel_ids: np.ndarray  # uint64, ascending
    gaps_ns: np.ndarray  # float64
    default_ns: float
    name: str = "mean"

    @classmethod
    def fit(cls, runs: Runs) -> MeanGap:
        measured = _measured(runs)
        ids = runs.kernel_ids[measured]
        gaps = runs.gaps_ns[measured]
        if len(ids) == 0:
            return cls(np.zeros(0, np.uint64), np.zeros(0), 0.0)
        unique, inverse = np.unique(ids, return_inverse=True)
        means = np.bincount(inverse, weights=gaps) / np.bincount(inverse)
        return cls(unique, means, float(gaps.mean()))

    def predict_ids(self, kernel_ids: np.ndarray) -> np.ndarray:
        if len(self.kernel_ids) == 0:
            return np.full(len(kernel_ids), self.default_ns)
        row = _lookup(self.kernel_ids, kernel_ids)
        return np.where(row >= 0, self.gaps_ns[np.maximum(row, 0)], self.default_ns)

    def predict(self, runs: Runs) -> np.ndarray:
        _, has_next = _next_ids(runs)
        return np.where(has_next, self.predict_ids(runs.kernel_ids), np.nan)

    def gap_after(
        self, kernel_id: int, next_kernel_id: int | None = None, position: int | None = None
    ) -> float:
        return float(self.predict_ids(np.array([kernel_id], dtype=np.uint64))[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "predictor": self.name,
            "default_ns": self.default_ns,
            "kernel_ids": _hex(self.kernel_ids),
            "gaps_ns": self.gaps_ns.tolist(),
        }

    @classmethod
    def from_dict(cls, data: object) -> MeanGap:
        data = _header(data, "mean")
        ids = _unhex(data.get("kernel_ids"), "kernel_ids")
        if len(ids) > 1 and not np.all(ids[1:] > ids[:-1]):
            raise InvalidPredictorError("kernel_ids must be ascending and unique")
        default = _gaps([data.get("default_ns")], "default_ns", 1)[0]
        return cls(ids, _gaps(data.get("gaps_ns"), "gaps_ns", len(ids)), float(default))


def _pair_codes(vocabulary: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """One int64 per (first, second) pair of kernel IDs of `vocabulary`, -1 if either is not
    in it; codes sort like the pairs."""
    a = _lookup(vocabulary, first)
    b = _lookup(vocabulary, second)
    return np.where((a >= 0) & (b >= 0), a * len(vocabulary) + b, -1)


@dataclass(frozen=True, slots=True, eq=False)
class PairGap:
    """The mean gap between each (kernel ID, next kernel ID) pair; `mean` for other pairs and
    for a run's last kernel."""

    mean: MeanGap
    first_ids: np.ndarray  # uint64; pairs ascending by (first, second)
    second_ids: np.ndarray
    gaps_ns: np.ndarray
    name: str = "pair"
    # Lookup table built once: pair codes over the sorted kernel IDs of the pairs.
    _vocabulary: np.ndarray = field(init=False, repr=False)
    _codes: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        vocabulary = np.unique(np.concatenate((self.first_ids, self.second_ids)))
        object.__setattr__(self, "_vocabulary", vocabulary)
        object.__setattr__(self, "_codes", _pair_codes(vocabulary, self.first_ids, self.second_ids))

    @classmethod
    def fit(cls, runs: Runs) -> PairGap:
        mean = MeanGap.fit(runs)
        measured = _measured(runs)
        following, _ = _next_ids(runs)
        first = runs.kernel_ids[measured]
        second = following[measured]
        gaps = runs.gaps_ns[measured]
        if len(first) == 0:
            empty = np.zeros(0, np.uint64)
            return cls(mean, empty, empty, np.zeros(0))
        order = np.lexsort((second, first))
        first, second, gaps = first[order], second[order], gaps[order]
        new = np.ones(len(first), dtype=bool)
        new[1:] = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, len(first)))
        means = np.add.reduceat(gaps, starts) / counts
        keep = np.arange(len(starts))
        if len(starts) > MAX_PAIRS:
            # The most frequent pairs carry most launches; the rest fall back to "mean".
            keep = np.sort(np.argsort(-counts, kind="stable")[:MAX_PAIRS])
        return cls(mean, first[starts][keep], second[starts][keep], means[keep])

    def predict_pairs(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        fallback = self.mean.predict_ids(first)
        if len(self._codes) == 0:
            return fallback
        codes = _pair_codes(self._vocabulary, first, second)
        at = np.minimum(np.searchsorted(self._codes, codes), len(self._codes) - 1)
        hit = (codes >= 0) & (self._codes[at] == codes)
        return np.where(hit, self.gaps_ns[at], fallback)

    def predict(self, runs: Runs) -> np.ndarray:
        following, has_next = _next_ids(runs)
        return np.where(has_next, self.predict_pairs(runs.kernel_ids, following), np.nan)

    def gap_after(
        self, kernel_id: int, next_kernel_id: int | None = None, position: int | None = None
    ) -> float:
        if next_kernel_id is None:
            return self.mean.gap_after(kernel_id)
        first = np.array([kernel_id], dtype=np.uint64)
        return float(self.predict_pairs(first, np.array([next_kernel_id], np.uint64))[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "predictor": self.name,
            "mean": self.mean.to_dict(),
            "first_ids": _hex(self.first_ids),
            "second_ids": _hex(self.second_ids),
            "gaps_ns": self.gaps_ns.tolist(),
        }

    @classmethod
    def from_dict(cls, data: object) -> PairGap:
        data = _header(data, "pair")
        first = _unhex(data.get("first_ids"), "first_ids")
        second = _unhex(data.get("second_ids"), "second_ids")
        if len(first) != len(second) or len(first) > MAX_PAIRS:
            raise InvalidPredictorError(f"first_ids and second_ids: same length <= {MAX_PAIRS}")
        order = np.lexsort((second, first))
        if not np.array_equal(order, np.arange(len(first))):
            raise InvalidPredictorError("pairs must be ascending by (first, second)")
        gaps = _gaps(data.get("gaps_ns"), "gaps_ns", len(first))
        return cls(MeanGap.from_dict(data.get("mean")), first, second, gaps)


@dataclass(frozen=True, slots=True, eq=False)
class PositionGap:
    """The mean gap at each launch index of the measured sequence (the most common one, seen
    in at least MIN_RUNS_PER_SEQUENCE runs); `pair` where a run is not that long or its
    kernel or the next one differs from the sequence's."""

    pair: PairGap
    sequence: np.ndarray  # uint64, empty when no sequence repeats
    gaps_ns: np.ndarray  # float64, len(sequence) - 1 entries
    name: str = "position"

    @classmethod
    def fit(cls, runs: Runs) -> PositionGap:
        pair = PairGap.fit(runs)
        sequence, members = _common_sequence(runs)
        if len(members) < MIN_RUNS_PER_SEQUENCE or len(sequence) < 2:
            return cls(pair, np.zeros(0, np.uint64), np.zeros(0))
        gaps = np.stack([runs.gaps_ns[runs.offsets[t] : runs.offsets[t + 1]] for t in members])
        return cls(pair, sequence, gaps[:, :-1].mean(axis=0))

    def predict(self, runs: Runs) -> np.ndarray:
        predicted = self.pair.predict(runs)
        n = len(self.sequence)
        if n == 0:
            return predicted
        position = runs.positions()
        following, has_next = _next_ids(runs)
        same_length = np.repeat(runs.lengths == n, runs.lengths)
        at = np.where(same_length, position, 0)
        nxt = np.minimum(at + 1, n - 1)
        match = same_length & has_next
        match &= runs.kernel_ids == self.sequence[at]
        match &= following == self.sequence[nxt]
        return np.where(match, self.gaps_ns[np.minimum(at, n - 2)], predicted)

    def gap_after(
        self, kernel_id: int, next_kernel_id: int | None = None, position: int | None = None
    ) -> float:
        n = len(self.sequence)
        if (
            position is not None
            and 0 <= position < n - 1
            and int(self.sequence[position]) == kernel_id
            and next_kernel_id in (None, int(self.sequence[position + 1]))
        ):
            return float(self.gaps_ns[position])
        return self.pair.gap_after(kernel_id, next_kernel_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "predictor": self.name,
            "pair": self.pair.to_dict(),
            "sequence": _hex(self.sequence),
            "gaps_ns": self.gaps_ns.tolist(),
        }

    @classmethod
    def from_dict(cls, data: object) -> PositionGap:
        data = _header(data, "position")
        sequence = _unhex(data.get("sequence"), "sequence")
        if len(sequence) > MAX_POSITIONS or len(sequence) == 1:
            raise InvalidPredictorError(f"sequence must be empty or 2..{MAX_POSITIONS} long")
        gaps = _gaps(data.get("gaps_ns"), "gaps_ns", max(len(sequence) - 1, 0))
        return cls(PairGap.from_dict(data.get("pair")), sequence, gaps)


def _common_sequence(runs: Runs) -> tuple[np.ndarray, list[int]]:
    """The kernel sequence most runs share (longest on ties) and the runs that have it."""
    best: tuple[int, int] = (0, 0)
    sequence, members = np.zeros(0, np.uint64), []
    lengths = runs.lengths
    for length in np.unique(lengths):
        if length < 2 or length > MAX_POSITIONS:
            continue
        of_length = np.flatnonzero(lengths == length)
        if len(of_length) < MIN_RUNS_PER_SEQUENCE:
            continue
        matrix = np.stack([runs.run(int(t)) for t in of_length])
        unique, inverse, counts = np.unique(matrix, axis=0, return_inverse=True, return_counts=True)
        top = int(np.argmax(counts))
        if (int(counts[top]), int(length)) > best:
            best = (int(counts[top]), int(length))
            sequence = unique[top]
            members = of_length[inverse.reshape(-1) == top].tolist()
    return sequence, members


Fit = Callable[[Runs], GapPredictor]
PREDICTORS: Mapping[str, Fit] = MappingProxyType(
    {"mean": MeanGap.fit, "pair": PairGap.fit, "position": PositionGap.fit}
)
_LOADERS: Mapping[str, Callable[[object], GapPredictor]] = MappingProxyType(
    {"mean": MeanGap.from_dict, "pair": PairGap.from_dict, "position": PositionGap.from_dict}
)


class UnknownPredictorError(ValueError):
    """No gap predictor has that name."""


def fit_predictor(name: str, runs: Runs) -> GapPredictor:
    fit = PREDICTORS.get(name)
    if fit is None:
        known = ", ".join(PREDICTORS)
        raise UnknownPredictorError(f"unknown gap predictor {name!r}; known: {known}")
    return fit(runs)


def load_predictor(data: Mapping[str, Any]) -> GapPredictor:
    """The predictor `to_dict()` serialised."""
    load = _LOADERS.get(data.get("predictor")) if isinstance(data, Mapping) else None
    if load is None:
        raise InvalidPredictorError("predictor data names no known predictor")
    try:
        return load(data)
    except InvalidPredictorError:
        raise
    except (TypeError, AttributeError, KeyError) as error:
        raise InvalidPredictorError(f"malformed predictor data: {error}") from None


@dataclass(frozen=True, slots=True)
class PredictorChoice:
    """The chosen predictor fitted on all runs, and every candidate's cross-validated MAE."""

    name: str
    predictor: GapPredictor
    mae_ns: Mapping[str, float]
    folds: int
    gaps: int  # held-out gaps each MAE averages over


def mean_absolute_error(predictor: GapPredictor, runs: Runs) -> tuple[float, int]:
    """(sum of |predicted - measured| over the measured gaps, how many there are)."""
    measured = _measured(runs)
    error = np.abs(predictor.predict(runs)[measured] - runs.gaps_ns[measured])
    return float(error.sum()), int(measured.sum())


def choose_predictor(
    runs: Runs,
    folds: int = 5,
    candidates: Sequence[str] = PREDICTOR_NAMES,
    tie_tolerance: float = TIE_TOLERANCE,
) -> PredictorChoice:
    """k-fold cross-validation holding out whole runs (run t in fold t mod k): the MAE of each
    candidate's predictions on the held-out runs' gaps, pooled over the folds. The lowest MAE
    wins unless a simpler candidate (earlier in PREDICTOR_NAMES) is within tie_tolerance of
    it; the winner is then fitted on all runs."""
    unknown = [c for c in candidates if c not in PREDICTORS]
    if unknown or not candidates:
        raise UnknownPredictorError(f"unknown gap predictors {unknown}; known: {PREDICTOR_NAMES}")
    if runs.count < 2:
        raise ValueError("cross-validation needs at least 2 runs")
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    folds = min(folds, runs.count)
    fold_of = np.arange(runs.count) % folds
    totals = dict.fromkeys(candidates, 0.0)
    count = 0
    for fold in range(folds):
        train = runs.select(np.flatnonzero(fold_of != fold))
        test = runs.select(np.flatnonzero(fold_of == fold))
        for name in candidates:
            total, n = mean_absolute_error(PREDICTORS[name](train), test)
            totals[name] += total
        count += n
    if count == 0:
        raise ValueError("the runs hold no gaps to evaluate (every run has < 2 kernels)")
    mae = {name: totals[name] / count for name in candidates}
    ranked = sorted(candidates, key=PREDICTOR_NAMES.index)
    best = min(mae.values())
    name = next(c for c in ranked if mae[c] <= best * (1 + tie_tolerance) + 1e-9)
    return PredictorChoice(
        name=name,
        predictor=PREDICTORS[name](runs),
        mae_ns=MappingProxyType(mae),
        folds=folds,
        gaps=count,
    )
