"""Errors in OpenAI's JSON shape, and Triton's error messages mapped to them.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}` and pick their exception class from the
HTTP status (400 BadRequestError, 404 NotFoundError, 429 RateLimitError, 503 InternalServerError...). The
engine's messages name the request tensor (`InvalidRequest: TOP_P must be in (0, 1], got 0.0`); `param` is
the API field that tensor came from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Request tensor (or the engine-side field name a model's own message uses) -> the API field it came from.
TENSOR_PARAMS = {
    "TEXT": "input", "text": "input", "prompt": "input",
    "VOICE": "voice", "voice": "voice", "SPEAKER": "voice", "speaker": "voice",
    "AUDIO_FORMAT": "response_format",
    "TEMPERATURE": "temperature", "TOP_P": "top_p", "TOP_K": "top_k", "MIN_P": "min_p",
    "REPETITION_PENALTY": "repetition_penalty", "MAX_TOKENS": "max_tokens", "SEED": "seed",
    "CFG_WEIGHT": "cfg_weight", "EXAGGERATION": "exaggeration",
}
_ENGINE_FAILED = re.compile(r"\bengine (step )?failed|\bengine stopped|model is being unloaded")


def _name_pattern(names) -> re.Pattern:
    """The first of `names` in a message, longest first: `HISTORY_TEXT[1]` before `HISTORY_TEXT`."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(r"(?<!\w)(" + alternatives + r")(?!\w)")


_NAME = _name_pattern(TENSOR_PARAMS)


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unknown_model(model: str, served: list[str]) -> ApiError:
    return ApiError(404, f"model {model!r} is not served here; served: {', '.join(served) or 'none'}",
                    "invalid_request_error", "model", "model_not_found")


def unavailable(message: str, code: str = "server_unavailable") -> ApiError:
    return ApiError(503, message, "server_error", None, code)


def from_triton(message: str, params: dict[str, str] | None = None) -> ApiError:
    """One error response of a Triton stream (or a gRPC failure) -> the HTTP error it means.

    params: the request's own map from what Triton names (tensors, `HISTORY_TEXT[1]`, the engine's words) to the
    request's fields, where they are paths into its messages (a chat request). With it only tensor names (upper
    case) are rewritten in the message: the engine's own words ("history has 33 turns") read right as they are."""
    text = message.strip()
    if "InvalidRequest:" in text:
        detail = text[text.index("InvalidRequest:") + len("InvalidRequest:"):].strip()
        names = TENSOR_PARAMS if params is None else params
        named = (_NAME if params is None else _name_pattern(params)).search(detail)
        if named is None:
            return bad_request(detail, None)
        param = names[named.group(1)]  # and say it the way the client sent it: "top_p must be in (0, 1]"
        if params is not None and not named.group(1).isupper():
            return bad_request(detail, param)
        return bad_request(detail[:named.start()] + param + detail[named.end():], param)
    if "EngineOverloaded" in text:
        return ApiError(429, _after(text, "EngineOverloaded:") + " (retry later)", "rate_limit_error", None,
                        "engine_overloaded")
    if "EngineDead" in text:
        return unavailable(_after(text, "EngineDead:"), "engine_dead")
    if "draining:" in text or "Server is stopping" in text or "has no available versions" in text:
        return unavailable(_after(text, "draining:"), "server_draining")  # the server stops: retry elsewhere
    if _ENGINE_FAILED.search(text):  # mid-stream: the engine failed or stopped under this stream
        return unavailable(text, "engine_error")
    if "UNAVAILABLE" in text or "failed to connect" in text.lower() or "connection refused" in text.lower():
        return unavailable(f"the inference server is not reachable: {text}")
    return ApiError(500, text, "server_error", None, "internal_error")


def _after(text: str, marker: str) -> str:
    return text[text.index(marker) + len(marker):].strip() if marker in text else text
