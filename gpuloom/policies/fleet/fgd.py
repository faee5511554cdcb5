"""FGD, Fragmentation Gradient Descent (Weng et al., ATC'23), as its published simulator scores
it: a node's score for a pod is

    int(100 * sigmoid((frag_before - frag_after) / 1000))

(fragmentation in milli of a GPU, frag.py; not normalised across nodes), the highest score wins
and ties go to the first node in the run's node order (`FleetState.rank`). A share is tried on
every GPU of the node it fits on and takes the first GPU with the top integer score; whole GPUs
are the node's first fully free ones.

A node's score for a shape only changes when the node does, so scores are cached per (node,
shape) and recomputed for the nodes whose version moved since that shape was last placed, each
looked up by the node's state (computed once per state and pod class). A share's score on each
GPU is kept too, so that a pod that may not take some GPUs (`FleetState.usable`: the live
adapter's GPU memory) is scored over the others without computing anything again.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.frag import frag_moves
from gpuloom.policies.fleet.model import Choice, FleetState, pick_best

MAX_SCORE = 100  # kube-scheduler's MaxNodeScore
SCALE_MILLI = 1000.0  # the published divisor inside the sigmoid


def fgd_score(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The published integer score of a move from fragmentation `before` to `after` (milli),
    in the published order of operations: int(sigmoid((before - after) / 1000) * 100)."""
    return np.trunc(1.0 / (1.0 + np.exp(-((before - after) / SCALE_MILLI))) * MAX_SCORE)


