"""`gpuloom up` and `gpuloom serve`: run the control plane in the foreground."""

from __future__ import annotations

import asyncio

import click

from gpuloom.domain.errors import DomainError
from gpuloom.transport import TransportConfigError


def _run(services: tuple[str, ...]) -> None:
    # Imported here, not at the top: the other commands of the CLI load no service code.
    from gpuloom.services import launcher
    from gpuloom.services.common.settings import SettingsError

    def announce(endpoints: list[launcher.Endpoint]) -> None:
        width = max(len(e.name) for e in endpoints)
        click.echo("gpuloom is running (Ctrl-C or SIGTERM stops it):")
        for endpoint in endpoints:
            click.echo(f"  {endpoint.name:<{width}}  {endpoint.address}")

    try:
        asyncio.run(launcher.run(services, announce))
    except (SettingsError, TransportConfigError) as error:
        raise click.ClickException(str(error)) from None
    except (OSError, DomainError) as error:
        raise click.ClickException(f"cannot start: {error}") from None


@click.command()
def up() -> None:
    """Run the whole control plane on the embedded default (SQLite, in-process cache)."""
    from gpuloom.services.launcher import SERVICES

    _run(SERVICES)


@click.command()
@click.argument(
    "service", type=click.Choice(["profile-store", "profiler", "placement", "dispatcher"])
)
def serve(service: str) -> None:
    """Run one service, configured by GPULOOM_* environment variables (as in containers)."""
    _run((service,))
