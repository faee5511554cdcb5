"""The `gpuloom` command line. Each command group lives in its own module of this package."""

from __future__ import annotations

import sys

import click

from gpuloom import __version__
from gpuloom.clients.cli.jobs import cancel, gpus, list_jobs, run, show_job, submit, watch
from gpuloom.clients.cli.mig import mig
from gpuloom.clients.cli.profile import profile
from gpuloom.clients.cli.profiles import profiles
from gpuloom.clients.cli.serve import serve, up
from gpuloom.clients.cli.sim import sim
from gpuloom.transport import TransportConfigError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuloom")
def cli() -> None:
    """gpuloom: share GPUs between many jobs while keeping the important ones fast."""


cli.add_command(up)
cli.add_command(serve)
cli.add_command(profiles)
cli.add_command(mig)
cli.add_command(profile)
cli.add_command(sim)
for command in (submit, list_jobs, show_job, cancel, watch, gpus, run):
    cli.add_command(command)


def main() -> None:
    try:
        cli()
    except TransportConfigError as error:  # GPULOOM_TLS_* / GPULOOM_AUTH_* of the client
        click.echo(f"Error: {error}", err=True)
        sys.exit(2)
