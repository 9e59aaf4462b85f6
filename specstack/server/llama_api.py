"""llama-server's own routes, on the same roles and workers as the OpenAI ones (``app``).

``POST /completion`` (and ``/completions``) in llama.cpp's native shape, streaming included, with its
``timings``; ``POST /tokenize``, ``/detokenize``, ``/apply-template``; ``GET /props`` and the read-only
``GET /slots``; ``/v1/embeddings`` (and ``/embedding``, ``/embeddings``) answer 501, since no role is
loaded for embeddings.  Each route picks its role by the body's (or the query's) ``model``, as llama-server's
router does, else the first role.  A generation goes through ``app``'s ``start`` (the role's worker),
so every check, limit, constraint and speculation setting of ``/v1/completions`` holds here too.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from sse_starlette.sse import EventSourceResponse

from .. import __version__
from ..draft_length import DEFAULT_K_MAX
from ..sampling import MAX_LOGPROBS
from .app import ApiError, ChatRequest, CompletionRequest, ServeApi, error, summary, total_usage

router = APIRouter()

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # what llama-server reports for "random" (-1)
# OpenAI's fields that llama-server's native route does not have: their meaning here would be silently lost
OPENAI_ONLY = {"echo": "the prompt comes back as 'prompt'", "logprobs": "ask for n_probs",
               "best_of": "ask for n_cmpl", "suffix": "insertion is not implemented",
               "stream_options": "the last chunk always carries the timings",
               "max_completion_tokens": "ask for n_predict"}
STOP_TYPE = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit", "timeout": "limit",
             "cancelled": "none", "": "none"}
NO_EMBEDDINGS = ("specstack serve has no embedding role: every role loads its model for generation (llama.cpp's "
                 "--embeddings mode is not offered), so it computes no embeddings; serve them with "
                 "`llama-server --embeddings`")


def _api(request: Request) -> ServeApi:
    return request.app.state.api


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, strict=True)
    content: str = Field(strict=True)
    add_special: bool = Field(False, strict=True)
    parse_special: bool = Field(True, strict=True)
    with_pieces: bool = Field(False, strict=True)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, strict=True)
    tokens: list[StrictInt]


# -- vocabulary ----------------------------------------------------------------------------------------------

def piece_bytes(target: Any, token: int) -> bytes:
    """A token's text as llama-server's pieces show it: special tokens spelled out (``<start_of_turn>``)."""
    raw = target.token_bytes(token)
    if raw:
        return raw
    vocab = target if hasattr(target, "special_text") else getattr(target, "vocab", None)
    return vocab.special_text(token).encode("utf-8") if vocab is not None else raw


def _piece(raw: bytes) -> str | list[int]:
    """A piece as text, or its bytes where they are not whole UTF-8 (llama-server's ``with_pieces``)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _text(target: Any, ids: list[int]) -> str:
    return b"".join(piece_bytes(target, t) for t in ids).decode("utf-8", errors="replace")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    api = _api(request)
    unsupported_text(body.content, "content")
    target = api.worker_for(body.model).target
    ids = target.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": t, "piece": _piece(piece_bytes(target, t))} for t in ids]})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    target = _api(request).worker_for(body.model).target
    bad = [t for t in body.tokens if not 0 <= t < target.n_vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.n_vocab - 1})", param="tokens")
    return JSONResponse({"content": _text(target, body.tokens)})


def unsupported_text(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{field} holds a lone UTF-16 surrogate, which is not Unicode text; send valid UTF-8",
                       param=field) from None


@router.post("/apply-template")
async def apply_template(body: ChatRequest, request: Request) -> JSONResponse:
    """The prompt a chat request would get, as text (the same parsing and template as /v1/chat/completions)."""
    api = _api(request)
    api.unsupported(body)
    w = api.worker_for(body.model)
    return JSONResponse({"prompt": api.chat_prompt(body, w).text})


# -- props and slots ---------------------------------------------------------------------------------------

def default_params(role: Any, limits: Any) -> dict[str, Any]:
    """A role's generation defaults under llama-server's names (``/props``, ``/slots``): what a request that
    sets nothing gets here."""
    controls = role.controls()
    return {"n_predict": limits.default_max_tokens, "seed": LLAMA_DEFAULT_SEED if role.seed is None else role.seed,
            "temperature": 1.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            **controls.settings(), "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0,
            "mirostat_tau": 5.0, "mirostat_eta": 0.1, "stop": [], "max_tokens": limits.default_max_tokens,
            "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False, "n_probs": 0, "min_keep": 0,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "speculative.n_max": role.k_max or DEFAULT_K_MAX, "speculative.n_min": 0,
            "speculative": {"drafter": role.drafter, "k_policy": role.k_policy, "k": role.k, "k_max": role.k_max},
            "timings_per_token": False, "post_sampling_probs": False, "lora": []}


