"""`eepctl up`'s options, what a deployment is made of: the engine's sizes, its ranks and where
they run, what a rank's failure does, its HTTP front door; and the core call they describe."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from engine_ext.protocol import UsageError

Dp = Annotated[int, typer.Option("--dp", help="Initial data-parallel size.")]
MaxDp = Annotated[int, typer.Option("--max-dp", help="Largest DP size scale may reach.")]
Experts = Annotated[int, typer.Option("--experts", help="Logical experts per MoE layer.")]
SlotsPerRank = Annotated[
    int, typer.Option("--slots-per-rank", help="Physical expert slots per rank (redundant = slots*DP - experts).")
]
TopK = Annotated[int, typer.Option("--top-k", help="Experts per token.")]
Layers = Annotated[int, typer.Option("--layers", help="Decoder layers.")]
Hidden = Annotated[int, typer.Option("--hidden", help="Hidden size.")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Request slots per rank.")]
MaxNumTokens = Annotated[int, typer.Option("--max-num-tokens", help="Tokens per step per rank.")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32 or float64 (bfloat16/float16 on GPU).")]
Seed = Annotated[int, typer.Option("--seed", help="Weights seed.")]
CpusPerRank = Annotated[float, typer.Option("--cpus-per-rank", help="Ray CPUs per rank.")]
GpusPerRank = Annotated[float, typer.Option("--gpus-per-rank", help="Ray GPUs per rank (0: CPU ranks).")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait until every rank serves.")]
OnRankFailure = Annotated[
    str,
    typer.Option(
        "--on-rank-failure",
        help="When a rank dies: shrink (serve at the healthy size) "
        "or replace (shrink, then grow back to the desired size).",
    ),
]
Placement = Annotated[
    str, typer.Option("--placement", help="Ranks over Ray nodes: pack, spread or strict-spread (one per node).")
]
Ifname = Annotated[
    str,
    typer.Option(
        "--ifname",
        help="Network interface ranks bind (store, gloo); default: the node IP Ray reports. Env EEPCTL_IFNAME.",
    ),
]
Standby = Annotated[
    int,
    typer.Option(
        "--standby",
        help="Ranks to keep launched ahead (model and KV loaded, in no DP group): a scale-up adopts them and skips "
        "its launch phase.",
    ),
]
CapturePolicy = Annotated[
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
]
Transport = Annotated[
    str,
    typer.Option(
        "--transport",
        help="The per-step collectives: auto (shared memory when every rank of a world shares one host, gloo "
        "otherwise; chosen again at every transition), or gloo (TCP always).",
    ),
]
HealthDeadline = Annotated[
    float,
    typer.Option(
        "--health-deadline",
        help="Seconds a rank may stay silent (no probe answer, token or result) before it is fenced and recovered "
        "around; also how long a serving step waits for a peer.",
    ),
]
Ingress = Annotated[
    int,
    typer.Option(
        "--ingress",
        help="Ingress actors (requests enter there, HTTP and Ray calls; spread over nodes, the head first).",
    ),
]
Host = Annotated[
    str,
    typer.Option(
        "--host",
        help=(
            "IPv4 address the ingresses' HTTP API listens on: 0.0.0.0 (every interface of its node), 127.0.0.1 "
            "(the node itself only) or one of the node's addresses."
        ),
    ),
]
Port = Annotated[
    int,
    typer.Option(
        "--port",
        help=(
            "The first ingress's HTTP port; ingress i listens on PORT+i, also after a restart (a port that is taken "
            "fails `up`, exit 4). 0: any free port, kept across restarts while free."
        ),
    ),
]

# up's option -> the EngineConfig field it sets
ENGINE_SIZES = {
    "experts": "num_experts",
    "slots_per_rank": "slots_per_rank",
    "top_k": "top_k",
    "layers": "num_layers",
    "hidden": "hidden_size",
    "max_num_seqs": "max_num_seqs",
    "max_num_tokens": "max_num_tokens",
}
# up's options that are eepctl.core.up's keyword arguments of the same name
AS_IS = (
    "dp",
    "max_dp",
    "cpus_per_rank",
    "gpus_per_rank",
    "on_rank_failure",
    "standby",
    "ingress",
    "api_key",
    "host",
    "port",
)


def up_arguments(options: dict[str, Any]) -> dict[str, Any]:
    """eepctl.core.up's keyword arguments (all but the target and ``say``) from `up`'s options,
    by parameter name (the command's ``ctx.params``)."""
    o = options
    sizes = {field: o[opt] for opt, field in ENGINE_SIZES.items()}
    return {
        **{k: o[k] for k in AS_IS},
        "engine": engine_options(
            sizes, o["dtype"], o["seed"], o["capture_policy"], o["transport"], o["health_deadline"]
        ),
        "timeout_s": o["timeout"],
        "placement": {"policy": o["placement"], "ifname": o["ifname"]},
        "health_deadline_s": o["health_deadline"],
    }


def engine_options(
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
