import itertools
import json

import numpy as np
import pytest

from gpuloom.policies.profiling import (
    PREDICTOR_NAMES,
    InvalidPredictorError,
    Runs,
    choose_predictor,
    fit_predictor,
    load_predictor,
    order_runs,
)
from gpuloom.policies.profiling.synth import GapModel, synthesize
from gpuloom.policies.registry import UnknownPolicyError

from .helpers import orion


def measured(trace: str, model: GapModel, runs: int = 20, seed: int = 0) -> Runs:
    m = synthesize(orion(trace), runs=runs, gaps=model, seed=seed)
    return order_runs(m.kernel_ids, m.start_ns, m.end_ns, m.run_index, m.runs)


def test_mean_is_fikit_sg() -> None:
    # The paper's example: kernel j is the 1st and 5th launch of run 1 and the 2nd and 6th of
    # run 2; SG_j averages the four gaps after it.
    j = 9
    runs = Runs.from_sequences(
        [[j, 1, 2, 3, j, 4], [1, j, 2, 3, 4, j, 5]],
        [[10, 1, 1, 1, 30, 1], [1, 20, 1, 1, 1, 40]],
    )
    predictor = fit_predictor("mean", runs)
    assert predictor.gap_after(j) == pytest.approx((10 + 30 + 20 + 40) / 4)
    # A kernel never measured gets the mean of all gaps.
    all_gaps = runs.gaps_ns[~np.isnan(runs.gaps_ns)]
    assert predictor.gap_after(12345) == pytest.approx(all_gaps.mean())


def test_pair_and_position_fall_back() -> None:
    runs = Runs.from_sequences([[1, 2, 1, 3]] * 3, [[10, 20, 50]] * 3)
    pair = fit_predictor("pair", runs)
    assert pair.gap_after(1, 2) == 10 and pair.gap_after(1, 3) == 50
    assert pair.gap_after(1, 7) == pytest.approx(30)  # unseen pair: mean after kernel 1
    assert pair.gap_after(1) == pytest.approx(30)  # next unknown: mean too
    position = fit_predictor("position", runs)
    assert position.gap_after(1, 2, position=0) == 10
    # Launch 2 of the sequence is kernel 1 followed by 3; elsewhere: the pair's answer.
    assert position.gap_after(1, 3, position=2) == 50
    assert position.gap_after(2, 1, position=0) == pair.gap_after(2, 1)
    other = Runs.from_sequences([[1, 2, 1, 3, 1]], [[0, 0, 0, 0]])
    predicted = position.predict(other)  # a longer run: no position is trusted
    assert np.array_equal(predicted, pair.predict(other), equal_nan=True)
    assert np.isnan(predicted[-1])


def test_position_uses_the_sequence_most_runs_share() -> None:
    runs = Runs.from_sequences(
        [[1, 2, 3], [], [1, 2, 3], [1, 3, 2], [1, 2, 3], []],
        [[10, 20], [], [12, 22], [1, 1], [14, 24], []],
    )
    position = fit_predictor("position", runs)
    assert position.sequence.tolist() == [1, 2, 3]
    assert position.gaps_ns.tolist() == [12, 22]
    # No sequence repeats: position is pair.
    lone = fit_predictor("position", Runs.from_sequences([[1, 2], [2, 1]], [[5], [6]]))
    assert len(lone.sequence) == 0 and lone.gap_after(1, 2, position=0) == 5


def test_position_learns_what_only_the_launch_index_explains() -> None:
    # The same pair (1 -> 2) waits 10 ns at launch 0 and 90 ns at launch 2.
    runs = Runs.from_sequences([[1, 2, 1, 2]] * 4, [[10, 5, 90]] * 4)
    choice = choose_predictor(runs, folds=4)
    assert choice.name == "position"
    assert choice.mae_ns["position"] == pytest.approx(0)
    assert choice.mae_ns["pair"] == pytest.approx(80 / 3)


def test_ties_go_to_the_simplest_predictor() -> None:
    # Kernel 1 waits about 10 and 30 before kernel 2, 100 before kernel 3.
    runs = Runs.from_sequences(
        [[1, 2, 1, 3, 1, 2]] * 4, [[10 + d, 5, 100 - d, 7, 30 + d] for d in (0, 4, 8, 12)]
    )
    mae = choose_predictor(runs, folds=4).mae_ns
    assert 0 < mae["position"] < mae["pair"] < mae["mean"]
    # Within the tolerance of the best, the simplest candidate wins.
    loose = mae["pair"] / mae["position"] - 1 + 1e-6
    assert choose_predictor(runs, folds=4, tie_tolerance=loose).name == "pair"
    assert choose_predictor(runs, folds=4, tie_tolerance=1e9).name == "mean"
    assert choose_predictor(runs, folds=4, candidates=["pair", "mean"]).name == "pair"


