"""What a completions request asks of a reference deployment's ingress, checked before any rank
sees it, and the error bodies the ingress answers in OpenAI's shape.

A request the model cannot serve (a token id outside the vocabulary, a prompt longer than one
prefill takes, a prompt and ``max_tokens`` beyond ``max_model_len``) is answered HTTP 400 at once,
from the limits the controller tells the ingress with the world (``model_limits``); a model name
the deployment does not serve is a 404 ``model_not_found``, as vLLM's server answers it. Errors are
``{"error": {"message", "type", "param", "code"}}``: ``code`` is the HTTP status (as vLLM's), or
OpenAI's name for the error where it has one.
"""

from __future__ import annotations

from typing import Any

MAX_TOKENS_DEFAULT = 16
LIMIT_KEYS = ("vocab_size", "max_model_len", "max_num_tokens")


class BadRequest(ValueError):
    """A request the deployment will not serve: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.code, self.param)


def error_body(message: str, kind: str, code: int | str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_limits(cfg: Any) -> dict[str, int]:
    """What the ingress checks a request against, from the deployment's engine config."""
    return {k: int(getattr(cfg, k)) for k in LIMIT_KEYS}


def parse_completion(body: Any) -> tuple[list[list[int]], int, bool]:
    """The prompts (token ids), max_tokens and stream flag of a completions body."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt)
    ):
        prompts = prompt
    else:
        raise BadRequest(
            "prompt must be a non-empty list of token ids (or a list of them): the reference model has no tokenizer",
            "prompt",
        )
    if any(t < 0 for p in prompts for t in p):
        raise BadRequest("token ids must not be negative", "prompt")
    max_tokens = body.get("max_tokens", MAX_TOKENS_DEFAULT)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens must be a positive integer", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    return prompts, max_tokens, stream


def served_model(body: dict[str, Any], served: str) -> str:
    """The model the request names: none (the served one), or the served one; any other is a 404."""
    asked = body.get("model")
    if not asked or asked == served:
        return served
    raise BadRequest(
        f"The model `{asked}` does not exist. Valid aliases: {served}.", "model", status=404, code="model_not_found"
    )


def check_limits(prompts: list[list[int]], max_tokens: int, limits: dict[str, int] | None) -> None:
    """Refuse what no rank would take (the rank's own check: engine_ext.rank.scheduler); ``None``:
    the limits are not known yet (no world told), and the ranks check."""
    if not limits:
        return
    vocab, max_len, max_prompt = (int(limits[k]) for k in LIMIT_KEYS)
    for i, p in enumerate(prompts):
        which = f"prompt {i}: " if len(prompts) > 1 else ""
        bad = next((t for t in p if t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"{which}token id {bad} is not in the vocabulary (ids 0..{vocab - 1})", "prompt")
        if len(p) > max_prompt:
            raise BadRequest(
                f"{which}the prompt has {len(p)} tokens; this model takes at most {max_prompt} in one prompt", "prompt"
            )
        if len(p) + max_tokens > max_len:
            raise BadRequest(
                f"{which}this model's maximum context length is {max_len} tokens; the prompt's "
                f"{len(p)} and max_tokens {max_tokens} ask for {len(p) + max_tokens}",
                "max_tokens",
            )
