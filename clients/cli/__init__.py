"""The `gpuloom` command line. Each command group lives in its own module of this package."""

from __future__ import annotations

import click

from gpuloom import __version__
from gpuloom.clients.cli.jobs import cancel, gpus, list_jobs, run, show_job, submit, watch
from gpuloom.clients.cli.mig import mig
from gpuloom.clients.cli.models import models
from gpuloom.clients.cli.profile import profile
from gpuloom.clients.cli.profiles import profiles
from gpuloom.clients.cli.serve import migrate, serve, up
from gpuloom.clients.cli.sim import sim


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuloom")
def cli() -> None:
    """gpuloom: share GPUs between many jobs while keeping the important ones fast."""


cli.add_command(up)
cli.add_command(serve)
cli.add_command(migrate)
cli.add_command(profiles)
cli.add_command(mig)
cli.add_command(profile)
cli.add_command(sim)
cli.add_command(models)
for command in (submit, list_jobs, show_job, cancel, watch, gpus, run):
    cli.add_command(command)


def main() -> None:
    cli()
