"""The `gpuloom` command line. Each command group lives in its own module of this package."""

from __future__ import annotations

import sys
from typing import Any

import click
from click.exceptions import NoArgsIsHelpError

from gpuloom import __version__
from gpuloom.clients.cli.addresses import group_options
from gpuloom.clients.cli.credentials import credentials
from gpuloom.clients.cli.dispatcher import dispatcher
from gpuloom.clients.cli.jobs.gpus import gpus
from gpuloom.clients.cli.jobs.listing import list_jobs
from gpuloom.clients.cli.jobs.one_job import cancel, show_job, watch
from gpuloom.clients.cli.jobs.run import run
from gpuloom.clients.cli.jobs.submit import scale, submit
from gpuloom.clients.cli.mig import mig
from gpuloom.clients.cli.models import models
from gpuloom.clients.cli.profile import profile, profiles_alias
from gpuloom.clients.cli.serve import migrate, serve, up
from gpuloom.clients.cli.sim import sim
from gpuloom.clients.cli.top import top
from gpuloom.transport import TransportConfigError


class UsageFailure(click.ClickException):
    """A usage error as one line, `Error: COMMAND: what is wrong`, exit status 2."""

    exit_code = 2


def _one_line(error: click.UsageError) -> click.ClickException:
    where = f"{error.ctx.command_path}: " if error.ctx is not None else ""
    message = " ".join(error.format_message().split())
    return UsageFailure(f"{where}{message}")


class Cli(click.Group):
    """The `gpuloom` group: a bad option, value, argument or file (click.UsageError, in this
    group or any command under it) is one line naming it, without the usage banner, exit 2.
    A group called without a command still prints its help."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except NoArgsIsHelpError:
            raise
        except click.UsageError as error:
            raise _one_line(error) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise
        except click.UsageError as error:
            raise _one_line(error) from None


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuloom")
@group_options
def cli() -> None:
    """gpuloom: share GPUs between many jobs while keeping the important ones fast."""


cli.add_command(up)
cli.add_command(serve)
cli.add_command(migrate)
cli.add_command(credentials)
cli.add_command(profiles_alias)
cli.add_command(mig)
cli.add_command(profile)
cli.add_command(sim)
cli.add_command(top)
cli.add_command(dispatcher)
cli.add_command(models)
for command in (submit, list_jobs, show_job, cancel, watch, gpus, run, scale):
    cli.add_command(command)


def main() -> None:
    try:
        cli()
    except TransportConfigError as error:  # GPULOOM_TLS_* / GPULOOM_AUTH_* of the client
        click.echo(f"Error: {error}", err=True)
        sys.exit(2)
