"""The few endpoints of a vLLM API server that engine_ext's clients use, and what their answers mean.

``httpx`` is imported inside the calls. The API key goes into one header and nowhere else: not
into output, logs, errors, the registry or an operation record.
"""

from __future__ import annotations

from typing import Any

from engine_ext.protocol import (
    EepError,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    UsageError,
)

NOT_ELASTIC_HINT = (
    "this vLLM server was not started with --enable-elastic-ep and --data-parallel-backend ray, "
    "so it cannot change its DP size; its log has the cause"
)


class VllmApi:
    """A vLLM API server at ``base_url``, called with the bearer key when there is one."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # never shows the key
        return f"VllmApi({self.base_url!r})"

    def served_model(self) -> str:
        """The first model id of ``/v1/models`` (for a server whose registry info has none)."""
        import httpx

        try:
            resp = httpx.get(self.base_url + "/v1/models", headers=self._headers, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise UnreachableError(
                f"vLLM API server at {self.base_url} is not reachable ({type(e).__name__})"
            ) from None
        if resp.status_code in (401, 403):
            raise UnreachableError(
                f"vLLM at {self.base_url} refused the API key (HTTP {resp.status_code}); "
                "pass --api-key or set VLLM_API_KEY"
            )
        try:
            return str(resp.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise TransitionFailed(f"vLLM at {self.base_url} lists no model on /v1/models") from None

    def post(self, path: str, payload: dict[str, Any] | None = None, timeout_s: float | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded body). Raises UnreachableError when nothing answers."""
        return self._request("POST", path, payload if payload is not None else {}, timeout_s)

    def get(self, path: str, timeout_s: float | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded body). Raises UnreachableError when nothing answers."""
        return self._request("GET", path, None, timeout_s)

    def _request(
        self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float | None
    ) -> tuple[int, Any]:
        import httpx

        try:
            resp = httpx.request(
                method, self.base_url + path, json=payload, headers=self._headers, timeout=timeout_s or self.timeout_s
            )
        except httpx.TimeoutException:
            raise TransitionTimeout(
                f"vLLM at {self.base_url} did not answer {path} within {timeout_s or self.timeout_s:.0f}s"
            ) from None
        except httpx.HTTPError as e:
            raise UnreachableError(
                f"vLLM API server at {self.base_url} is not reachable ({type(e).__name__})"
            ) from None
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        return resp.status_code, body

    def is_scaling(self) -> bool:
        """vLLM's own scaling flag. While it scales, vLLM's middleware answers every request,
        this one included, with 503 "currently scaling"; that counts as True."""
        code, body = self.post("/is_scaling_elastic_ep")
        if code == 200 and isinstance(body, dict):
            return bool(body.get("is_scaling_elastic_ep"))
        if code == 503:
            return True
        if code in (401, 403):
            raise UnreachableError(
                f"vLLM at {self.base_url} refused the API key (HTTP {code}); pass --api-key or set VLLM_API_KEY"
            )
        raise TransitionFailed(
            f"vLLM at {self.base_url} answered /is_scaling_elastic_ep with HTTP {code}: {message_of(body)}"
        )

    def fault_tolerance(self) -> dict[str, Any] | None:
        """vLLM's fault-tolerance status (``{"total_engines", "engines": [{"id", "status", ...}]}``),
        or None when the server runs without ``--enable-fault-tolerance``. UnreachableError when
        nothing answers or the key is refused, PreconditionError on 503 (scaling, or wedged),
        TransitionFailed on any other answer. The one reader of ``GET /fault_tolerance/status``."""
        code, body = self.get("/fault_tolerance/status")
        if code in (404, 405):
            return None
        if code in (401, 403):
            raise UnreachableError(
                f"vLLM at {self.base_url} refused the API key (HTTP {code}); pass --api-key or set VLLM_API_KEY"
            )
        if code == 503:
            raise PreconditionError(f"vLLM at {self.base_url} answers 503 (scaling, or wedged: `eepctl status`)")
        if code != 200 or not isinstance(body, dict) or not isinstance(body.get("engines"), list):
            raise TransitionFailed(
                f"vLLM at {self.base_url} answered /fault_tolerance/status with HTTP {code}: {message_of(body)}"
            )
        return body

    def scale(self, new_size: int, drain_timeout_s: int, timeout_s: float) -> tuple[int, Any]:
        return self.post(
            "/scale_elastic_ep",
            {"new_data_parallel_size": new_size, "drain_timeout": drain_timeout_s},
            timeout_s=timeout_s,
        )


def message_of(body: Any) -> str:
    """vLLM's error text from its JSON answer (``{"error": {"message"}}`` or FastAPI's ``{"detail"}``)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if body.get("detail"):
            return str(body["detail"])
        if body.get("message"):
            return str(body["message"])
    text = str(body or "").strip()
    return " ".join(text.split())[:300] or "no message"


def fault_tolerance_health(api: VllmApi) -> dict[str, Any] | None:
    """``api.fault_tolerance()`` for what only shows it (status, the controller's loop, an
    operation's record): ``{"error": why, "engines": []}`` when it cannot be read; never raises."""
    try:
        return api.fault_tolerance()
    except EepError as e:
        return {"error": e.message, "engines": []}


def engine_health(body: dict[str, Any] | None) -> dict[str, str]:
    """Each engine's health (id -> status) from a fault-tolerance status; ``{"error": why}`` for
    one that could not be read, ``{}`` for none."""
    if not body:
        return {}
    if body.get("error"):
        return {"error": str(body["error"])}
    return {str(e.get("id")): str(e.get("status")) for e in body.get("engines", [])}


def error_for(code: int, body: Any, new_size: int, info: dict[str, Any]) -> EepError:
    """vLLM's answer to /scale_elastic_ep -> the documented exit code (README, docs/vllm-plugin.md)."""
    msg = message_of(body)
    head = f"vLLM refused the scale to DP {new_size}: HTTP {code} {msg}"
    if code == 400:
        low = msg.lower()
        if any(w in low for w in ("already", "cannot scale", "max-dp", "max_dp", "minimum", "in progress")):
            return PreconditionError(head)
        return UsageError(head)
    if code == 408:
        return TransitionTimeout(head)
    if code in (401, 403):
        return UnreachableError(f"vLLM refused the API key (HTTP {code}); pass --api-key or set VLLM_API_KEY")
    if code in (404, 405):
        return PreconditionError(f"this vLLM server has no /scale_elastic_ep endpoint (HTTP {code})")
    if code == 503:
        return PreconditionError(f"vLLM is already scaling (HTTP 503: {msg})")
    if code >= 500:
        hint = f" ({NOT_ELASTIC_HINT})" if not info.get("elastic_ep") else " (see the vLLM server's log)"
        return TransitionFailed(head + hint)
    return EepError(head)
