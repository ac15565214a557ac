"""engine_ext: the elastic extension MoE engines carry (identity, comm, graphs, workspace,
isolation, EPLB, telemetry), a reference elastic MoE engine and a vLLM plugin."""

__version__ = "0.1.0"
