"""Pure renderers: records in, text out. JSON mode prints nothing but JSON. The commands render
through this module; each kind of record has its own (eepctl.render_status, render_operations,
render_requests, render_events, render_autoscale, ...)."""

from __future__ import annotations

from typing import Any

from eepctl.render_operations import down_text, plan_text, scale_text, up_text, vllm_plan_text
from eepctl.render_requests import generate_head, generate_tail, generate_text, load_text
from eepctl.render_status import capture_cell, filter_ranks, status_summary_lines, status_text
from engine_ext.protocol import SCHEMA_VERSION

__all__ = [
    "capture_cell",
    "down_text",
    "filter_ranks",
    "generate_head",
    "generate_tail",
    "generate_text",
    "load_text",
    "plan_text",
    "scale_text",
    "status_summary_lines",
    "status_text",
    "to_json",
    "up_text",
    "vllm_plan_text",
]


def to_json(kind: str, data: Any) -> str:
    """One JSON object in the envelope every -o json output uses, one per line when streaming:
    ``{"schema": 1, "object": kind, ...data}`` (docs/status-schema.md, "JSON lines"). msgspec
    encodes it (a 4096-rank status in ~30 ms against ~200 ms for json.dumps); what it cannot
    encode prints as its str."""
    import msgspec

    body = {"schema": SCHEMA_VERSION, "object": kind, **(data if isinstance(data, dict) else {"items": data})}
    return msgspec.json.encode(body, enc_hook=str).decode()