def test_cross_validation_holds_out_whole_runs() -> None:
    # Kernel 1's gap is 0, 100, 200, 300 in runs 0..3: leave-one-run-out predicts the mean of
    # the other three runs (a leak of the held-out run would bring the MAE down to 100).
    runs = Runs.from_sequences([[1, 2]] * 4, [[0], [100], [200], [300]])
    choice = choose_predictor(runs, folds=4)
    assert choice.mae_ns["mean"] == pytest.approx((200 + 200 / 3 + 200 / 3 + 200) / 4)
    assert choice.gaps == 4 and choice.folds == 4
    assert choice.name == "mean"  # all three tie: the simplest wins


@pytest.mark.parametrize("trace", ["resnet50_32_fb1", "transformer_xl_4_fwd", "mobilenetv2_4_fwd"])
def test_pair_beats_mean_when_gaps_follow_the_pair(trace: str) -> None:
    choice = choose_predictor(measured(trace, GapModel.pairs_only()))
    assert choice.mae_ns["pair"] < 0.8 * choice.mae_ns["mean"]
    assert choice.name in ("pair", "position")
    assert choice.name == "pair" or choice.mae_ns["position"] < choice.mae_ns["pair"] / 1.02


@pytest.mark.parametrize("trace", ["resnet50_32_fb1", "transformer_xl_4_fwd", "bert_2_fwd"])
def test_mean_wins_or_ties_when_gaps_depend_on_the_kernel_only(trace: str) -> None:
    choice = choose_predictor(measured(trace, GapModel.kernel_only()))
    assert choice.name == "mean"
    assert choice.mae_ns["mean"] <= 1.02 * min(choice.mae_ns.values())


def test_position_wins_with_phase_boundaries() -> None:
    choice = choose_predictor(measured("resnet50_4_fwd", GapModel()))
    assert choice.name == "position"
    assert choice.mae_ns["position"] < 0.9 * choice.mae_ns["pair"]


@pytest.mark.parametrize("name", PREDICTOR_NAMES)
def test_serialisation_round_trip(name: str) -> None:
    runs = measured("mobilenetv2_4_fwd", GapModel(), runs=6)
    predictor = fit_predictor(name, runs)
    data = json.loads(json.dumps(predictor.to_dict()))
    loaded = load_predictor(data)
    assert loaded.name == name
    assert loaded.to_dict() == predictor.to_dict()
    assert np.array_equal(loaded.predict(runs), predictor.predict(runs), equal_nan=True)
    # Plain, bounded tables: one entry per kernel ID, per pair seen, per launch of a run.
    mean_table = data if name == "mean" else data.get("mean") or data["pair"]["mean"]
    with_gaps = runs.kernel_ids[~np.isnan(runs.gaps_ns)]
    assert len(mean_table["kernel_ids"]) == len(np.unique(with_gaps))
    if name == "position":
        assert len(data["sequence"]) == len(runs.run(0))


def test_gap_after_agrees_with_predict() -> None:
    runs = measured("resnet50_4_fwd", GapModel(), runs=5)
    sequence = runs.run(0)
    for name in PREDICTOR_NAMES:
        predictor = fit_predictor(name, runs)
        batch = predictor.predict(runs.select([0]))
        one_by_one = [
            predictor.gap_after(int(k), int(n), position=i)
            for i, (k, n) in enumerate(itertools.pairwise(sequence))
        ]
        assert np.allclose(batch[:-1], one_by_one)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d.update(format=2),
        lambda d: d.update(predictor="median"),
        lambda d: d["mean"].update(kernel_ids=["xyz"]),
        lambda d: d["mean"].update(gaps_ns=[-1.0] * len(d["mean"]["gaps_ns"])),
        lambda d: d.update(first_ids=d["first_ids"][:-1]),
        lambda d: d.update(first_ids=d["first_ids"][::-1], second_ids=d["second_ids"][::-1]),
        lambda d: d.pop("gaps_ns"),
        lambda d: d.update(mean=None),
    ],
)
def test_malformed_predictor_data_is_refused(mangle) -> None:
    data = fit_predictor("pair", measured("mobilenetv2_4_fwd", GapModel(), runs=3)).to_dict()
    mangle(data)
    with pytest.raises(InvalidPredictorError):
        load_predictor(data)


def test_choose_predictor_refuses_what_it_cannot_evaluate() -> None:
    with pytest.raises(ValueError, match="at least 2 runs"):
        choose_predictor(Runs.from_sequences([[1, 2]], [[5]]))
    with pytest.raises(ValueError, match="no gaps"):
        choose_predictor(Runs.from_sequences([[1], [1]], [[], []]))
    known = "known: mean, pair, position$"
    with pytest.raises(UnknownPolicyError, match=f"gap predictor 'median'; {known}"):
        choose_predictor(Runs.from_sequences([[1, 2]] * 2, [[5]] * 2), candidates=["median"])
    with pytest.raises(UnknownPolicyError, match=f"gap predictor policy 'median'; {known}"):
        fit_predictor("median", Runs.from_sequences([[1, 2]], [[5]]))
