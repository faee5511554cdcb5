"""The one registry every policy family uses: names to factories, one error naming the known
names, arguments only where a family takes them."""

import pytest

from gpuloom.policies.mig import PLANNERS
from gpuloom.policies.placement import POLICIES as PLACEMENT
from gpuloom.policies.registry import Registry, UnknownPolicyError
from gpuloom.policies.tokens import POLICIES as TOKENS


def sized(argument: str | None) -> str:
    if not argument:
        raise ValueError("needs a size")
    return f"sized {argument}"


REGISTRY = Registry(
    "toy",
    {"plain": lambda: "a plain one", "other": lambda: "another"},
    with_argument={"sized": sized},
    arguments={"sized": "N"},
)


def test_a_name_makes_a_new_policy_from_its_factory() -> None:
    assert REGISTRY.create(" plain ") == "a plain one"
    assert REGISTRY.create("sized:3") == "sized 3"
    assert list(REGISTRY) == ["other", "plain", "sized"]
    assert "sized" in REGISTRY and "nope" not in REGISTRY
    assert len(REGISTRY) == 3


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownPolicyError) as caught:
        REGISTRY.create("nope")
    assert str(caught.value) == "unknown toy policy 'nope'; known: other, plain, sized (sized:N)"
    assert caught.value.kind == "toy"
    assert caught.value.known == ("other", "plain", "sized")
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("plain:x", "policy 'plain:x': this policy takes no ':' argument"),
        ("sized", "policy 'sized': needs a size"),
        ("sized:", "policy 'sized:': needs a size"),
        (None, "unknown toy policy None"),
    ],
)
def test_arguments_are_checked(spec, message: str) -> None:
    with pytest.raises(UnknownPolicyError, match=message):
        REGISTRY.create(spec)


def test_a_family_without_arguments_reads_a_colon_as_part_of_the_name() -> None:
    with pytest.raises(UnknownPolicyError, match="unknown placement policy 'mra:x'; known: "):
        PLACEMENT.create("mra:x")


@pytest.mark.parametrize(
    ("registry", "message"),
    [
        (PLACEMENT, "unknown placement policy 'x'; known: best, bestfit, binpack, dotprod, fgd, "),
        (TOKENS, "unknown token policy 'x'; known: exclusive, fifo, spatiotemporal$"),
        (PLANNERS, r"unknown MIG policy 'x'; known: far, .*, miso \(fixpart:SIZES\)$"),
    ],
)
def test_every_family_raises_the_same_error(registry: Registry, message: str) -> None:
    with pytest.raises(UnknownPolicyError, match=message):
        registry.create("x")
