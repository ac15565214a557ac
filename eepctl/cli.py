"""The typer commands. Each parses its options, calls one function in eepctl.core, renders."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from eepctl import interrupt, streams
from eepctl.cli_autoscale import autoscale
from eepctl.cli_events import events
from eepctl.options import Address, ApiKey, Name, Namespace, Output, OutputOpt, RequestKey, UpApiKey
from eepctl.options import emit as _emit
from eepctl.options import note_unused_vllm_key as _note_unused_vllm_key
from eepctl.options import plain as _plain
from eepctl.options import say as _say
from eepctl.options import target as _target
from eepctl.options import target_flags as _target_flags
from eepctl.options import width as _width
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE, UsageError

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
            _emit(f"eepctl {version('eepctl')}\n")
        except PackageNotFoundError:  # run from a source tree that was never installed
            _emit("eepctl (version unknown: not installed)\n")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", "--traceback", help="Re-raise errors with their traceback.")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", help="Print eepctl's version and exit.", is_eager=True, callback=_print_version)
    ] = False,
) -> None:
    """Global options."""


@app.command()
def up(
    dp: Annotated[int, typer.Option("--dp", help="Initial data-parallel size.")] = 2,
    max_dp: Annotated[int, typer.Option("--max-dp", help="Largest DP size scale may reach.")] = 8,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    experts: Annotated[int, typer.Option(help="Logical experts per MoE layer.")] = 8,
    slots_per_rank: Annotated[
        int, typer.Option(help="Physical expert slots per rank (redundant = slots*DP - experts).")
    ] = 8,
    top_k: Annotated[int, typer.Option(help="Experts per token.")] = 2,
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = 2,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 64,
    max_num_seqs: Annotated[int, typer.Option(help="Request slots per rank.")] = 8,
    max_num_tokens: Annotated[int, typer.Option(help="Tokens per step per rank.")] = 64,
    dtype: Annotated[str, typer.Option(help="float32 or float64 (bfloat16/float16 on GPU).")] = "float32",
    seed: Annotated[int, typer.Option(help="Weights seed.")] = 0,
    cpus_per_rank: Annotated[float, typer.Option(help="Ray CPUs per rank.")] = 1.0,
    gpus_per_rank: Annotated[float, typer.Option(help="Ray GPUs per rank (0: CPU ranks).")] = 0.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait until every rank serves.")] = 300.0,
    on_rank_failure: Annotated[
        str,
        typer.Option(
            help="When a rank dies: shrink (serve at the healthy size) "
            "or replace (shrink, then grow back to the desired size)."
        ),
    ] = "replace",
    placement: Annotated[
        str, typer.Option(help="Ranks over Ray nodes: pack, spread or strict-spread (one per node).")
    ] = "pack",
    ifname: Annotated[
        str,
        typer.Option(
            help="Network interface ranks bind (store, gloo); default: the node IP Ray reports. Env EEPCTL_IFNAME."
        ),
    ] = "",
    standby: Annotated[
        int,
        typer.Option(
            "--standby",
            help="Ranks to keep launched ahead (model and KV loaded, in no DP group): a scale-up adopts them and skips its launch phase.",
        ),
    ] = 0,
    capture_policy: Annotated[
        str,
        typer.Option(
            "--capture-policy",
            help=(
                "reuse: size workspace and captures for --max-dp at start; survivors re-warm and capture nothing in "
                "a scale, a joiner once (more workspace, fewer KV blocks); recapture: re-warm and capture on every "
                "rank in each scale, workspace right-sized; auto: reuse where the KV pool left beside its workspace "
                "still holds --max-num-seqs requests of max_model_len, else recapture (up says which)."
            ),
        ),
    ] = "auto",
    transport: Annotated[
        str,
        typer.Option(
            "--transport",
            help="The per-step collectives: auto (shared memory when every rank of a world shares one host, gloo otherwise; chosen again at every transition), or gloo (TCP always).",
        ),
    ] = "auto",
    health_deadline: Annotated[
        float,
        typer.Option(
            "--health-deadline",
            help="Seconds a rank may stay silent (no probe answer, token or result) before it is fenced and recovered around; also how long a serving step waits for a peer.",
        ),
    ] = 5.0,
    ingress: Annotated[
        int,
        typer.Option(
            "--ingress",
            help="Ingress actors (requests enter there, HTTP and Ray calls; spread over nodes, the head first).",
        ),
    ] = 1,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help=(
                "IPv4 address the ingresses' HTTP API listens on: 0.0.0.0 (every interface of its node), 127.0.0.1 "
                "(the node itself only) or one of the node's addresses."
            ),
        ),
    ] = "0.0.0.0",
    port: Annotated[
        int,
        typer.Option(
            "--port",
            help=(
                "The first ingress's HTTP port; ingress i listens on PORT+i, also after a restart (a port that is taken "
                "fails `up`, exit 4). 0: any free port, kept across restarts while free."
            ),
        ),
    ] = 0,
    api_key: UpApiKey = None,
    output: OutputOpt = Output.table,
) -> None:
    """Start a reference deployment (and a local Ray head if none is running)."""
    from eepctl import core, render

    sizes = {
        "num_experts": experts,
        "slots_per_rank": slots_per_rank,
        "top_k": top_k,
        "num_layers": layers,
        "hidden_size": hidden,
        "max_num_seqs": max_num_seqs,
        "max_num_tokens": max_num_tokens,
    }
    engine = _engine_options(sizes, dtype, seed, capture_policy, transport, health_deadline)
    from eepctl.progress import busy

    _note_unused_vllm_key(api_key)
    with (
        busy(f"starting {name} at DP {dp}", plain=_plain() or output == Output.json),
        interrupt.doing(
            f"starting {name} at DP {dp}", f"what was started keeps running: `eepctl down --name {name}` removes it"
        ),
    ):
        res = core.up(
            _target(address, namespace, name),
            dp=dp,
            max_dp=max_dp,
            engine=engine,
            cpus_per_rank=cpus_per_rank,
            gpus_per_rank=gpus_per_rank,
            timeout_s=timeout,
            say=_say,
            placement={"policy": placement, "ifname": ifname},
            on_rank_failure=on_rank_failure,
            standby=standby,
            health_deadline_s=health_deadline,
            ingress=ingress,
            api_key=api_key,
            host=host,
            port=port,
        )
    _emit(render.to_json("up", res) + "\n" if output == Output.json else render.up_text(res))


def _engine_options(
    sizes: dict[str, int], dtype: str, seed: int, capture_policy: str, transport: str, health_deadline: float
) -> dict[str, Any]:
    """The engine config `up`'s options describe; a bad value is named by its option (the config
    validates it too)."""
    from engine_ext.config import CapturePolicy

    if dtype not in ("float32", "float64", "bfloat16", "float16"):
        raise UsageError(f"--dtype must be float32, float64, bfloat16 or float16, not {dtype!r}")
    try:
        CapturePolicy.parse(capture_policy, "--capture-policy")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if transport not in ("gloo", "auto"):
        raise UsageError(f"--transport must be gloo or auto, not {transport!r}")
    return {
        **sizes,
        "dtype": dtype,
        "seed": seed,
        "capture_sizes": [s for s in (1, 2, 4, 8, 16, 32) if s <= sizes["max_num_seqs"]],
        "capture_policy": capture_policy,
        "transport": transport,
        "step_timeout_s": health_deadline,
    }


@app.command()
def down(
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    stop_cluster: Annotated[
        bool, typer.Option("--stop-cluster", help="Also stop the local Ray cluster, if eepctl started it.")
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Stop a deployment."""
    from eepctl import core, render
    from eepctl.progress import busy

    with busy(f"stopping {name}", plain=_plain() or output == Output.json):
        res = core.down(_target(address, namespace, name), stop_cluster=stop_cluster)
    _emit(render.to_json("down", res) + "\n" if output == Output.json else render.down_text(res))


