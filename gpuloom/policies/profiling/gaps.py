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
from functools import partial
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from gpuloom.policies.profiling.kernels import Runs, group, lookup, mix64
from gpuloom.policies.registry import Registry, UnknownPolicyError

FORMAT_VERSION = 1
MAX_PAIRS = 100_000
MAX_POSITIONS = 100_000
# Up to this many (kernel, kernel) combinations, pair means come from one bincount, not a sort.
DENSE_PAIR_TABLE = 1 << 22
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
class _Gaps:
    """The measured gaps of some runs, kernel IDs as indices into their sorted vocabulary:
    computed once and shared by the fits of all predictors."""

    vocabulary: np.ndarray  # uint64, ascending: every kernel ID of the runs
    before: np.ndarray  # int64: the kernel each gap follows
    after: np.ndarray  # int64: the kernel that ends it
    gaps_ns: np.ndarray


def _gaps_of(runs: Runs) -> _Gaps:
    _, has_next = _next_ids(runs)
    measured = _measured(runs) & has_next
    vocabulary, index = group(runs.kernel_ids)
    following = np.zeros_like(index)
    following[:-1] = index[1:]
    return _Gaps(vocabulary, index[measured], following[measured], runs.gaps_ns[measured])


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
        return cls._fit(_gaps_of(runs))

    @classmethod
    def _fit(cls, g: _Gaps) -> MeanGap:
        if len(g.gaps_ns) == 0:
            return cls(np.zeros(0, np.uint64), np.zeros(0), 0.0)
        size = len(g.vocabulary)
        counts = np.bincount(g.before, minlength=size)
        sums = np.bincount(g.before, weights=g.gaps_ns, minlength=size)
        seen = counts > 0
        return cls(g.vocabulary[seen], sums[seen] / counts[seen], float(g.gaps_ns.mean()))

    def predict_ids(self, kernel_ids: np.ndarray) -> np.ndarray:
        if len(self.kernel_ids) == 0:
            return np.full(len(kernel_ids), self.default_ns)
        row = lookup(self.kernel_ids, kernel_ids)
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
    a = lookup(vocabulary, first)
    b = lookup(vocabulary, second)
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
        g = _gaps_of(runs)
        return cls._fit(g, MeanGap._fit(g))

    @classmethod
    def _fit(cls, g: _Gaps, mean: MeanGap) -> PairGap:
        if len(g.gaps_ns) == 0:
            empty = np.zeros(0, np.uint64)
            return cls(mean, empty, empty, np.zeros(0))
        size = len(g.vocabulary)
        # Pair codes sort like (first, second): the vocabulary is ascending.
        codes = g.before * size + g.after
        if size * size <= DENSE_PAIR_TABLE:
            counts = np.bincount(codes, minlength=size * size)
            sums = np.bincount(codes, weights=g.gaps_ns, minlength=size * size)
            pairs = np.flatnonzero(counts)
            counts, sums = counts[pairs], sums[pairs]
        else:
            pairs, inverse = group(codes)
            counts = np.bincount(inverse)
            sums = np.bincount(inverse, weights=g.gaps_ns)
        if len(pairs) > MAX_PAIRS:
            # The most frequent pairs carry most launches; the rest fall back to "mean".
            keep = np.sort(np.argsort(-counts, kind="stable")[:MAX_PAIRS])
            pairs, counts, sums = pairs[keep], counts[keep], sums[keep]
        return cls(mean, g.vocabulary[pairs // size], g.vocabulary[pairs % size], sums / counts)

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
        return cls._fit(runs, PairGap.fit(runs))

    @classmethod
    def _fit(cls, runs: Runs, pair: PairGap) -> PositionGap:
        members = _common_sequence(runs)
        if len(members) < MIN_RUNS_PER_SEQUENCE:
            return cls(pair, np.zeros(0, np.uint64), np.zeros(0))
        length = int(runs.lengths[members[0]])
        rows = runs.offsets[members][:, None] + np.arange(length - 1)
        return cls(pair, runs.run(int(members[0])).copy(), runs.gaps_ns[rows].mean(axis=0))

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


def _common_sequence(runs: Runs) -> np.ndarray:
    """The runs that share the most common kernel sequence (the longest on ties) of 2 to
    MAX_POSITIONS launches."""
    lengths = runs.lengths
    eligible = np.flatnonzero((lengths >= 2) & (lengths <= MAX_POSITIONS))
    if len(eligible) < MIN_RUNS_PER_SEQUENCE:
        return eligible[:0]
    # A fingerprint per run: the wrapping sum of a hash of (kernel ID, position) per launch.
    position = runs.positions().astype(np.uint64)
    terms = mix64(runs.kernel_ids ^ mix64(position))
    running = np.concatenate((np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)))
    fingerprints = (running[runs.offsets[1:]] - running[runs.offsets[:-1]])[eligible]
    keys = np.stack((lengths[eligible].astype(np.uint64), fingerprints), axis=1)
    distinct, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    # Most runs first, then the longest sequence.
    best = int(np.lexsort((distinct[:, 0], counts))[-1])
    members = eligible[inverse.reshape(-1) == best]
    # A fingerprint collision would put a different sequence in: keep exact copies only.
    first = runs.run(int(members[0]))
    rows = runs.offsets[members][:, None] + np.arange(len(first))
    return members[np.all(runs.kernel_ids[rows] == first, axis=1)]


def _fit_all(runs: Runs, names: Sequence[str]) -> dict[str, GapPredictor]:
    """The named predictors fitted on `runs`, the simpler ones taken from the richer ones'
    fallbacks (the same tables as fitting them on their own, computed once)."""
    g = _gaps_of(runs)
    fitted: dict[str, GapPredictor] = {"mean": MeanGap._fit(g)}
    if "pair" in names or "position" in names:
        fitted["pair"] = PairGap._fit(g, fitted["mean"])
    if "position" in names:
        fitted["position"] = PositionGap._fit(runs, fitted["pair"])
    return {name: fitted[name] for name in names}


@dataclass(frozen=True, slots=True)
class PredictorKind:
    """What a predictor's name finds: how to fit it on runs and load it from `to_dict()`."""

    fit: Callable[[Runs], GapPredictor]
    load: Callable[[object], GapPredictor]


# The family's name table, simplest first (PREDICTOR_NAMES: the order ties are broken in).
PREDICTORS: Registry[PredictorKind] = Registry(
    "gap predictor",
    {
        "mean": partial(PredictorKind, MeanGap.fit, MeanGap.from_dict),
        "pair": partial(PredictorKind, PairGap.fit, PairGap.from_dict),
        "position": partial(PredictorKind, PositionGap.fit, PositionGap.from_dict),
    },
)


def fit_predictor(name: str, runs: Runs) -> GapPredictor:
    """The predictor called `name` fitted on `runs`; an unknown name raises the registry's
    UnknownPolicyError, naming the known ones."""
    return PREDICTORS.create(name).fit(runs)


def load_predictor(data: Mapping[str, Any]) -> GapPredictor:
    """The predictor `to_dict()` serialised."""
    name = data.get("predictor") if isinstance(data, Mapping) else None
    if not isinstance(name, str) or name not in PREDICTORS:
        raise InvalidPredictorError("predictor data names no known predictor")
    try:
        return PREDICTORS.create(name).load(data)
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
    if not candidates:
        raise ValueError("choose_predictor needs at least one candidate")
    unknown = [c for c in candidates if c not in PREDICTORS]
    if unknown:
        raise UnknownPolicyError(
            f"unknown gap predictor {unknown[0]!r}; known: {PREDICTORS.known}",
            kind=PREDICTORS.kind,
            known=tuple(PREDICTORS),
        )
    if runs.count < 2:
        raise ValueError("cross-validation needs at least 2 runs")
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    if not tie_tolerance >= 0:
        raise ValueError(f"tie_tolerance must be >= 0, got {tie_tolerance}")
    folds = min(folds, runs.count)
    fold_of = np.arange(runs.count) % folds
    totals = dict.fromkeys(candidates, 0.0)
    count = 0
    for fold in range(folds):
        train = runs.select(np.flatnonzero(fold_of != fold))
        test = runs.select(np.flatnonzero(fold_of == fold))
        for name, predictor in _fit_all(train, candidates).items():
            total, n = mean_absolute_error(predictor, test)
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
        predictor=_fit_all(runs, [name])[name],
        mae_ns=MappingProxyType(mae),
        folds=folds,
        gaps=count,
    )
