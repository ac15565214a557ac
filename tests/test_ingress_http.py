"""The ingress's HTTP app (engine_ext.ray.ingress_http) in-process, over its real router: input the
model cannot serve is answered 400 at once in OpenAI's error shape, whether the ingress refuses it
from the model's limits or a rank refuses it; a model the deployment does not serve is a 404
``model_not_found``. The ranks are stand-ins that answer as a rank's ``add_request`` does (queue
it and stream its result, or raise the rank's refusal); the real path, through Ray actors and a
real HTTP server, is tests/test_ingress_ray.py's."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from engine_ext.control.rank_client import RankClient
from engine_ext.control.router import Router
from engine_ext.errors import RankRefused
from engine_ext.ray.ingress_http import IngressHttp
from engine_ext.records import Refusal
from tests.helpers import as_ray_task_error

LIMITS = {"vocab_size": 256, "max_model_len": 128, "max_num_tokens": 64}
OUTPUT = [11, 12, 13]


class _Rank(RankClient):
    """A rank stand-in: takes a request and answers it with ``OUTPUT``, or raises ``refuse``."""

    def __init__(self, rank: int, router: Router, refuse: BaseException | None = None) -> None:
        self.rank, self.router, self.refuse = rank, router, refuse
        self.asked: list[dict[str, Any]] = []

    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        wire = args[0]
        self.asked.append(wire)
        if self.refuse is not None:
            raise self.refuse
        asyncio.get_running_loop().call_soon(
            self.router.on_results, [dict(wire, output=OUTPUT[: wire["max_tokens"]])], self.rank
        )

    async def kill(self) -> None:
        return None

    def pid(self) -> int:
        return 0


class _Ingress:
    """What IngressHttp uses of an ingress (its ``Ingress`` protocol), over a real Router."""

    def __init__(self, limits: dict[str, int] | None, refuse: BaseException | None = None) -> None:
        self.deployment, self.namespace, self.index = "dep", "ns", 0
        self.api_key_sha256, self.started_at, self.limits = "", time.time(), limits
        self.router = Router()
        self.rank = _Rank(0, self.router, refuse)
        self.router.set_ranks({0: self.rank})

    def stats(self) -> dict[str, Any]:
        return {"members": sorted(self.router.clients)}

    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return await self.router.submit(prompt, max_tokens, self.new_request_id())

    def new_request_id(self) -> str:
        return f"r{time.monotonic_ns()}"


def _post(ing: _Ingress, body: dict[str, Any]) -> tuple[int, Any, str]:
    """POST /v1/completions to the app; (status, JSON body or None, text). Bounded: a request the
    router parked would never be answered."""
    import httpx

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=IngressHttp(ing).app())
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await asyncio.wait_for(client.post("/v1/completions", json=body), 10)

    resp = asyncio.run(go())
    try:
        parsed = resp.json()
    except ValueError:
        parsed = None
    return resp.status_code, parsed, resp.text


def _openai_error(body: Any, param: str | None, code: int | str = 400) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code, err
    assert "engine_ext." not in err["message"] and "Error:" not in err["message"], err
    return err


def test_input_beyond_the_models_limits_is_a_400_before_any_rank_sees_it() -> None:
    ing = _Ingress(LIMITS)
    cases = [
        ({"prompt": [1, 2], "max_tokens": 200}, "max_tokens", "maximum context length is 128"),
        ({"prompt": [1] * 60, "max_tokens": 70}, "max_tokens", "ask for 130"),
        ({"prompt": [1, 256], "max_tokens": 4}, "prompt", "token id 256 is not in the vocabulary"),
        ({"prompt": [[1, 2], [3, 999]], "max_tokens": 4}, "prompt", "prompt 1: token id 999"),
        ({"prompt": [1] * 65, "max_tokens": 1}, "prompt", "at most 64 in one prompt"),
    ]
    for body, param, says in cases:
        for stream in (False, True):
            status, out, text = _post(ing, dict(body, stream=stream))
            assert status == 400, (body, stream, text)
            assert says in _openai_error(out, param)["message"], out
    assert ing.rank.asked == []
    status, out, _ = _post(ing, {"prompt": [1, 2], "max_tokens": 3})
    assert status == 200 and out["choices"][0]["token_ids"] == OUTPUT, out


def test_a_ranks_refusal_of_the_input_is_final_a_400_at_once_never_parked() -> None:
    """The ingress does not know the limits yet (no world told): the rank's refusal (RequestRejected,
    as a rank raises it: engine_ext.rank.engine) answers the request at once, whole or streamed."""
    why = "prompt + max_tokens exceeds max_model_len 128"
    ing = _Ingress(None, refuse=as_ray_task_error(RankRefused(why, Refusal.INVALID)))
    status, out, text = _post(ing, {"prompt": [1, 2], "max_tokens": 200})
    assert status == 400 and _openai_error(out, None)["message"] == why, text
    status, _, text = _post(ing, {"prompt": [1, 2], "max_tokens": 200, "stream": True})
    events = [json.loads(ln[len("data: ") :]) for ln in text.splitlines() if ln.startswith("data: {")]
    assert status == 200 and len(events) == 1 and _openai_error(events[0], None)["message"] == why, text
    assert text.rstrip().endswith("data: [DONE]"), text
    assert ing.router.parked == 0 and ing.router.failed == 2 and len(ing.rank.asked) == 2


def test_a_model_the_deployment_does_not_serve_is_a_404_model_not_found() -> None:
    ing = _Ingress(LIMITS)
    for stream in (False, True):
        status, out, text = _post(ing, {"model": "gpt-4", "prompt": [1, 2], "max_tokens": 3, "stream": stream})
        assert status == 404, text
        err = _openai_error(out, "model", "model_not_found")
        assert err["message"] == "The model `gpt-4` does not exist. Valid aliases: dep.", err
    assert ing.rank.asked == []
    for named in ({"model": "dep"}, {}):  # its own name, or none: served
        status, out, _ = _post(ing, {**named, "prompt": [1, 2], "max_tokens": 3})
        assert status == 200 and out["model"] == "dep" and out["choices"][0]["token_ids"] == OUTPUT, out
