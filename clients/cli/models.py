"""`gpuloom models [list|load|unload]`: what a GPU's model store holds (shared model weights,
docs/dispatcher.md "Model sharing"), through that GPU's dispatcher."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import click

from gpuloom.clients.cli.addresses import calling
from gpuloom.clients.cli.table import echo_table
from gpuloom.clients.models import ADDRESS_VARIABLE, DEFAULT_ADDRESS, ModelsClient
from gpuloom.convert.json_mapping import message_json
from gpuloom.v1 import dispatcher_pb2 as pb

dispatcher_option = click.option(
    "--dispatcher",
    "address",
    envvar=ADDRESS_VARIABLE,
    default=DEFAULT_ADDRESS,
    show_default=True,
    help=f"The GPU's dispatcher (env {ADDRESS_VARIABLE}).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@contextlib.contextmanager
def _client(address: str) -> Iterator[ModelsClient]:
    with calling("dispatcher", address), ModelsClient(address) as client:
        yield client


def _show(listing: pb.ListModelsResponse, as_json: bool) -> None:
    if as_json:  # the ListModelsResponse message
        click.echo(json.dumps(message_json(listing), indent=2))
        return
    click.echo(f"GPU {listing.gpu.gpu_uuid} on {listing.gpu.node}: {listing.store_bytes:,} bytes")
    rows = [
        (m.name, m.model_id, m.bytes / (1 << 20), m.tensor_count, len(m.replicas), m.path)
        for m in listing.models
    ]
    echo_table(["NAME", "ID", "MIB", "TENSORS", "REPLICAS", "FILE"], rows)


@click.group(invoke_without_command=True)
@dispatcher_option
@json_option
@click.pass_context
def models(ctx: click.Context, address: str, as_json: bool) -> None:
    """What a GPU's model store holds: name, bytes, replicas attached (the default: `list`)."""
    if ctx.invoked_subcommand is None:
        with _client(address) as client:
            _show(client.list(), as_json)


@models.command("list")
@dispatcher_option
@json_option
def list_models(address: str, as_json: bool) -> None:
    """What the store holds."""
    with _client(address) as client:
        _show(client.list(), as_json)


@models.command("load")
@click.argument("name")
@click.argument("path")
@dispatcher_option
@json_option
def load(name: str, path: str, address: str, as_json: bool) -> None:
    """Load the weights file PATH (in the dispatcher's GPULOOM_DISPATCHER_MODELS_DIR) as NAME."""
    with _client(address) as client:
        answer = client.load(name, path)
    if as_json:
        click.echo(json.dumps(message_json(answer), indent=2))  # the LoadModelResponse
    else:
        verb = "loaded" if answer.loaded else "already loaded"
        click.echo(f"{answer.model.model_id} {verb}: {answer.model.bytes:,} bytes")


@models.command("unload")
@click.argument("name")
@click.option("--force", is_flag=True, help="Unload even with replicas attached.")
@dispatcher_option
def unload(name: str, force: bool, address: str) -> None:
    """Free NAME's device memory."""
    with _client(address) as client:
        model = client.unload(name, force)
    click.echo(f"{model.model_id} unloaded: {model.bytes:,} bytes freed")
