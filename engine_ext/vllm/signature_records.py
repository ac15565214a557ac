"""The vLLM symbols the plugin touches, and their committed records for each supported release.

``plugin_symbols`` lists every symbol (the wrapped hooks of engine_ext.vllm.patches and
engine_ext.vllm.phase_hooks, the API-side symbols, the CPU patches of engine_ext.vllm.cpu_patches,
what the held prepare reads and calls: engine_ext.vllm.held_symbols); the record of a release holds, per symbol,
what engine_ext.vllm.signatures reads from its source, plus each CPU patch's source-snippet counts.
Records are committed beside this module (``signatures/vllm-<version>.json``), written by
``python -m engine_ext.vllm.signature_records [--wheel PATH] --write``. Why committed: CI checks
every release at no download cost; tests re-derive the records from the installed vLLM and, when
PyPI answers, from the downloaded wheel, so a drifted record fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from engine_ext.vllm import cpu_patches, held_symbols, patches, phase_hooks, signatures

RECORDS_DIR = Path(__file__).with_name("signatures")
SUPPORTED_VERSIONS = ("0.32.0", "0.33.0")

# Symbols the plugin uses besides the wrapped methods in patches.CATALOGUE: "module:Qualified.name".
EXTRA_SYMBOLS = (
    "vllm.v1.engine.async_llm:AsyncLLM._scale_elastic_ep",
    "vllm.v1.engine.async_llm:AsyncLLM.scale_elastic_ep",
    "vllm.entrypoints.launchers.api_server.entry:build_and_serve",
    "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.__call__",
    "vllm.entrypoints.serve.middleware.authenticate:GUARDED_PREFIX",
    "vllm.entrypoints.serve.elastic_ep.middleware:get_scaling_elastic_ep",
)


def wrapped_hooks() -> tuple[patches.PatchSpec, ...]:
    """Every hook the plugin wraps: the elastic steps, warm-ups and captures, then the phase hooks."""
    return patches.CATALOGUE + phase_hooks.ALL_HOOKS


def plugin_symbols() -> tuple[str, ...]:
    """Every symbol the plugin checks, as "module:qualname" (catalogue first, the held prepare's last)."""
    wrapped = tuple(f"{s.module}:{s.qualname}" for s in wrapped_hooks())
    cpu = tuple(f"{p.module}:{p.qualname}" for p in cpu_patches.CATALOGUE if p.params is not None)
    return wrapped + cpu + EXTRA_SYMBOLS + held_symbols.SYMBOLS


def snippet_counts(read: Callable[[str], str | None]) -> dict[str, dict[str, int]]:
    """For each CPU patch, how often its module's source holds each snippet the patch stands in for."""
    out: dict[str, dict[str, int]] = {}
    for p in cpu_patches.CATALOGUE:
        text = read(p.module.replace(".", "/") + ".py") or ""
        out[p.name] = {snippet: text.count(snippet) for snippet, _ in p.source}
    return out


def verified(version: str) -> dict[str, bool]:
    """Per hook or CPU patch (CATALOGUE key / patch name), and ``held_prepare`` (every symbol of
    engine_ext.vllm.held_symbols): does its check hold on ``version``'s record?"""
    data = json.loads((RECORDS_DIR / f"vllm-{version}.json").read_text())
    symbols, snippets = data["symbols"], data.get("snippets", {})
    out = {
        s.key: (symbols.get(f"{s.module}:{s.qualname}") or {}).get("params") == list(s.params) for s in wrapped_hooks()
    }
    for p in cpu_patches.CATALOGUE:
        ok = p.params is None or (symbols.get(f"{p.module}:{p.qualname}") or {}).get("params") == list(p.params)
        out[p.name] = ok and all(snippets.get(p.name, {}).get(sn) == n for sn, n in p.source)
    out["held_prepare"] = held_symbols.check(symbols) == "active"
    return out


def record(version: str) -> dict[str, dict | None]:
    """The committed record of a release: its symbols."""
    return json.loads((RECORDS_DIR / f"vllm-{version}.json").read_text())["symbols"]


def recorded_snippets(version: str) -> dict[str, dict[str, int]]:
    return json.loads((RECORDS_DIR / f"vllm-{version}.json").read_text())["snippets"]


def render(version: str, source: str, read: Callable[[str], str | None]) -> str:
    body = {
        "vllm": version,
        "source": source,
        "symbols": signatures.extract(read, plugin_symbols()),
        "snippets": snippet_counts(read),
    }
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--wheel", type=Path, help="a vLLM wheel (default: the installed vLLM)")
    ap.add_argument("--write", action="store_true", help=f"write {RECORDS_DIR.name}/vllm-<version>.json")
    a = ap.parse_args(argv)
    read, version = signatures.wheel_reader(a.wheel) if a.wheel else signatures.installed_reader()
    text = render(version, a.wheel.name if a.wheel else "installed", read)
    if a.write:
        (RECORDS_DIR / f"vllm-{version}.json").write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
