"""`gpuloom up` and `gpuloom serve`: run the control plane in the foreground; `gpuloom migrate`:
bring the services' databases to their newest schema and exit."""

from __future__ import annotations

import asyncio

import click

from gpuloom.domain.errors import DomainError
from gpuloom.transport import TransportConfigError


def _run(services: tuple[str, ...], embedded: bool = False) -> None:
    # Imported here, not at the top: the other commands of the CLI load no service code.
    from gpuloom.services import launcher
    from gpuloom.services.common.settings import SettingsError

    def announce(endpoints: list[launcher.Endpoint]) -> None:
        width = max(len(e.name) for e in endpoints)
        click.echo("gpuloom is running (Ctrl-C or SIGTERM stops it):")
        for endpoint in endpoints:
            click.echo(f"  {endpoint.name:<{width}}  {endpoint.address}")

    try:
        asyncio.run(launcher.run(services, announce, embedded))
    except (SettingsError, TransportConfigError) as error:
        raise click.ClickException(str(error)) from None
    except (OSError, DomainError) as error:
        raise click.ClickException(f"cannot start: {error}") from None


@click.command()
def up() -> None:
    """Run the whole control plane on the embedded default (SQLite, in-process cache).

    Secured by the credentials directory (GPULOOM_CREDENTIALS_DIR, else ~/.config/gpuloom),
    made on the first start: on 127.0.0.1 every change and every token needs the admin token
    there, which the CLI finds by itself (docs/security.md). Configured by GPULOOM_* environment
    variables (ports, data directory, simulated GPUs, policies, ...): every one is in
    docs/configuration.md."""
    from gpuloom.services.launcher import SERVICES

    _run(SERVICES, embedded=True)


@click.command()
@click.argument(
    "service",
    type=click.Choice(
        ["profile-store", "profiler", "placement", "dispatcher", "k8s", "device-plugin"]
    ),
)
def serve(service: str) -> None:
    """Run one service, configured by GPULOOM_* environment variables (as in containers):
    GPULOOM_* for every process and GPULOOM_<SERVICE>_* for SERVICE (GPULOOM_PROFILE_STORE_*,
    GPULOOM_PROFILER_*, GPULOOM_PLACEMENT_*, GPULOOM_DISPATCHER_*, GPULOOM_K8S_*,
    GPULOOM_DEVICE_PLUGIN_*); every one is in docs/configuration.md. `k8s` and
    `device-plugin` are gpuloom's Kubernetes components (docs/deploy.md). It serves with the
    credentials directory that `gpuloom credentials init` made (or GPULOOM_TLS_* /
    GPULOOM_AUTH_TOKENS_FILE), and refuses to start without."""
    _run((service,))


@click.command()
@click.argument("services", nargs=-1, type=click.Choice(["profile-store", "placement"]))
def migrate(services: tuple[str, ...]) -> None:
    """Apply the database migrations of the profile store and placement (or of the SERVICES
    named), configured by the same GPULOOM_* variables as the services, then exit.

    The one-shot job of compose.yaml and deploy/k8s/ runs it before the services start (they
    run with GPULOOM_*_AUTO_MIGRATE=false there). Idempotent."""
    from sqlalchemy.exc import SQLAlchemyError

    from gpuloom.services import launcher
    from gpuloom.services.common.settings import SettingsError

    try:
        done = asyncio.run(launcher.migrate(services or launcher.DATABASE_SERVICES))
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    except (OSError, DomainError, SQLAlchemyError) as error:
        raise click.ClickException(f"cannot migrate: {error}") from None
    for migrated in done:
        click.echo(f"{migrated.service}: {migrated.database} at revision {migrated.revision}")
