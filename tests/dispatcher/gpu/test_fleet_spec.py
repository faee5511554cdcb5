"""The fleet spec of the simulated backend ("4xA100-80GB", "A100-80GB,2xA30-24GB")."""

from __future__ import annotations

import pytest

from gpuloom.services.dispatcher.gpu.select import open_backend
from gpuloom.services.dispatcher.gpu.simulated import MAX_GPUS, parse_fleet, parse_fleet_spec
from gpuloom.services.dispatcher.settings import DispatcherSettings


def names(spec: str) -> list[str]:
    return [model.name for model in parse_fleet_spec(spec)]


def test_count_and_model() -> None:
    assert names("4xA100-80GB") == ["A100-80GB"] * 4


def test_a_list_keeps_its_order() -> None:
    assert names("A100-80GB,H100-80GB,2xA30-24GB") == [
        "A100-80GB",
        "H100-80GB",
        "A30-24GB",
        "A30-24GB",
    ]


def test_model_names_are_case_insensitive_and_spaces_allowed() -> None:
    assert names(" 2 X h200-141gb , t4-16GB ") == ["H200-141GB", "H200-141GB", "T4-16GB"]


def test_every_known_model_parses() -> None:
    spec = "A100-40GB,A100-80GB,H100-80GB,H200-141GB,A30-24GB,V100-32GB,T4-16GB,L4-24GB"
    assert names(spec) == spec.split(",")


def test_the_largest_fleet() -> None:
    assert len(parse_fleet_spec(f"{MAX_GPUS}xL4-24GB")) == MAX_GPUS


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("4xA100", "'A100'"),  # the family alone is not a model: its memory size is missing
        ("A100-80GB,B300-288GB", "'B300-288GB'"),
        ("2xRTX4090", "'RTX4090'"),
    ],
)
def test_unknown_model_is_named_and_known_models_listed(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match="unknown GPU model") as error:
        parse_fleet_spec(spec)
    assert named in str(error.value)
    assert "A100-80GB" in str(error.value) and "L4-24GB" in str(error.value)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("0xT4-16GB", "bad GPU count 0 in '0xT4-16GB'"),
        ("65xT4-16GB", "bad GPU count 65 in '65xT4-16GB'"),
        ("A100-80GB,,T4-16GB", "bad GPU fleet entry ''"),
        ("4*A100-80GB", "bad GPU fleet entry '4*A100-80GB'"),
        ("A100-80GB;T4-16GB", "bad GPU fleet entry 'A100-80GB;T4-16GB'"),
        ("-2xT4-16GB", "bad GPU fleet entry '-2xT4-16GB'"),
        ("40xT4-16GB,30xL4-24GB", "has 70 GPUs; at most 64"),
        ("", "empty GPU fleet spec"),
        ("  ", "empty GPU fleet spec"),
    ],
)
def test_bad_specs_name_the_bad_part(spec: str, named: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_fleet_spec(spec)
    assert named in str(error.value)


def test_mig_after_a_model_starts_those_gpus_in_mig_mode() -> None:
    fleet = parse_fleet("2xA100-80GB:mig, H100-80GB , A30-24GB : MIG")
    assert [(model.name, mig) for model, mig in fleet] == [
        ("A100-80GB", True),
        ("A100-80GB", True),
        ("H100-80GB", False),
        ("A30-24GB", True),
    ]
    assert names("2xA100-80GB:mig") == ["A100-80GB", "A100-80GB"]
    backend = open_backend("simulated", "A100-80GB:mig,A100-80GB")
    assert [gpu.mig_enabled for gpu in backend.gpus()] == [True, False]
    # What `scripts/up` reads: the setting accepts it, and a MIG GPU takes MIG instances.
    settings = DispatcherSettings(sim_gpus="2xA100-80GB:mig")
    backend = open_backend("simulated", settings.sim_gpus, time_scale=0)
    assert backend.create_mig_instance(0, 7, 0).uuid


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("L4-24GB:mig", "L4-24GB in 'L4-24GB:mig' is not MIG-capable"),
        ("A100-80GB:mps", "bad GPU fleet entry 'A100-80GB:mps'"),
    ],
)
def test_mig_on_a_gpu_without_it_or_another_suffix_is_refused(spec: str, named: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_fleet_spec(spec)
    assert named in str(error.value)
