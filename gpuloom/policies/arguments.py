"""Policy arguments: a component's policy knobs given as one setting, checked against the
dataclasses the policies take (like the Kubernetes scheduler's pluginConfig).

The text names a section (a policy's configuration dataclass) and its fields, in either form:

    fikit.fill_guard_ns=80000,tokens.lease_max_s=0.05
    {"fikit": {"fill_guard_ns": 80000}, "tokens": {"lease_max_s": 0.05}}

Each section starts from the component's default instance; the fields named replace its
values. An unknown section or field, a value of the wrong type, or a value the dataclass's own
`validate()` refuses raises ValueError naming it, and nothing is applied.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any


def parse_policy_args(
    text: str,
    defaults: Mapping[str, Any],
    fixed: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Each section of `defaults` (a dataclass instance) with the fields `text` sets replaced.

    `fixed` maps "section.field" to the setting that owns that field: naming it here is an
    error saying where to set it instead."""
    values = _sections(text)
    result = dict(defaults)
    for section, fields in values.items():
        if section not in defaults:
            known = ", ".join(sorted(defaults))
            raise ValueError(f"unknown policy-arguments section {section!r}; known: {known}")
        default = defaults[section]
        types = {f.name: f.type for f in dataclasses.fields(default)}
        changes: dict[str, Any] = {}
        for name, raw in fields.items():
            key = f"{section}.{name}"
            if fixed and key in fixed:
                raise ValueError(f"{key} is set by {fixed[key]}, not by the policy arguments")
            if name not in types:
                raise ValueError(f"unknown policy argument {key}; known: {', '.join(types)}")
            changes[name] = _typed(key, str(types[name]), raw)
        try:
            result[section] = dataclasses.replace(default, **changes)
            validate = getattr(result[section], "validate", None)
            if validate is not None:
                validate()
        except ValueError as error:
            raise ValueError(f"policy arguments {section}: {error}") from None
    return result


def _sections(text: str) -> dict[str, dict[str, Any]]:
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"policy arguments are not valid JSON: {error}") from None
        if not all(isinstance(fields, dict) for fields in loaded.values()):
            raise ValueError('policy arguments in JSON: {"section": {"field": value}, ...}')
        return loaded
    sections: dict[str, dict[str, Any]] = {}
    for item in text.split(","):
        key, equals, value = item.strip().partition("=")
        section, dot, name = key.strip().partition(".")
        if not equals or not dot or not section or not name:
            raise ValueError(f"policy argument {item.strip()!r} is not section.field=value")
        fields = sections.setdefault(section, {})
        if name in fields:
            raise ValueError(f"policy argument {key.strip()} is given twice")
        fields[name] = value.strip()
    return sections


def _typed(key: str, kind: str, raw: object) -> int | float:
    """`raw` (a JSON value or the text after '=') as the field's type: int or float."""
    if kind not in ("int", "float"):
        raise ValueError(f"{key} is not a number field and cannot be set here")
    if isinstance(raw, str):
        try:
            raw = int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ValueError(
                f"{key}={raw!r} is not {'an integer' if kind == 'int' else 'a number'}"
            ) from None
    if kind == "int" and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise ValueError(f"{key}={raw!r} is not an integer")
    if kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise ValueError(f"{key}={raw!r} is not a finite number")
        raw = float(raw)
    return raw  # type: ignore[return-value]
