"""Response shaping for the OpenAI routes: the error body, stream chunks, whole responses, usage, logprobs and
the summary of what speculation did.  Pure functions of events and stats (no request state)."""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from fastapi.responses import JSONResponse

from .events import Delta, Done, Failed
from .tools import ChoiceOutput


@functools.lru_cache(maxsize=1)
def system_fingerprint() -> str:
    """The ``system_fingerprint`` of every OpenAI completion and chat body and chunk, as llama-server sends it
    (``llama_build_info()``: ``b<build>-<commit>``, the llama.cpp build).  libllama does not export llama.cpp's
    build number (it lives in llama.cpp's ``common``), so the build named here is llama-cpp-python's and
    specstack's: ``b<llama-cpp-python version>-specstack<version>``; read once, as every chunk carries it."""
    from .. import __version__
    from ..llama.backend import llama_version

    return f"b{llama_version() or 'unknown'}-specstack{__version__}"

def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None,
          fields: dict[str, Any] | None = None) -> JSONResponse:
    """OpenAI's error body; ``fields`` adds llama-server's own keys to it (``n_prompt_tokens``, ``n_ctx``)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code, **(fields or {})}},
                        status_code=status, headers=headers)


class ApiError(Exception):
    """A refusal as the response it becomes (the app's handler answers with ``response``)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 fields: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.response = error(status, message, kind, param, code, headers, fields)

    @classmethod
    def from_event(cls, event: Failed) -> ApiError:
        """An engine's error event as the refusal (a scale-out 429 carries its code and Retry-After)."""
        return cls(event.status, event.message, event.kind, param=event.param, code=event.code, headers=event.headers)


def chunk(rid: str, obj: str, created: int, model: str, choice: dict[str, Any], include_usage: bool,
          extra: dict[str, Any] | None = None, top: dict[str, Any] | None = None) -> str:
    """One stream chunk; ``extra`` goes under ``specstack``, ``top`` beside the choices (llama-server's
    ``timings`` and ``__verbose``)."""
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                            "system_fingerprint": system_fingerprint(), "choices": [{"index": 0, **choice}]}
    if include_usage:
        body["usage"] = None
    if extra:
        body["specstack"] = extra
    body.update(top or {})
    return json.dumps(body)


def summary(stats: dict[str, Any]) -> dict[str, Any]:
    """What speculation did for one request: drafted, accepted, acceptance, mean accepted length, by source."""
    keys = ("drafter", "k_policy", "n_drafted", "n_accepted", "acceptance_rate", "mean_accepted_length", "by_source",
            "acceptance_by_position", "reused_prompt_tokens", "tokens_per_second", "stop_reason", "tree_steps",
            "replica",  # replica: which Ray Serve replica ran it (``serve --ray`` only)
            "lossy")  # a role run with fewer MoE experts: "LOSSY: ..." (None when the output is the model's)
    times = stats.get("time_s", {})
    return {**{k: stats[k] for k in keys if k in stats},
            "time_to_first_token_s": times.get("first_token"), "inter_token_latency_s": times.get("inter_token")}



class LogprobsOut:
    """A response's ``logprobs`` in the OpenAI shape of its endpoint, from the engine's ``TokenLogprob``s.

    Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob) and ``text_offset``;
    chat: ``content``, a list of ``{token, logprob, bytes, top_logprobs}``.
    """

    def __init__(self, target: Any, chat: bool, offset: int = 0) -> None:
        self._target, self.chat, self.offset = target, chat, offset
        self.items: list[tuple[str, bytes, Any]] = []

    def add(self, event: Delta) -> None:
        for lp in event.logprobs or ():
            raw = self._target.token_bytes(lp.token)
            self.items.append((raw.decode("utf-8", "replace"), raw, lp))

    def body(self) -> dict[str, Any]:
        if self.chat:
            return {"content": [{"token": text, "logprob": lp.logprob, "bytes": list(raw),
                                 "top_logprobs": [self._alt(t, v) for t, v in lp.top]} for text, raw, lp in self.items]}
        offsets, at = [], self.offset
        for text, _, _ in self.items:
            offsets.append(at)
            at += len(text)
        return {"tokens": [t for t, _, _ in self.items], "token_logprobs": [lp.logprob for _, _, lp in self.items],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for _, _, lp in self.items],
                "text_offset": offsets}

    def _alt(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._target.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    def _text(self, token: int) -> str:
        return self._target.token_bytes(token).decode("utf-8", "replace")


def total_usage(finals: list[Done], per_prompt: int = 1) -> dict[str, int]:
    """A request's usage over its choices (in ``index`` order, ``per_prompt`` choices of each prompt): each prompt
    once (it was processed once), every choice's tokens."""
    prompt = sum(f.prompt_tokens for f in finals[::max(1, per_prompt)])
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def final_body(rid: str, model: str, texts: list[str], finals: list[Done], chat: bool,
               logprobs: list[dict[str, Any]] | None = None, per_prompt: int = 1,
               outputs: list[ChoiceOutput] | None = None) -> dict[str, Any]:
    """A whole response: one choice per text (``index`` in order), the usage over all, and speculation's
    summary (per choice under ``speculative.choices`` when there are several).  With ``outputs`` (a chat with
    tools, or a model that thinks) each choice's message is its text read back: reasoning_content, content and
    tool_calls."""
    choices = []
    for i, (text, event) in enumerate(zip(texts, finals)):
        lp = logprobs[i] if logprobs is not None else None
        if chat and outputs is not None:
            choices.append({"index": i, "message": outputs[i].message(),
                            "finish_reason": outputs[i].finish_reason(event.finish_reason), "logprobs": lp})
        elif chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": event.finish_reason, "logprobs": lp})
        else:
            choices.append({"index": i, "text": text, "finish_reason": event.finish_reason, "logprobs": lp})
    spec = summary(finals[0].stats)
    if len(finals) > 1:
        spec = {**spec, "choices": [summary(f.stats) for f in finals]}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": system_fingerprint(), "choices": choices, "usage": total_usage(finals, per_prompt), "speculative": spec}


def exactness(w: Any) -> dict[str, Any]:
    """The ``--exact`` mode a role runs in and why (auto decides at load, by measurement)."""
    shapes = w.target.shapes if w.target is not None and w.target.shapes.settled else None
    if shapes is None:
        return {"requested": w.role.exact, "mode": None, "why": "not loaded yet"}
    return {"requested": w.role.exact, "mode": "on" if shapes.exact else "off", "why": shapes.why}
