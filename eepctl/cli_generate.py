"""`eepctl generate`: prompts through the deployment's completions endpoint, their outputs
streamed; with --rate, open-loop load measured (registered by eepctl.cli)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from eepctl import interrupt, streams
from eepctl.options import Address, Name, Namespace, Output, OutputOpt, RequestKey, emit, say, target
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE, UsageError

PromptIds = Annotated[
    list[str] | None,
    typer.Option("--prompt-ids", "-p", help="A prompt as comma-separated token ids; repeat for more."),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="Tokens to generate per prompt.")]
Rate = Annotated[float | None, typer.Option("--rate", help="Turn into a load generator: requests per second.")]
Duration = Annotated[float, typer.Option("--duration", help="Seconds of load with --rate.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for each answer, counted from its sending.")]


def generate(
    prompt_ids: PromptIds = None,
    max_tokens: MaxTokens = 8,
    rate: Rate = None,
    duration: Duration = 10.0,
    timeout: Timeout = 300.0,
    api_key: RequestKey = None,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Send prompts (a built-in set by default) and print the outputs as they stream; with --rate, measure load.

    Through the deployment's OpenAI completions endpoint, whatever engine serves it: the ingress
    URLs `eepctl status` shows (a vLLM deployment: its API server). A request dropped there (an
    ingress restarting, HTTP 503) is re-sent from its prompt, with a note on stderr."""
    from eepctl import core, render

    prompts = [_parse_prompt(p) for p in prompt_ids] if prompt_ids else core.DEFAULT_PROMPTS
    t = target(address, namespace, name)
    leaves = "requests already sent finish in the cluster, their answers unreported"
    if rate is not None:
        from eepctl.loadgen import interrupt_ends_sending

        with interrupt.doing(f"load on {name} ({rate:g} requests/s)", leaves):
            res = core.load(t, prompts, max_tokens, rate, duration, timeout, api_key=api_key, note=_note)
        with interrupt_ends_sending():  # a first Ctrl-C while the report is printed ends nothing
            emit(render.to_json("load", res) + "\n" if output == Output.json else render.load_text(res))
        if res["failed"]:
            raise typer.Exit(5)
        return
    hooks: dict[str, Any] = {}
    if output != Output.json:  # each line as it streams
        from eepctl.streamed import StreamedLines

        lines = StreamedLines(prompts, streams.output())
        hooks = {"on_token": lines.on_token, "on_answer": lines.on_answer}
    with interrupt.doing(f"generate on {name}", leaves):
        res = core.generate(t, prompts, max_tokens, timeout, api_key=api_key, note=_note, **hooks)
    if output == Output.json:
        emit(render.to_json("generate", res) + "\n")
    if any(r["error"] for r in res["results"]):
        raise typer.Exit(5)


def _note(line: str) -> None:
    say(f"note: {line}")


def _parse_prompt(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise UsageError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids
