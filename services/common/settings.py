"""Typed settings read from the environment (prefix GPULOOM_), validated at start-up.

A bad value stops the service before it binds a port, with a message naming the variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

LogLevel = Literal["debug", "info", "warning", "error"]


class CommonSettings(BaseSettings):
    """Settings every gpuloom process reads: GPULOOM_LOG_LEVEL, GPULOOM_DATA_DIR, ..."""

    model_config = SettingsConfigDict(env_prefix="GPULOOM_", extra="ignore")

    log_level: LogLevel = "info"
    log_format: Literal["json", "console"] = "json"
    # Where the embedded default keeps its state (the SQLite database, sockets).
    data_dir: Path = Path(".gpuloom")
    # Address the gRPC servers bind; 0.0.0.0 in containers.
    bind_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9100, ge=0, le=65535)


class SettingsError(Exception):
    """Configuration from the environment is invalid; the message names each variable."""


def describe_validation_error(prefix: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        variable = prefix + "_".join(str(part) for part in item["loc"]).upper()
        problems.append(f"{variable}: {item['msg']} (got {item.get('input')!r})")
    return "invalid configuration: " + "; ".join(problems)


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def load(cls: type[SettingsT]) -> SettingsT:
    """Instantiate settings from the environment, turning validation errors into SettingsError."""
    try:
        return cls()
    except ValidationError as error:
        prefix = cls.model_config.get("env_prefix", "")
        raise SettingsError(describe_validation_error(prefix, error)) from None
