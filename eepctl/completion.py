"""Shell completion, generated from the CLI itself by typer/click's completion support."""

from __future__ import annotations

import os
import sys

from engine_ext.protocol import DEFAULT_NAMESPACE, UsageError

PROG = "eepctl"
COMPLETE_VAR = "_EEPCTL_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


def install_completion_classes() -> None:
    """Register typer's bash/zsh/fish completion classes with click (cheap, no heavy imports)."""
    from typer._completion_classes import completion_init

    completion_init()


def script(shell: str) -> str:
    if shell not in SHELLS:
        raise UsageError(f"unsupported shell {shell!r}: choose bash, zsh or fish")
    from typer._completion_shared import get_completion_script

    install_completion_classes()
    text = get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell)
    return text if text.endswith("\n") else text + "\n"


def deployment_names() -> list[str]:
    """Deployment names from a reachable cluster; [] quickly and silently otherwise."""
    try:
        from eepctl import cluster

        addr = cluster.resolve_address(None)
        if addr is None:
            return []
        host, port = cluster.parse_address(addr)
        if not cluster.reachable(host, port, 0.3):
            return []
        stdout = sys.stdout
        try:
            cluster.connect(addr, os.environ.get("EEPCTL_NAMESPACE", DEFAULT_NAMESPACE))
        finally:  # connecting diverts stdout to stderr (eepctl.streams); click prints completions there
            sys.stdout = stdout
        from eepctl.core import list_deployments

        return list_deployments(os.environ.get("EEPCTL_NAMESPACE", DEFAULT_NAMESPACE))
    except Exception:
        return []
