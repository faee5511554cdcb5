"""`gpuloom credentials`: the credentials directory of a deployment (gpuloom/credentials.py):
make it (`init`: compose's one-shot job, the source of the Kubernetes Secret), add a token for
someone (`add`), print the admin token for a grpcurl header (`token`), or say what is there
(`show`)."""

from __future__ import annotations

from pathlib import Path

import click

from gpuloom.credentials import (
    ADMIN,
    KUBERNETES_COMPONENTS,
    KUBERNETES_SCHEDULER,
    ROLES,
    SERVICES,
    Credentials,
    CredentialsError,
    add_token,
    default_directory,
    ensure,
    ensure_kubernetes,
)

_dir_option = click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The credentials directory (default: GPULOOM_CREDENTIALS_DIR, else "
    "$XDG_CONFIG_HOME/gpuloom, else ~/.config/gpuloom).",
)


@click.group("credentials")
def credentials() -> None:
    """The deployment's CA, certificates and bearer tokens (docs/security.md)."""


@credentials.command("init")
@_dir_option
@click.option(
    "--name",
    "names",
    multiple=True,
    metavar="HOST",
    help="A further host name or IP address for the service certificates (repeatable).",
)
@click.option(
    "--plaintext-clients",
    is_flag=True,
    help="The client settings made (client.env) call without TLS: for a plane served on "
    "127.0.0.1 only.",
)
@click.option(
    "--kubernetes",
    is_flag=True,
    help="Also what gpuloom's Kubernetes components need (deploy/k8s): a certificate and a "
    "token each for the k8s process and the device plugins, both tokens the submitter "
    "`kubernetes`'s, and a client certificate for gpuloom's kube-scheduler.",
)
@click.option(
    "--namespace",
    default=None,
    help="With --kubernetes: the namespace gpuloom is installed in (the k8s process's "
    "certificate names its Service there)  [default: gpuloom]",
)
def init(
    directory: Path | None,
    names: tuple[str, ...],
    plaintext_clients: bool,
    kubernetes: bool,
    namespace: str | None,
) -> None:
    """Make what is missing of the credentials directory: a CA, a certificate per service, the
    admin's client certificate, the tokens (services, admin) and the client settings; every
    file 0600 in a 0700 directory. Nothing there is replaced: run it again at will."""
    where = directory or default_directory()
    try:
        if namespace is not None and not kubernetes:
            raise CredentialsError("--namespace goes with --kubernetes")
        if kubernetes:
            if plaintext_clients:
                raise CredentialsError("--kubernetes serves TLS: not with --plaintext-clients")
            made = ensure_kubernetes(where, namespace or "gpuloom", names)
        else:
            made = ensure(where, names, client_tls=not plaintext_clients)
    except CredentialsError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"credentials in {made.directory}")


@credentials.command("add")
@_dir_option
@click.argument("name")
@click.option(
    "--role", type=click.Choice(ROLES), default="submitter", show_default=True, help="Its role."
)
def add(directory: Path | None, name: str, role: str) -> None:
    """Give NAME a bearer token: added to the tokens file (the services read it within a
    second) and written to NAME.token, which NAME then uses (GPULOOM_AUTH_TOKEN_FILE)."""
    try:
        path = add_token(directory or default_directory(), name, role)
    except (CredentialsError, OSError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{role} {name}: token in {path}")


@credentials.command("token")
@_dir_option
def token(directory: Path | None) -> None:
    """Print the admin token, e.g. for grpcurl:
    -H "authorization: Bearer $(gpuloom credentials token)"."""
    path = Credentials(directory or default_directory()).admin_token
    try:
        click.echo(path.read_text().strip())
    except OSError as error:
        raise click.ClickException(
            f"{path}: {error.strerror}: no credentials there (`gpuloom up` makes them on its "
            "first start; `gpuloom credentials init` makes them for a deployment)"
        ) from None


@credentials.command("show")
@_dir_option
def show(directory: Path | None) -> None:
    """Say which credentials files are there (no secret is printed)."""
    made = Credentials(directory or default_directory())
    click.echo(f"directory: {made.directory}")
    files = [
        ("CA", made.ca),
        ("tokens file", made.tokens),
        ("services' token", made.service_token),
        ("admin token", made.admin_token),
        *((f"{who} certificate", made.certificate(who)[0]) for who in (*SERVICES, ADMIN)),
        *(
            (f"{who} certificate", made.certificate(who)[0])
            for who in (*KUBERNETES_COMPONENTS, KUBERNETES_SCHEDULER)
        ),
        *((f"{who} token", made.file(f"{who}.token")) for who in KUBERNETES_COMPONENTS),
        ("client settings", made.file("client.env")),
    ]
    for what, path in files:
        click.echo(f"  {what:<26} {path.name:<22} {'present' if path.is_file() else 'missing'}")
