"""Options and output helpers every eepctl command shares (eepctl.cli, eepctl.cli_autoscale)."""

from __future__ import annotations

import enum
import os
import sys
from typing import Annotated, Any

import typer

from eepctl import streams


class Output(str, enum.Enum):
    table = "table"
    json = "json"


def complete_name(incomplete: str) -> list[str]:
    """Deployment names from the cluster when one is reachable; silent and quick otherwise."""
    from eepctl.completion import deployment_names

    return [n for n in deployment_names() if n.startswith(incomplete)]


Address = Annotated[
    str | None, typer.Option("--address", envvar="RAY_ADDRESS", show_envvar=True, help="Ray cluster address HOST:PORT.")
]
Namespace = Annotated[str, typer.Option("--namespace", envvar="EEPCTL_NAMESPACE", help="Ray namespace.")]
Name = Annotated[
    str, typer.Option("--name", "-n", envvar="EEPCTL_NAME", help="Deployment name.", autocompletion=complete_name)
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="VLLM_API_KEY",
        show_envvar=True,
        show_default=False,
        help="Bearer key of a vLLM deployment's API server (never printed or stored).",
    ),
]
UpApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="EEPCTL_API_KEY",
        show_envvar=True,
        show_default=False,
        help="Bearer key the deployment's HTTP API (its ingresses) will want; without one, anyone who reaches the port "
        "can send requests. Never printed or stored (only its SHA-256 reaches Ray); VLLM_API_KEY is not read.",
    ),
]
RequestKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        show_default=False,
        help="Bearer key of the deployment's HTTP API (never printed or stored). Default: $EEPCTL_API_KEY for a "
        "reference deployment, $VLLM_API_KEY for a vLLM one.",
    ),
]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="Output format.", case_sensitive=False)]


def target(address: str | None, namespace: str, name: str) -> Any:
    from eepctl.core import Target

    return Target(address, namespace, name).validated()


def target_flags(name: str, namespace: str, address: str | None) -> str:
    """The options that reach this deployment again, for a command printed to be pasted:
    ``--name`` always, ``--namespace`` and ``--address`` where they are not the defaults."""
    from engine_ext.protocol import DEFAULT_NAMESPACE

    return (
        f" --name {name}"
        + (f" --namespace {namespace}" if namespace != DEFAULT_NAMESPACE else "")
        + (f" --address {address}" if address else "")
    )


def emit(text: str) -> None:
    """The command's output, whole. To a file descriptor it goes through ``os.write`` until every
    byte is out: a signal that interrupts a blocked write (a Ctrl-C while a reader lags behind a
    full pipe) made Python's text stream drop the rest without an error (a 200-request load's
    report ended at 64 KiB, exit 0)."""
    out = streams.output()
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # an in-process caller's stream (a test's, a StringIO)
        out.write(text)
        out.flush()
        return
    out.flush()  # what the stream already holds goes first
    data = memoryview(text.encode(getattr(out, "encoding", None) or "utf-8", getattr(out, "errors", None) or "strict"))
    while data:
        data = data[os.write(fd, data) :]


def say(msg: str) -> None:
    sys.stderr.write(msg + "\n")


def note_unused_vllm_key(api_key: str | None) -> None:
    """`up` takes its key from --api-key or EEPCTL_API_KEY: a VLLM_API_KEY in the environment is
    vLLM's, never silently made a reference deployment's key, and said to be left unused."""
    if not api_key and os.environ.get("VLLM_API_KEY"):
        say(
            "note: VLLM_API_KEY is set and not used: a reference deployment's API key comes from --api-key or "
            "EEPCTL_API_KEY"
        )


def width() -> int:
    """The terminal's width on a TTY; 160 when piped (scripts parse -o json, not the table)."""
    import shutil

    return shutil.get_terminal_size((160, 24)).columns if streams.output().isatty() else 160


def plain() -> bool:
    return not streams.output().isatty() or bool(os.environ.get("NO_COLOR"))