def request_params(job: Any, role: Any, limits: Any) -> dict[str, Any]:
    """``generation_settings``: the defaults with what this request set (``GenerationConfig``)."""
    config = job.config
    c, s = config.constraints, config.sampling
    return {**default_params(role, limits), "n_predict": config.max_tokens, "max_tokens": config.max_tokens,
            "seed": LLAMA_DEFAULT_SEED if s.seed is None or s.seed < 0 else s.seed, "temperature": s.temperature,
            "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": c.repeat_penalty,
            "repeat_last_n": c.repeat_last_n, "frequency_penalty": c.frequency_penalty,
            "presence_penalty": c.presence_penalty, "ignore_eos": c.ignore_eos, "grammar": c.grammar or "",
            "logit_bias": [[t, b if b != float("-inf") else False] for t, b in c.logit_bias],
            "min_tokens": c.min_tokens, "stop": list(config.stop), "stop_token_ids": list(config.stop_token_ids),
            "n_probs": config.logprobs or 0,
            "speculative": {"drafter": job.speculative.get("drafter", role.drafter),
                            "k_policy": job.speculative.get("k_policy", role.k_policy),
                            "k": job.speculative.get("k", role.k), "k_max": job.speculative.get("k_max", role.k_max)}}


def _worker(api: ServeApi, model: str | None) -> Any:
    return api.worker_for(model)


def _template(w: Any) -> str:
    t = w.template
    return "" if t is None or t.kind == "plain" else t.text


def _special(target: Any, attr: str) -> str:
    token = getattr(target, attr, None)
    return piece_bytes(target, token).decode("utf-8", "replace") if token is not None and token >= 0 else ""


@router.get("/props")
async def props(request: Request, model: str | None = None) -> JSONResponse:
    api = _api(request)
    w = _worker(api, model)
    from ..llama.backend import llama_version

    params = default_params(w.role, api.limits)
    return JSONResponse({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": w.target.n_ctx,
                                        "speculative": w.role.drafter != "none", "is_processing": False,
                                        "params": params, "prompt": "",
                                        "next_token": {"has_next_token": False, "has_new_line": False, "n_remain": -1,
                                                       "n_decoded": 0, "stopping_word": ""}},
        "total_slots": w.role.parallel, "model_path": str(w.role.model), "model_alias": w.role.name,
        "chat_template": _template(w), "chat_template_caps": {},
        "bos_token": _special(w.target, "bos_id"), "eos_token": _special(w.target, "eos_id"),
        "modalities": {"vision": False, "audio": False},
        "build_info": f"specstack {__version__} (llama-cpp-python {llama_version() or 'unknown'})",
        "is_sleeping": False})


@router.post("/props")
async def set_props() -> JSONResponse:
    return error(403, "changing server properties is not supported: POST /props needs llama-server's --props, which "
                      "specstack serve does not offer; restart with other flags or another roles file",
                 code="not_supported")


@router.get("/slots")
async def slots(request: Request, model: str | None = None, fail_on_no_slot: int = 0) -> Response:
    """One entry per slot of the role: busy or not, and how far its generation is (read-only; llama-server's
    save/restore/erase actions are not offered).  No prompt text is shown."""
    api = _api(request)
    if not api.slots:
        return error(501, "This server does not support slots endpoint (started with --no-slots)",
                     "not_supported_error", code="not_supported")
    w = _worker(api, model)
    busy: dict[int, Any] = {}
    for job in list(getattr(w, "_jobs", ())):  # the worker's running jobs (read, never changed, from here)
        seq = getattr(job.gen, "seq", None)
        if seq is not None:
            busy[seq] = job
    if fail_on_no_slot and len(busy) >= w.role.parallel:
        return error(503, "no slot available", "unavailable_error", code="unavailable")
    out = []
    for i in range(w.role.parallel):
        job = busy.get(i)
        params = request_params(job, w.role, api.limits) if job is not None else default_params(w.role, api.limits)
        decoded = len(job.gen.output_ids) if job is not None else 0
        out.append({"id": i, "id_task": job.index if job is not None else -1, "n_ctx": w.target.n_ctx,
                    "speculative": w.role.drafter != "none", "is_processing": job is not None, "params": params,
                    "next_token": {"has_next_token": job is not None, "has_new_line": False,
                                   "n_remain": job.config.max_tokens - decoded if job is not None else -1,
                                   "n_decoded": decoded, "stopping_word": ""}})
    return JSONResponse(out)


