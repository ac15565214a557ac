"""`eepctl scale` and `standby`: a deployment's width, changed while it serves, and the ranks
kept launched ahead for a scale-up. Each parses its options, calls one function in eepctl.core,
renders (registered by eepctl.cli)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from eepctl import interrupt
from eepctl.options import (
    Address,
    ApiKey,
    Name,
    Namespace,
    Output,
    OutputOpt,
    emit,
    plain,
    target,
    target_flags,
)
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE, UsageError

Dp = Annotated[int, typer.Option("--dp", help="Target data-parallel size (absolute).")]
DrainTimeout = Annotated[
    float, typer.Option("--drain-timeout", help="Seconds removing ranks may finish requests before they move.")
]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds the whole transition may take (exit 6 after).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan and change nothing.")]
NoWait = Annotated[bool, typer.Option("--no-wait", help="Print the operation id and return.")]
RequestId = Annotated[
    str | None,
    typer.Option(
        "--request-id",
        help="Idempotency key: a retry with the same id returns the same operation instead of starting another.",
        show_default=False,
    ),
]
Retire = Annotated[
    str | None,
    typer.Option(
        "--retire",
        help="A scale-down removes these ranks (comma-separated; as many as it removes). Default: the ranks with "
        "the fewest requests and least KV in use.",
    ),
]
Verbose = Annotated[
    bool,
    typer.Option("--verbose", "-v", help="Live display: add one row per rank; off a terminal: each rank's events too."),
]
Count = Annotated[int, typer.Option("--count", help="Ranks to keep launched ahead (0 stops them).")]


def scale(
    dp: Dp,
    drain_timeout: DrainTimeout = 30.0,
    timeout: Timeout = 300.0,
    dry_run: DryRun = False,
    no_wait: NoWait = False,
    request_id: RequestId = None,
    retire: Retire = None,
    verbose: Verbose = False,
    api_key: ApiKey = None,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Scale the deployment's DP size up or down while it serves."""
    from eepctl import core, render
    from eepctl.progress import ScaleProgress

    t = target(address, namespace, name)
    leaving = _parse_ranks(retire, "--retire")
    if dry_run:
        plan = core.plan(t, dp, api_key=api_key, retire=leaving)
        emit(render.to_json("plan", plan) + "\n" if output == Output.json else render.plan_text(plan))
        return
    progress = ScaleProgress(json_lines=output == Output.json, plain=plain(), verbose=verbose)
    flags = target_flags(name, namespace, address)
    with (
        progress,
        interrupt.doing(
            f"asking {name} to scale to DP {dp}", f"the scale may have been admitted: `eepctl status{flags}`"
        ),
    ):
        res = core.scale(
            t,
            dp,
            drain_timeout_s=drain_timeout,
            timeout_s=timeout,
            wait=not no_wait,
            on_event=progress.on_event,
            api_key=api_key,
            on_op=_following(name, dp, flags, progress.on_operation),
            request_id=request_id,
            retire=leaving,
        )
    emit(render.to_json("scale", res) + "\n" if output == Output.json else render.scale_text(res, flags))


def _following(
    name: str, dp: int, flags: str, on_operation: Callable[[dict[str, Any]], None]
) -> Callable[[dict[str, Any]], None]:
    """The scale's ``on_op``: once the operation has an id, an interrupt says how to follow it on."""

    def on_op(op: dict[str, Any]) -> None:
        if op.get("op_id"):
            interrupt.now_doing(
                f"following scale {op['op_id']} of {name} to DP {dp}",
                f"the scale continues in the cluster: `eepctl events{flags} --op {op['op_id']} --follow`",
            )
        on_operation(op)

    return on_op


def _parse_ranks(text: str | None, option: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise UsageError(f"{option} takes comma-separated rank numbers, got {text!r}") from None


def standby(
    count: Count,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
    timeout: Annotated[float, typer.Option(help="Seconds to wait until they are ready.")] = 600.0,
) -> None:
    """Keep COUNT ranks launched ahead (on vLLM: engine cores prepared); a scale-up takes them first."""
    from eepctl import core, render
    from eepctl.render_standby import standby_text

    res = core.standby(target(address, namespace, name), count, timeout)
    emit(render.to_json("standby", res) + "\n" if output == Output.json else standby_text(name, res))