def _first_top_per_row(rows: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Per row, the index of its first option with the row's top score. `rows` is sorted,
    every row from 0 up has at least one option, and a row's options come in GPU order (as
    `frag_moves` gives them), so the first is the lowest GPU."""
    if len(rows) == rows[-1] + 1:  # one option per row
        return np.arange(len(rows))
    top = np.flatnonzero(score == np.maximum.reduceat(score, np.flatnonzero(_firsts(rows)))[rows])
    return top[_firsts(rows[top])]


def _firsts(rows: np.ndarray) -> np.ndarray:
    """Whether each entry of a sorted array is the first of its value (np.r_ costs more)."""
    first = np.empty(len(rows), dtype=bool)
    first[:1] = True
    np.not_equal(rows[1:], rows[:-1], out=first[1:])
    return first


class _NodeStates:
    """Every node's state as a small integer: nodes of one GPU model with the same free CPU and
    free GPUs (all that a node's FGD results depend on; memory only decides whether a pod
    fits) share one id, and a node back in a state it was in gets its old id. Ids are
    renumbered, keeping only those of nodes now, when more than `limit` were handed out
    (`renumbered` says how, for tables indexed by id)."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        self.ids: dict[tuple[int, int, bytes], int] = {}
        self.sid = np.zeros(len(state.nodes), dtype=np.int64)
        self.seen = np.full(len(state.nodes), -1, dtype=np.int64)
        self.limit = max(STATES_PER_NODE * len(state.nodes), MIN_STATES)

    def current(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The id per node now, and when ids were renumbered the old id of each new one."""
        s = self.state
        stale = np.flatnonzero(self.seen != s.version)
        renumbered = None
        if stale.size:
            ids = self.ids
            # A new state takes the next id (len(ids) is read before setdefault adds it).
            self.sid[stale] = [
                ids.setdefault((m, c, row.tobytes()), len(ids))
                for m, c, row in zip(
                    s.model_idx[stale].tolist(),
                    s.cpu_free[stale].tolist(),
                    s.gpu_free[stale],
                    strict=True,
                )
            ]
            self.seen[stale] = s.version[stale]
            if len(ids) > self.limit:
                renumbered = self._renumber()
        return self.sid, renumbered

    def _renumber(self) -> np.ndarray:
        kept = np.unique(self.sid)
        keep = set(kept.tolist())
        order = {old: new for new, old in enumerate(kept.tolist())}
        self.ids = {key: order[old] for key, old in self.ids.items() if old in keep}
        self.sid = np.searchsorted(kept, self.sid)
        return kept


STATES_PER_NODE = 8  # node states remembered per node before unused ones are forgotten
MIN_STATES = 8192


class _ByState:
    """Values per node state id, one array per field (NaN in the first field: not computed
    yet): one pod class's results (`FragDeltas.FIELDS`)."""

    def __init__(self, size: int, blanks: dict[str, np.ndarray]) -> None:
        """`blanks`: per field, one id's value before it is computed (its shape and type)."""
        self.blanks = blanks
        self.values = {name: _blank_rows(b, size) for name, b in blanks.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def fit(self, size: int, kept: np.ndarray | None) -> None:
        """Cover ids below `size`; when ids were renumbered, keep the kept ones' values."""
        if kept is not None:
            self._grow(int(kept[-1]) + 1)
            self.values = {name: a[kept] for name, a in self.values.items()}
        self._grow(size)

    def _grow(self, size: int) -> None:
        have = len(next(iter(self.values.values())))
        if size > have:
            more = max(size, 2 * have) - have
            self.values = {
                name: np.concatenate([a, _blank_rows(self.blanks[name], more)])
                for name, a in self.values.items()
            }


def _blank_rows(blank: np.ndarray, rows: int) -> np.ndarray:
    return np.broadcast_to(blank, (rows, *blank.shape)).copy()


def pad_rows(a: np.ndarray, more: int, fill: float) -> np.ndarray:
    """`a` with `more` rows of `fill` below it."""
    return np.concatenate([a, np.full((more, *a.shape[1:]), fill, dtype=a.dtype)])


class FragDeltas:
    """Per (node, shape), cached: the published FGD score (-inf where the shape does not fit)
    and its GPU for a share, and a share's score on each GPU (`options`). Behind that cache,
    results are kept per node state (`_NodeStates`) and pod class (CPU, GPU count, GPU milli:
    what the results depend on; a shape's memory and GPU models only decide where it fits),
    so nodes alike, or a node back in a state it was in, cost nothing to score. Read them
    with `read`."""

    # Per node state and pod class: the fields `_compute` gives (NaN in the first: not yet),
    # and with them OPTIONS: a share's score on each GPU (-1: it does not fit there).
    FIELDS: dict[str, float] = {"score": np.nan, "gpu": -1}
    OPTIONS = "options"

    def __init__(self, state: FleetState) -> None:
        n, q = len(state.nodes), len(state.shapes)
        width = state.gpu_free.shape[1]
        self.state = state
        # Per (shape, node): one shape's row is contiguous, as a decision reads it.
        self.score = np.full((q, n), -np.inf)
        self.gpu = np.full((q, n), -1, dtype=np.int64)
        self.options = np.full((q, n, width), -1, dtype=np.int8)  # scores 0..100 fit in int8
        self.version = np.full((q, n), -1, dtype=np.int64)
        self._blanks = {name: np.array(fill) for name, fill in self.FIELDS.items()}
        self._blanks[self.OPTIONS] = np.full(width, -1, dtype=np.int8)
        self._states = _NodeStates(state)
        self._results: dict[tuple[int, int, int], _ByState] = {}

    @classmethod
    def of(cls, state: FleetState) -> FragDeltas:
        deltas = state.memo.get("frag_deltas")
        if not isinstance(deltas, FragDeltas):
            deltas = state.memo["frag_deltas"] = cls(state)
        elif deltas.score.shape[0] < len(state.shapes):  # shapes added since (add_shape):
            # room for as many again, so a stream of new shapes copies the arrays a
            # logarithmic number of times
            have = deltas.score.shape[0]
            deltas._grow(max(len(state.shapes) - have, have))
        return deltas

    def _grow(self, more: int) -> None:
        """Room for `more` shapes."""
        self.score, self.gpu = pad_rows(self.score, more, -np.inf), pad_rows(self.gpu, more, -1)
        self.options = pad_rows(self.options, more, -1)
        self.version = pad_rows(self.version, more, -1)

    def refresh(self, q: int, rows: np.ndarray | None = None) -> None:
        """Recompute shape q's column for the nodes (of `rows`; None: every node) that changed
        since it was last read (of those `FleetState.allowed` allows, when it is set): a
        lookup by node state, computed only for states this pod class has not met."""
        s = self.state
        if rows is None:
            stale = np.flatnonzero(self.version[q] != s.version)
        else:
            stale = rows[self.version[q, rows] != s.version[rows]]
        if s.allowed is not None:  # the others read -inf (`only_allowed`): left for later
            stale = stale[s.allowed[stale]]
        if not stale.size:
            return
        fits = s.fits_rows(q, stale)
        self.version[q, stale] = s.version[stale]
        self.score[q, stale[~fits]] = -np.inf
        where = stale[fits]
        if not where.size:
            return
        sid, renumbered = self._states.current()
        size = len(self._states.ids)
        if renumbered is not None:
            for by_state in self._results.values():
                by_state.fit(size, renumbered)
        pod = (int(s.s_cpu[q]), int(s.s_k[q]), int(s.s_d[q]))
        results = self._results.get(pod)
        if results is None:
            results = self._results[pod] = _ByState(max(size, 64), self._blanks)
        results.fit(size, None)
        ids = sid[where]
        missing = np.flatnonzero(np.isnan(results["score"][ids]))
        if missing.size:
            # Each missing state once, at its first node (a dict: np.unique sorts, which costs
            # more on the few dozen a decision has).
            firsts: dict[int, int] = {}
            for n, state_id in zip(missing.tolist(), ids[missing].tolist(), strict=True):
                firsts.setdefault(state_id, n)
            new = np.fromiter(firsts.keys(), dtype=np.int64, count=len(firsts))
            first = np.fromiter(firsts.values(), dtype=np.int64, count=len(firsts))
            for name, values in self._compute(q, where[first]).items():
                results[name][new] = values
        self._store(q, where, results, ids)

    def _compute(self, q: int, where: np.ndarray) -> dict[str, np.ndarray]:
        """Each field of FIELDS per node of `where` (all fit shape q): the top score over the
        node's options, and the first GPU that reaches it (-1: whole GPUs or none); and a
        share's score on each GPU (OPTIONS)."""
        rows, cols, after, before = frag_moves(self.state, q, where)
        score = fgd_score(before[rows], after)
        top = _first_top_per_row(rows, score)
        options = np.full((len(where), self.options.shape[2]), -1, dtype=np.int8)
        if cols[0] >= 0:  # a share: one option per GPU it fits on
            options[rows, cols] = score
        return {"score": score[top], "gpu": cols[top], self.OPTIONS: options}

    def _store(self, q: int, where: np.ndarray, results: _ByState, ids: np.ndarray) -> None:
        """Shape q's entries of the nodes `where`, from their states' results."""
        self.score[q, where], self.gpu[q, where] = results["score"][ids], results["gpu"][ids]
        self.options[q, where] = results[self.OPTIONS][ids]

    def read(self, q: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Shape q's score and GPU on the nodes `rows` (None: every node), refreshed, as the
        pod being decided sees them: with `FleetState.usable` set, a share's options on GPUs
        it may not take are left out (the top score over the node's other options and the
        first GPU that reaches it; -inf and -1: none left); with `FleetState.allowed` set,
        only the allowed nodes' are current (read the score through `only_allowed`).
        Read-only: they may be the cache itself."""
        self.refresh(q, rows)
        if rows is None:
            score, gpu, options = self.score[q], self.gpu[q], self.options[q]
            usable = self.state.usable
        else:
            score, gpu, options = self.score[q, rows], self.gpu[q, rows], self.options[q, rows]
            usable = None if self.state.usable is None else self.state.usable[rows]
        if usable is not None:
            at = np.flatnonzero(((options >= 0) & ~usable).any(axis=1) & (score > -np.inf))
            if at.size:
                left = np.where(usable[at], options[at], -1)
                top = left.max(axis=1)
                score, gpu = score.copy(), gpu.copy()
                score[at] = np.where(top >= 0, top, -np.inf)
                gpu[at] = np.where(top >= 0, (left == top[:, None]).argmax(axis=1), -1)
        return {"score": score, "gpu": gpu}

    def scores(self, q: int) -> np.ndarray:
        """The published FGD score per node for shape q (-inf: does not fit), as `read`."""
        return self.read(q)["score"]

    def choice(self, n: int, q: int, gpu: int) -> Choice:
        """Node n with `gpu` (a share's, as `read` gives it) or else its first free GPUs."""
        return Choice(n, (gpu,) if gpu >= 0 else self.state.bestfit_gpus(n, q))


class FgdPolicy:
    name = "fgd"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        deltas = FragDeltas.of(state)
        kept = deltas.read(q)
        n = pick_best(state.only_allowed(kept["score"]), state.rank)
        return None if n is None else deltas.choice(n, q, int(kept["gpu"][n]))
