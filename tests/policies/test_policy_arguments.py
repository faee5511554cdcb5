"""Policy arguments (gpuloom/policies/arguments.py) and the dispatcher's
GPULOOM_DISPATCHER_POLICY_ARGS: every field checked against the policy's dataclass, every
mistake named, nothing applied from a bad text."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuloom.policies.admission.composed import IDLE_BACKLOG_NS
from gpuloom.policies.arguments import parse_policy_args
from gpuloom.policies.fikit.core import FikitConfig
from gpuloom.policies.tokens.model import TokenConfig
from gpuloom.services.dispatcher.settings import DISPATCHER_FIKIT, DispatcherSettings

DEFAULTS = {"fikit": FikitConfig(), "tokens": TokenConfig()}


@pytest.mark.parametrize(
    "text",
    [
        "fikit.fill_guard_ns=80000,tokens.lease_max_s=0.05",
        " fikit.fill_guard_ns = 80000 , tokens.lease_max_s=5e-2 ",
        '{"fikit": {"fill_guard_ns": 80000}, "tokens": {"lease_max_s": 0.05}}',
    ],
)
def test_both_forms_set_the_named_fields_and_keep_the_others(text: str) -> None:
    parsed = parse_policy_args(text, DEFAULTS)
    assert parsed["fikit"] == FikitConfig(fill_guard_ns=80_000)
    assert parsed["tokens"] == TokenConfig(lease_max_s=0.05)
    assert isinstance(parsed["tokens"].lease_max_s, float)


def test_nothing_given_keeps_the_defaults() -> None:
    assert parse_policy_args("  ", DEFAULTS) == DEFAULTS


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("harvest.x=1", "unknown policy-arguments section 'harvest'; known: fikit, tokens"),
        ("fikit.spin_ns=1", "unknown policy argument fikit.spin_ns; known: gap_threshold_ns"),
        ("fikit.fill_guard_ns=1.5", r"fikit.fill_guard_ns='1.5' is not an integer"),
        ('{"fikit": {"fill_guard_ns": 1.5}}', "fikit.fill_guard_ns=1.5 is not an integer"),
        ('{"fikit": {"fill_guard_ns": true}}', "fikit.fill_guard_ns=True is not an integer"),
        ("fikit.fill_guard_ns=-1", "fill_guard_ns must be a whole number of ns"),
        ("tokens.lease_max_s=nan", "tokens.lease_max_s=nan is not a finite number"),
        ("tokens.lease_max_s=x", "tokens.lease_max_s='x' is not a number"),
        ("tokens.lease_min_s=0.5", r"lease_max_s \(0.1\) must be >= lease_min_s"),
        ("fill_guard_ns=1", "'fill_guard_ns=1' is not section.field=value"),
        ("fikit.fill_guard_ns", "is not section.field=value"),
        ("fikit.idle_margin_ns=1,fikit.idle_margin_ns=2", "fikit.idle_margin_ns is given twice"),
        ("{nope", "policy arguments are not valid JSON"),
        ('{"fikit": 3}', "policy arguments in JSON"),
    ],
)
def test_a_bad_argument_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy_args(text, DEFAULTS)


def test_a_field_owned_by_a_setting_says_which() -> None:
    with pytest.raises(ValueError, match=r"tokens\.window_s is set by GPULOOM_X_WINDOW_MS"):
        parse_policy_args(
            "tokens.window_s=2", DEFAULTS, fixed={"tokens.window_s": "GPULOOM_X_WINDOW_MS"}
        )


def test_the_dispatcher_reads_its_policy_arguments_from_one_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = DispatcherSettings().policy_arguments()
    # The arbiter's 50 us fill guard is the dispatcher's default; the window is WINDOW_MS; the
    # default policy, composed, runs its core with its own idle backlog (docs/harvest.md).
    composed = dataclasses.replace(DISPATCHER_FIKIT, idle_backlog_ns=IDLE_BACKLOG_NS)
    assert defaults.fikit == composed and DISPATCHER_FIKIT.fill_guard_ns == 50_000
    assert defaults.tokens == TokenConfig()
    monkeypatch.setenv("GPULOOM_DISPATCHER_WINDOW_MS", "500")
    monkeypatch.setenv(
        "GPULOOM_DISPATCHER_POLICY_ARGS", "fikit.max_wait_ns=7,tokens.lease_initial_s=0.03"
    )
    arguments = DispatcherSettings().policy_arguments()
    assert arguments.fikit == FikitConfig(
        fill_guard_ns=50_000, max_wait_ns=7, idle_backlog_ns=IDLE_BACKLOG_NS
    )
    assert arguments.tokens == TokenConfig(window_s=0.5, lease_initial_s=0.03)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"POLICY_ARGS": "tokens.window_s=2"}, "set by GPULOOM_DISPATCHER_WINDOW_MS"),
        ({"WINDOW_MS": "50"}, r"tokens.lease_max_s \(0.1\) must not exceed the window"),
        ({"POLICY_ARGS": "fikit.arm=0"}, "unknown policy argument fikit.arm"),
    ],
)
def test_the_dispatcher_refuses_bad_policy_arguments_at_start(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(f"GPULOOM_DISPATCHER_{name}", value)
    with pytest.raises(ValidationError, match=message):
        DispatcherSettings()


def test_the_configuration_doc_lists_every_argument_with_its_default() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = doc.split("### Policy arguments", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, str] = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            names = re.findall(r"`([a-z_]+\.[a-z_]+)`", line.split("|")[1])
            defaults = re.findall(r"`([0-9.]+)`", line.split("|")[2])
            documented |= dict(zip(names, defaults, strict=True))
    arguments = DispatcherSettings().policy_arguments()
    # Every number field (a flag such as harvest.allow_unknown cannot be set here).
    expected = {
        f"{section}.{field.name}": getattr(getattr(arguments, section), field.name)
        for section in ("fikit", "tokens", "harvest")
        for field in dataclasses.fields(getattr(arguments, section))
        if field.name != "window_s" and str(field.type) in ("int", "float")
    }
    assert set(documented) == set(expected)
    for name, value in expected.items():
        assert float(documented[name]) == value, name