@app.command()
def standby(
    count: Annotated[int, typer.Option("--count", help="Ranks to keep launched ahead (0 stops them).")],
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Keep COUNT ranks launched ahead in the standby pool (a scale-up takes its joiners there first)."""
    from eepctl import core, render

    res = core.standby(_target(address, namespace, name), count)
    _emit(
        render.to_json("standby", res) + "\n"
        if output == Output.json
        else f"standby pool of {name}: {len(res['ready'])} of {res['size']} ready (standby numbers {res['ready']}), "
        f"{res['taken']} adopted so far\n"
    )


@app.command()
def status(
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place until interrupted.")] = False,
    interval: Annotated[float, typer.Option(help="Refresh interval for --watch, seconds.")] = 1.0,
    state: Annotated[
        list[str] | None, typer.Option("--state", help="Only ranks in this state (repeat or comma-separate).")
    ] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only ranks on this node (its id or IP).")] = None,
) -> None:
    """Per-rank status: state, requests, slots, KV, workspace, graphs, EPLB, heartbeat.

    Ranks needing attention (failed, stale, not serving) come first."""
    from eepctl import core, render

    t = _target(address, namespace, name)
    read = core.status_reader(t)  # resolves the deployment once: one registry call per refresh after

    def snap() -> dict[str, Any]:
        return render.filter_ranks(read(), state, node)

    if not watch:
        data = snap()
        _emit(
            render.to_json("status", data) + "\n" if output == Output.json else render.status_text(data, width=_width())
        )
        return
    if output == Output.json:
        while True:
            _emit(render.to_json("status", snap()) + "\n")
            time.sleep(interval)
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    with Live(Text(""), console=Console(file=streams.output()), auto_refresh=False, screen=False) as live:
        while True:
            t0 = time.time()
            rows = max(1, live.console.height - 12)  # the table fits the screen; the rest is counted
            live.update(Text(render.status_text(snap(), width=live.console.width, max_rows=rows)), refresh=True)
            time.sleep(max(0.0, interval - (time.time() - t0)))


@app.command()
def generate(
    prompt_ids: Annotated[
        list[str] | None,
        typer.Option("--prompt-ids", "-p", help="A prompt as comma-separated token ids; repeat for more."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 8,
    rate: Annotated[float | None, typer.Option(help="Turn into a load generator: requests per second.")] = None,
    duration: Annotated[float, typer.Option(help="Seconds of load with --rate.")] = 10.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer, counted from its sending.")] = 300.0,
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
    t = _target(address, namespace, name)
    leaves = "requests already sent finish in the cluster, their answers unreported"
    if rate is not None:
        from eepctl.loadgen import interrupt_ends_sending

        with interrupt.doing(f"load on {name} ({rate:g} requests/s)", leaves):
            res = core.load(t, prompts, max_tokens, rate, duration, timeout, api_key=api_key, note=_note)
        with interrupt_ends_sending():  # a first Ctrl-C while the report is printed ends nothing
            _emit(render.to_json("load", res) + "\n" if output == Output.json else render.load_text(res))
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
        _emit(render.to_json("generate", res) + "\n")
    if any(r["error"] for r in res["results"]):
        raise typer.Exit(5)


def _note(line: str) -> None:
    _say(f"note: {line}")


def _parse_prompt(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise UsageError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


@app.command()
def scale(
    dp: Annotated[int, typer.Option("--dp", help="Target data-parallel size (absolute).")],
    drain_timeout: Annotated[
        float, typer.Option(help="Seconds removing ranks may finish requests before they move.")
    ] = 30.0,
    timeout: Annotated[float, typer.Option(help="Seconds the whole transition may take (exit 6 after).")] = 300.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and change nothing.")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the operation id and return.")] = False,
    request_id: Annotated[
        str | None,
        typer.Option(
            "--request-id",
            help="Idempotency key: a retry with the same id returns the same operation instead of starting another.",
            show_default=False,
        ),
    ] = None,
    retire: Annotated[
        str | None,
        typer.Option(
            "--retire",
            help="A scale-down removes these ranks (comma-separated; as many as it removes). Default: the ranks with the fewest requests and least KV in use.",
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Live display: add one row per rank; off a terminal: each rank's events too."
        ),
    ] = False,
    api_key: ApiKey = None,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Scale the deployment's DP size up or down while it serves."""
    from eepctl import core, render
    from eepctl.progress import ScaleProgress

    t = _target(address, namespace, name)
    leaving = _parse_ranks(retire, "--retire")
    if dry_run:
        plan = core.plan(t, dp, api_key=api_key, retire=leaving)
        _emit(render.to_json("plan", plan) + "\n" if output == Output.json else render.plan_text(plan))
        return
    progress = ScaleProgress(json_lines=output == Output.json, plain=_plain(), verbose=verbose)

    flags = _target_flags(name, namespace, address)

    def on_op(op: dict[str, Any]) -> None:
        if op.get("op_id"):
            interrupt.now_doing(
                f"following scale {op['op_id']} of {name} to DP {dp}",
                f"the scale continues in the cluster: `eepctl events{flags} --op {op['op_id']} --follow`",
            )
        progress.on_operation(op)

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
            on_op=on_op,
            request_id=request_id,
            retire=leaving,
        )
    _emit(render.to_json("scale", res) + "\n" if output == Output.json else render.scale_text(res, flags))


def _parse_ranks(text: str | None, option: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise UsageError(f"{option} takes comma-separated rank numbers, got {text!r}") from None


app.command(name="events")(events)
app.command(name="autoscale")(autoscale)


@app.command()
def repair(
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the repair.")] = 300.0,
    api_key: ApiKey = None,
    output: OutputOpt = Output.table,
) -> None:
    """Recover what self-healing could not (dead ranks, a size below the desired one); say what was done."""
    from eepctl import core, render

    with interrupt.doing(
        f"repairing {name}", f"the repair continues in the cluster: `eepctl status --name {name}` shows it"
    ):
        res = core.repair(_target(address, namespace, name), timeout_s=timeout, api_key=api_key)
    if output == Output.json:
        _emit(render.to_json("repair", res) + "\n")
    else:
        _emit("\n".join(f"repair: {a}" for a in res.get("actions", [])) + "\n")
    core.check_repair(res)  # what it did is printed; a failed action makes it exit 5


@app.command()
def completion(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.")],
) -> None:
    """Print the shell completion script (see the README for installing it)."""
    from eepctl.completion import script

    _emit(script(shell))
