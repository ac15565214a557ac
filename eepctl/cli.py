"""The one typer app: its global options, and every command, registered in the order `--help`
lists them. Commands live by concept (eepctl.cli_lifecycle, cli_status, cli_generate, cli_scale,
cli_events, cli_autoscale); each parses its options, calls one function in eepctl.core, renders."""

from __future__ import annotations

from typing import Annotated

import typer

from eepctl.cli_autoscale import autoscale
from eepctl.cli_events import events
from eepctl.cli_generate import generate
from eepctl.cli_lifecycle import down, repair, up
from eepctl.cli_scale import scale, standby
from eepctl.cli_status import status
from eepctl.options import emit

app = typer.Typer(
    name="eepctl",
    help="Operate elastic expert-parallel MoE deployments on Ray: bring them up, scale them live, watch them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            emit(f"eepctl {version('eepctl')}\n")
        except PackageNotFoundError:  # run from a source tree that was never installed
            emit("eepctl (version unknown: not installed)\n")
        raise typer.Exit()


Debug = Annotated[bool, typer.Option("--debug", "--traceback", help="Re-raise errors with their traceback.")]
Version = Annotated[
    bool, typer.Option("--version", help="Print eepctl's version and exit.", is_eager=True, callback=_print_version)
]
Shell = Annotated[str, typer.Argument(help="bash, zsh or fish.")]


@app.callback()
def _root(debug: Debug = False, version: Version = False) -> None:
    """Global options."""


def completion(shell: Shell) -> None:
    """Print the shell completion script (see the README for installing it)."""
    from eepctl.completion import script

    emit(script(shell))


for command in (up, down, standby, status, generate, scale, events, autoscale, repair, completion):
    app.command(name=command.__name__)(command)
