"""Where the services are, for every command: `gpuloom --placement ADDR --store ADDR COMMAND`
(or GPULOOM_PLACEMENT_ADDRESS / GPULOOM_PROFILE_STORE_ADDRESS), which a command's own
`--placement` / `--store` overrides."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from gpuloom.clients import placement as placement_client
from gpuloom.clients import profile_store as store_client
from gpuloom.clients import profiler as profiler_client
from gpuloom.domain.errors import DomainError, Unavailable

PLACEMENT_ENV = placement_client.ADDRESS_ENV
STORE_ENV = "GPULOOM_PROFILE_STORE_ADDRESS"
PROFILER_ENV = profiler_client.ADDRESS_ENV
F = TypeVar("F", bound=Callable[..., Any])
# (flag, service, variable, default) of the group's address options, in --help order.
_GROUP_ADDRESSES = (
    ("placement", "Placement service", PLACEMENT_ENV, placement_client.DEFAULT_ADDRESS),
    ("store", "Profile store", STORE_ENV, store_client.DEFAULT_ADDRESS),
    ("profiler", "Profiler", PROFILER_ENV, profiler_client.DEFAULT_ADDRESS),
)


def group_options(command: F) -> F:
    """The group's --placement, --store and --profiler, kept in the root context's obj (a
    dict)."""

    def keep(ctx: click.Context, param: click.Parameter, value: str) -> str:
        ctx.ensure_object(dict)[param.name] = value
        return value

    for flag, service, env, default in reversed(_GROUP_ADDRESSES):
        command = click.option(
            f"--{flag}",
            envvar=env,
            default=default,
            show_default=True,
            expose_value=False,
            callback=keep,
            help=f"{service} address for every command (env {env}).",
        )(command)
    return command


def from_group(name: str, env: str, default: str) -> Callable[..., str]:
    def resolve(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
        if value is not None:
            return value
        chosen = ctx.find_root().obj
        if isinstance(chosen, dict) and chosen.get(name):
            return str(chosen[name])
        return os.environ.get(env, default)

    return resolve


def address_option(
    flag: str, service: str, env: str, default: str, group_flag: str = "", dest: str = "address"
) -> Callable[[F], F]:
    """`--FLAG HOST:PORT` of one service: the command's own, else the group's `--GROUP_FLAG`
    (default: the same flag), else env, else `default`; the value goes to `dest`."""
    group_flag = group_flag or flag
    return click.option(
        f"--{flag}",
        dest,
        metavar="HOST:PORT",
        callback=from_group(group_flag, env, default),
        help=f"{service} address (default: gpuloom --{group_flag}, else {env}, else {default}).",
    )


placement_option = address_option(
    "placement", "Placement service", PLACEMENT_ENV, placement_client.DEFAULT_ADDRESS
)
profiler_option = address_option(
    "profiler", "Profiler", PROFILER_ENV, profiler_client.DEFAULT_ADDRESS
)
store_option = address_option("store", "Profile store", STORE_ENV, store_client.DEFAULT_ADDRESS)


def service_error(error: DomainError, service: str, address: str) -> click.ClickException:
    """One line for a failed call: an unreachable service names its address and how to set it;
    any other refusal gives the service's message and where it came from."""
    message = " ".join(error.message.split())
    if isinstance(error, Unavailable):
        option, env = _HOW_TO_SET.get(service, ("", ""))
        how = f" (set with {option} or {env})" if option else ""
        return click.ClickException(f"cannot reach {service} at {address}{how}: {message}")
    return click.ClickException(f"{message} ({service} at {address})")


@contextlib.contextmanager
def calling(service: str, address: str) -> Iterator[None]:
    """The calls inside, whose domain errors end the command with one line (service_error)."""
    try:
        yield
    except DomainError as error:
        raise service_error(error, service, address) from None


_HOW_TO_SET = {
    "placement": ("--placement", PLACEMENT_ENV),
    "profile store": ("--store", STORE_ENV),
    "profiler": ("--profiler", PROFILER_ENV),
}
