"""`eepctl up`, `down` and `repair`: a deployment's life. Each parses its options, calls one
function in eepctl.core, renders (registered by eepctl.cli)."""

from __future__ import annotations

from typing import Annotated

import typer

from eepctl import interrupt
from eepctl.options import (
    Address,
    ApiKey,
    Name,
    Namespace,
    Output,
    OutputOpt,
    UpApiKey,
    emit,
    note_unused_vllm_key,
    plain,
    say,
    target,
)
from eepctl.options_up import (
    CapturePolicy,
    CpusPerRank,
    Dp,
    Dtype,
    Experts,
    GpusPerRank,
    HealthDeadline,
    Hidden,
    Host,
    Ifname,
    Ingress,
    Layers,
    MaxDp,
    MaxNumSeqs,
    MaxNumTokens,
    OnRankFailure,
    Placement,
    Port,
    Seed,
    SlotsPerRank,
    Standby,
    Timeout,
    TopK,
    Transport,
    up_arguments,
)
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE

StopCluster = Annotated[
    bool, typer.Option("--stop-cluster", help="Also stop the local Ray cluster, if eepctl started it.")
]
RepairTimeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the repair.")]


def up(
    ctx: typer.Context,
    dp: Dp = 2,
    max_dp: MaxDp = 8,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    experts: Experts = 8,
    slots_per_rank: SlotsPerRank = 8,
    top_k: TopK = 2,
    layers: Layers = 2,
    hidden: Hidden = 64,
    max_num_seqs: MaxNumSeqs = 8,
    max_num_tokens: MaxNumTokens = 64,
    dtype: Dtype = "float32",
    seed: Seed = 0,
    cpus_per_rank: CpusPerRank = 1.0,
    gpus_per_rank: GpusPerRank = 0.0,
    timeout: Timeout = 300.0,
    on_rank_failure: OnRankFailure = "replace",
    placement: Placement = "pack",
    ifname: Ifname = "",
    standby: Standby = 0,
    capture_policy: CapturePolicy = "auto",
    transport: Transport = "auto",
    health_deadline: HealthDeadline = 5.0,
    ingress: Ingress = 1,
    host: Host = "0.0.0.0",
    port: Port = 0,
    api_key: UpApiKey = None,
    output: OutputOpt = Output.table,
) -> None:
    """Start a reference deployment (and a local Ray head if none is running)."""
    from eepctl import core, render
    from eepctl.progress import busy

    arguments = up_arguments(ctx.params)  # the options' values by name: core.up's arguments
    note_unused_vllm_key(api_key)
    doing = f"starting {name} at DP {dp}"
    with (
        busy(doing, plain=plain() or output == Output.json),
        interrupt.doing(doing, f"what was started keeps running: `eepctl down --name {name}` removes it"),
    ):
        res = core.up(target(address, namespace, name), say=say, **arguments)
    emit(render.to_json("up", res) + "\n" if output == Output.json else render.up_text(res))


def down(
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    stop_cluster: StopCluster = False,
    output: OutputOpt = Output.table,
) -> None:
    """Stop a deployment."""
    from eepctl import core, render
    from eepctl.progress import busy

    with busy(f"stopping {name}", plain=plain() or output == Output.json):
        res = core.down(target(address, namespace, name), stop_cluster=stop_cluster)
    emit(render.to_json("down", res) + "\n" if output == Output.json else render.down_text(res))


def repair(
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    timeout: RepairTimeout = 300.0,
    api_key: ApiKey = None,
    output: OutputOpt = Output.table,
) -> None:
    """Recover what self-healing could not (dead ranks, a size below the desired one); say what was done."""
    from eepctl import core, render

    with interrupt.doing(
        f"repairing {name}", f"the repair continues in the cluster: `eepctl status --name {name}` shows it"
    ):
        res = core.repair(target(address, namespace, name), timeout_s=timeout, api_key=api_key)
    if output == Output.json:
        emit(render.to_json("repair", res) + "\n")
    else:
        emit("\n".join(f"repair: {a}" for a in res.get("actions", [])) + "\n")
    core.check_repair(res)  # what it did is printed; a failed action makes it exit 5