# -- embeddings ----------------------------------------------------------------------------------------------

@router.post("/v1/embeddings")
@router.post("/embedding")
@router.post("/embeddings")
async def embeddings() -> JSONResponse:
    return error(501, NO_EMBEDDINGS, "not_implemented_error", code="not_implemented")


# -- /completion -------------------------------------------------------------------------------------------

@router.post("/completion")
@router.post("/completions")
async def completion(body: CompletionRequest, request: Request) -> Response:
    """llama-server's native completion: ``content``, ``tokens``, ``stop_type``, ``timings`` and the request's
    ``generation_settings``; a list of prompts (or ``n_cmpl``) answers with a list of such results."""
    api = _api(request)
    for name, instead in OPENAI_ONLY.items():
        if name in body.model_fields_set and getattr(body, name) is not None:
            raise ApiError(400, f"{name} is a field of /v1/completions, not of llama-server's /completion ({instead})",
                           param=name)
    update: dict[str, Any] = {"return_tokens": None}  # honoured here: "tokens" always holds the ids
    # n_probs is checked by its own name: from here on it is read as logprobs, which its errors would name
    if body.n_probs is not None and not 0 <= body.n_probs <= MAX_LOGPROBS:
        raise ApiError(400, f"n_probs must be in 0..{MAX_LOGPROBS} (got {body.n_probs})", param="n_probs")
    if body.n_probs:  # the native route's logprobs
        update.update(n_probs=None, logprobs=body.n_probs)
    if body.n_predict == -1:  # llama-server: until the end of generation; here at most --max-tokens
        update["n_predict"] = api.limits.max_tokens
    body = body.model_copy(update=update)
    api.unsupported(body)
    w = api.worker_for(body.model)
    prompts = api.prompt_ids(body.prompt, w.target)
    jobs, first = await api.start(request, w, body, prompts, chat=False, grammar=api.grammar_for(body, w))
    native = Native(api, w, jobs, len(jobs) // len(prompts))
    if body.stream:
        return EventSourceResponse(native.stream(request, first), ping=15)
    finals: dict[int, dict[str, Any]] = {}
    event: dict[str, Any] | None = first
    while True:
        if event["type"] == "error":
            api.cancel_all(w, jobs)
            return error(event["status"], event["message"], event["kind"], param=event.get("param"),
                         code=event.get("code"), headers=event.get("headers"))
        native.add(event)
        if event["type"] == "done":
            finals[event["index"]] = event
            if len(finals) == len(jobs):
                break
        event = await api.next_event(request, w, jobs)
        if event is None:
            return Response(status_code=499)
    request.state.usage = native.usage(finals)
    results = [native.result(i, finals[i], streamed=False) for i in range(len(jobs))]
    return JSONResponse(results[0] if len(results) == 1 else results)


class Native:
    """A native request's choices as they arrive: text, token ids and probabilities per choice."""

    def __init__(self, api: ServeApi, w: Any, jobs: list[Any], per_prompt: int) -> None:
        self.api, self.w, self.jobs, self.per_prompt = api, w, jobs, per_prompt
        self.texts = [""] * len(jobs)
        self.ids: list[list[int]] = [[] for _ in jobs]
        self.probs: list[list[dict[str, Any]]] = [[] for _ in jobs]
        self.slot = [-1] * len(jobs)
        self.started = time.perf_counter()

    def add(self, event: dict[str, Any]) -> dict[str, Any]:
        """Take one event; a delta's part of the stream chunk (its text, ids and probabilities)."""
        i = event["index"]
        job = self.jobs[i]
        gen = getattr(job, "gen", None)
        if gen is not None and self.slot[i] < 0 and gen.seq is not None:
            self.slot[i] = gen.seq
        if event["type"] != "delta":
            if gen is not None:  # the ids the text shows (a stop string's tokens left out), as usage counts them
                self.ids[i] = list(gen.output_ids[: event["usage"]["completion_tokens"]])
            return {}
        n = len(event["tokens"])
        new = list(gen.output_ids[len(self.ids[i]): len(self.ids[i]) + n]) if gen is not None else []
        self.ids[i] += new
        self.texts[i] += event["text"]
        probs = [self._prob(lp) for lp in event.get("logprobs") or ()]
        self.probs[i] += probs
        return {"content": event["text"], "tokens": new, **({"completion_probabilities": probs} if probs else {})}

    def _prob(self, lp: Any) -> dict[str, Any]:
        target = self.w.target

        def entry(token: int, logprob: float) -> dict[str, Any]:
            raw = piece_bytes(target, token)
            return {"id": token, "logprob": logprob, "token": raw.decode("utf-8", "replace"), "bytes": list(raw)}

        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}

    def usage(self, finals: dict[int, dict[str, Any]]) -> dict[str, int]:
        return total_usage([finals[i] for i in range(len(self.jobs))], self.per_prompt)

    def result(self, i: int, final: dict[str, Any], streamed: bool) -> dict[str, Any]:
        """llama-server's final result of choice ``i`` (``to_json_non_oaicompat``); a stream's last chunk carries
        no content (it came in the chunks before)."""
        job, stats, usage = self.jobs[i], final["stats"], final["usage"]
        text = self.texts[i]
        reason = stats.get("stop_reason", "")
        times = stats.get("time_s", {})
        prompt_n = usage["prompt_tokens"]
        cached = stats.get("reused_prompt_tokens", 0)
        prefill_ms = times.get("prefill", 0.0) * 1000
        predicted = usage["completion_tokens"]
        predicted_ms = max(0.0, times.get("total", 0.0) * 1000 - prefill_ms - times.get("queue", 0.0) * 1000)
        out = {"index": i, "content": "" if streamed else text, "tokens": [] if streamed else self.ids[i],
               "id_slot": self.slot[i], "stop": True, "model": self.w.role.name, "tokens_predicted": predicted,
               "tokens_evaluated": prompt_n, "generation_settings": request_params(job, self.w.role, self.api.limits),
               "prompt": _text(self.w.target, job.prompt_ids), "has_new_line": "\n" in text, "truncated": False,
               "stop_type": STOP_TYPE.get(reason, "none"), "stopping_word": self._stopping_word(i, reason),
               "tokens_cached": cached,
               "timings": {"cache_n": cached, "prompt_n": prompt_n - cached, "prompt_ms": prefill_ms,
                           "prompt_per_token_ms": prefill_ms / max(1, prompt_n - cached),
                           "prompt_per_second": (prompt_n - cached) / (prefill_ms / 1000) if prefill_ms else 0.0,
                           "predicted_n": predicted, "predicted_ms": predicted_ms,
                           "predicted_per_token_ms": predicted_ms / max(1, predicted),
                           "predicted_per_second": predicted / (predicted_ms / 1000) if predicted_ms else 0.0,
                           "draft_n": stats.get("n_drafted", 0), "draft_n_accepted": stats.get("n_accepted", 0)},
               "speculative": summary(stats)}
        if job.config.logprobs is not None and not streamed:
            out["completion_probabilities"] = self.probs[i]
        return out

    def _stopping_word(self, i: int, reason: str) -> str:
        """The stop string that ended choice ``i``: the text stops where it begins."""
        gen = getattr(self.jobs[i], "gen", None)
        if reason != "stop" or gen is None:
            return ""
        whole = self.w.target.detokenize(gen.output_ids)
        at = len(self.texts[i])
        return next((s for s in self.jobs[i].config.stop if whole.startswith(s, at)), "")

    async def stream(self, request: Request, event: dict[str, Any]) -> AsyncIterator[str]:
        """SSE chunks as llama-server sends them: one per delta (``stop: false``), then each choice's final
        result (``stop: true``); no ``[DONE]``, as the native route has none."""
        api, w, jobs = self.api, self.w, self.jobs
        finals: dict[int, dict[str, Any]] = {}
        try:
            while True:
                i = event["index"]
                if event["type"] == "error":
                    finals[i] = event
                    yield json.dumps({"error": {"code": event["status"], "message": event["message"],
                                                "type": event["kind"], "param": event.get("param")}})
                    return
                part = self.add(event)
                if event["type"] == "delta":
                    yield json.dumps({"index": i, **part, "stop": False, "id_slot": self.slot[i],
                                      "tokens_predicted": len(self.ids[i]),
                                      "tokens_evaluated": len(jobs[i].prompt_ids)})
                else:
                    finals[i] = event
                    yield json.dumps(self.result(i, event, streamed=True))
                    if len(finals) == len(jobs):
                        request.state.usage = self.usage(finals)
                        return
                event = await jobs[0].events.get()
        finally:
            if len(finals) < len(jobs):
                api.cancel_all(w, [j for j in jobs if j.index not in finals])
