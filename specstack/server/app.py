"""The OpenAI-compatible HTTP API: completions, chat, models, health, metrics and the live page.

Every error body is OpenAI's ``{"error": {message, type, param, code}}``;
invalid input is a 400 that names the field.  A request's ``speculative``
object overrides its role's defaults (``drafter``, ``k_policy``, ``k``,
``k_max`` and drafter options); every response reports what speculation did.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from importlib import import_module
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Optional, Protocol

import h11
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo,
                      create_model, field_validator)
from pydantic_core import PydanticCustomError
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..drafters.options import DRAFTER_FLAGS, check_drafter_options, inapplicable
from ..draft_length import MAX_DRAFT, POLICIES
from ..drafters.base import check_name
from ..generation import GenerationConfig
from ..errors import SpecstackError
from ..sampling import MAX_LOGPROBS, SamplingParams
from .access import AccessLog
from .chat import ROLES, RenderedChat, chat_tokens, render
from .inputs import ROLE_ALIASES, chat_messages, completion_prompts
from .controls import ControlError, ControlFields, request_constraints, stop_strings
from .prometheus import AnswerCounter, ServerMetrics, note_answer
from .roles import Role, check_mtp
from .structured import StructuredError, grammar_field, request_grammar
from .tools import ChoiceOutput, ToolPlan, ToolRequestError, plan as tool_plan, preserved_tokens
from .worker import Job, QueueFull, RoleWorker

STATIC = Path(__file__).resolve().parent / "static"
CHAT_ROLES = ROLES + tuple(ROLE_ALIASES)  # a message's role as sent (``developer`` is read as ``system``)

# The request's session (``x-session-id`` header, else the body's prompt_cache_key, user or safety_identifier),
# set around ``submit``: a scale-out
# backend routes by it (``scaleout.remote``); the single-process worker has one engine and ignores it.
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("specstack_session", default=None)


class RoleBackend(Protocol):
    """What the routes need of a role: ``RoleWorker`` (one engine in this process, the default) or
    ``scaleout.remote.RemoteRole`` (a Ray Serve deployment of replicas).  One set of routes serves both."""

    role: Role
    ready: Any  # .is_set()
    load_error: str | None
    target: Any  # tokenize, detokenize, token_bytes, capacity, n_vocab, n_ctx, shapes
    template: Any

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit(self, *jobs: Job) -> None: ...
    def cancel(self, job: Job) -> None: ...


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the security defaults of `specstack serve`)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 0  # 0: the role's context
    max_tokens: int = 4096
    timeout_s: float = 600.0
    retry_after_s: int = 1
    # Choices per request (``n``).  Each is its own generation with its own slot; with more choices than
    # slots the rest wait in the queue (and take its places), as separate requests would.
    max_n: int = 16
    # Seconds a request's body may take to arrive whole: a client that stops sending mid-body (short of its
    # Content-Length, or a chunked body never ended) gets 408 instead of holding a connection open for good.
    body_timeout_s: float = 30.0
    # Tokens a request generates when it names no max_tokens (`serve --n-predict`, llama-server's -n).
    default_max_tokens: int = 16


def _speculative_model() -> type[BaseModel]:
    """A request's ``speculative`` object: the k settings plus every per-request drafter flag.

    Built from ``DRAFTER_FLAGS``, so a new drafter flag is a new request key with no second list.
    Types are strict, as for ``k``: ``"2"``, ``2.0`` or ``true`` for an integer option would otherwise be
    read as 2 or 1.  Option values are checked where the flags' are, by the drafters' config dataclasses
    (``check_drafter_options``, before the job is queued).
    """
    k_field = (Optional[int], Field(None, ge=1, le=MAX_DRAFT, strict=True))
    fields: dict[str, Any] = {"drafter": (Optional[str], Field(None, strict=True)),
                              "k_policy": (Optional[Literal[POLICIES]], None), "k": k_field, "k_max": k_field}
    for flag in DRAFTER_FLAGS:
        if flag.per_request:
            fields[flag.dest] = (Optional[flag.type or bool], Field(None, strict=True))
    return create_model("Speculative", __config__=ConfigDict(extra="forbid"), **fields)


Speculative = _speculative_model()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, strict=True)
    include_obfuscation: Optional[bool] = Field(None, strict=True)  # nothing is obfuscated here: only false


class _Common(ControlFields):
    """The fields both endpoints honour (the logit controls' with them: ``controls.ControlFields``).  Anything
    else is a 400: the schemas' other fields by the ``UNIMPLEMENTED`` table, unknown ones as OpenAI does
    ("Unrecognized request argument supplied")."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, strict=True)
    # strict: JSON true is not 1 (max_tokens: true used to mean one token), nor 2.0 an integer
    max_tokens: int | None = Field(None, ge=1, strict=True)
    n_predict: int | None = Field(None, strict=True)  # llama-server's name for max_tokens (``requested_tokens``)
    temperature: float = Field(1.0, ge=0, le=100, strict=True)
    top_p: float = Field(1.0, gt=0, le=1, strict=True)
    top_k: int = Field(0, ge=0, strict=True)
    min_p: float = Field(0.0, ge=0, le=1, strict=True)
    seed: int | None = Field(None, strict=True)
    # Session keys for routing (``SESSION``) when no x-session-id is sent: OpenAI's prompt_cache_key groups
    # requests that share a prefix; user (deprecated) and safety_identifier name the end user.
    prompt_cache_key: str | None = Field(None, strict=True)
    user: str | None = Field(None, strict=True)
    safety_identifier: str | None = Field(None, strict=True)
    stop: str | list[StrictStr | StrictInt] | None = None  # an integer entry is a stop token id (``controls``)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, strict=True, description="choices; at most Limits.max_n")
    n_cmpl: int | None = Field(None, ge=1, strict=True)  # llama-server's name for n
    speculative: Speculative | None = None
    # Structured output (``structured``): OpenAI's response_format, llama-server's json_schema and grammar (GBNF)
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = Field(None, strict=True)


class _CompletionFields(_Common):
    # text, token ids, llama-server's mix of both ([12, "text", 34]), or a list of these: one choice set per prompt
    prompt: str | list[StrictInt | StrictStr | list[StrictInt | StrictStr]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool = Field(False, strict=True)


class CalledFunction(BaseModel):
    """The function of an assistant message's earlier call: its arguments are JSON text, as OpenAI and llama-server
    take them (a template that needs an object gets one from ``chat``)."""

    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """One call of an assistant message sent back: all of OpenAI's keys, each required (a call without its id or
    function used to be dropped from the prompt without a word)."""

    model_config = ConfigDict(extra="forbid")
    id: StrictStr
    type: Literal["function"]
    function: CalledFunction


class Message(BaseModel):
    """A chat message as OpenAI's schema has it: known keys only, strictly typed, and what each role needs.

    Keys are checked in the order declared, so the role is known when the keys that depend on it are: only
    an assistant message has ``tool_calls``, only a tool message (which needs it) ``tool_call_id``; every
    message needs ``content`` but an assistant's that makes calls.  Each rule's 400 names the key
    (``messages[1].tool_call_id``), where the template would otherwise have got a message it did not expect."""

    model_config = ConfigDict(extra="forbid")
    role: Literal[CHAT_ROLES]
    tool_calls: list[MessageToolCall] | None = Field(None, validate_default=True)
    tool_call_id: StrictStr | None = Field(None, validate_default=True)
    content: StrictStr | list[dict[str, Any]] | None = Field(None, validate_default=True)
    name: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # llama-server's: an assistant's reasoning, for templates that show it
    refusal: None = None  # in OpenAI's assistant messages as they come back; only null (no refusal) changes nothing

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistant_s(cls, value: Any, info: ValidationInfo) -> Any:
        return _role_key(value, info, "tool_calls", "assistant")

    @field_validator("tool_call_id")
    @classmethod
    def _tool_messages_answer_a_call(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") == "tool":
            raise PydanticCustomError("missing", "a tool message needs the tool_call_id of the call it answers")
        return _role_key(value, info, "tool_call_id", "tool")

    @field_validator("content")
    @classmethod
    def _content_is_there(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role is not None and not (role == "assistant" and info.data.get("tool_calls")):
            needs = "content or tool_calls" if role == "assistant" else "content"
            raise PydanticCustomError("missing", f"{'an' if role == 'assistant' else 'a'} {role} message needs {needs}")
        return value


def _role_key(value: Any, info: ValidationInfo, key: str, role: str) -> Any:
    """``value`` of a message key that only ``role``'s messages have (OpenAI refuses it on the others)."""
    if value is not None and info.data.get("role") not in (role, None):
        raise PydanticCustomError("role_key", f"only {role} messages have {key}")
    return value


class _ChatFields(_Common):
    messages: list[Message] = Field(min_length=1)
    # Function tools (``tools``): rendered by the role's template, the output read back as tool_calls
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)


Neutral = tuple[Any, ...] | Callable[[Any, "_Common"], bool]


@dataclass(frozen=True)
class Unimplemented:
    """A field of the OpenAI or llama-server request schema that this server does not do.

    It is read with its schema's type (strictly: a value of the wrong type is always a 400), and accepted
    only at a value that changes nothing, its default or documented "off" (``neutral``: the values, or a
    test of the value against the request); any other value is a 400 naming it.  A 200 never means that
    a field was ignored: a client that asked for a penalty or a grammar must learn it did not get one.
    """

    name: str
    type: Any
    neutral: Neutral
    why: str
    routes: tuple[str, ...] = ("completions", "chat")

    def accepts(self, value: Any, body: "_Common") -> bool:
        if callable(self.neutral):
            return self.neutral(value, body)
        return any(_same(value, v) for v in self.neutral)


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps numbers and booleans apart (``False == 0`` in Python)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


# llama.cpp's sampler names (``common_sampler_types_from_names``, alternative names, and the one-letter
# codes of a ``samplers`` string), by canonical name.
SAMPLER_NAMES = {
    "dry": ("dry", "d"), "top_k": ("top_k", "top-k", "k"), "typ_p": ("typ_p", "typical_p", "typical-p", "typical",
    "typ-p", "typ", "y"), "top_p": ("top_p", "top-p", "nucleus", "p"), "min_p": ("min_p", "min-p", "m"),
    "xtc": ("xtc", "x"), "temperature": ("temperature", "temp", "t"), "top_n_sigma": ("top_n_sigma", "top-n-sigma", "s"),
    "penalties": ("penalties", "e"), "infill": ("infill", "i"),
}
_SAMPLER_BY_NAME = {alias: name for name, aliases in SAMPLER_NAMES.items() for alias in aliases}
# Samplers this server applies, in its order (``constraints``, then ``sampling``), and each one's test for being
# off in a request (penalties: every penalty field left out or at its neutral value).
SAMPLER_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")
SAMPLER_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
_PENALTIES_OFF = {"repeat_penalty": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
# Samplers that do nothing at the neutral values this server requires of their settings (``UNIMPLEMENTED``).
SAMPLER_IDLE = ("dry", "typ_p", "xtc", "top_n_sigma")


def _sampler_off(name: str, body: "_Common") -> bool:
    if name == "penalties":
        return all(getattr(body, f) in (None, off) for f, off in _PENALTIES_OFF.items()) or body.repeat_last_n == 0
    return getattr(body, name) == SAMPLER_OFF[name]


def samplers_as_applied(value: str | list[str], body: "_Common") -> bool:
    """A llama-server ``samplers`` chain is honoured when it is the chain this server applies: its active
    samplers in this server's order, each at most once, and every sampler it leaves out at its off value
    (a sampler not in the chain is not used).  Idle samplers may stand anywhere."""
    names = list(value) if isinstance(value, str) else value
    chain = [_SAMPLER_BY_NAME.get(n) for n in names]
    if None in chain or "infill" in chain:
        return False
    active = [n for n in chain if n not in SAMPLER_IDLE]
    if len(set(active)) != len(active) or active != [n for n in SAMPLER_ORDER if n in active]:
        return False
    return all(_sampler_off(n, body) for n in SAMPLER_ORDER if n not in active)


def _best_of_is_n(value: int, body: "_Common") -> bool:
    """best_of = n: n candidates, all returned, is what n alone does."""
    return value == (body.n_cmpl or body.n)


PENALTY = "DRY penalties are not implemented (repeat_penalty, frequency_penalty and presence_penalty are)"
SAMPLER = "this sampler is not implemented (the server samples with temperature, top_k, top_p and min_p)"
TOOLS = "tools are a chat field: send them to /v1/chat/completions"
FUNCTIONS = "the deprecated functions and function_call are not supported: send tools and tool_choice"
NOT_STORED = "completions are not stored here"
TEMPLATE = "the chat template is the role's (its chat_template setting)"
LOGPROBS = "ask for logprobs (completions) or logprobs with top_logprobs (chat)"
TEXT_ONLY = "this server takes and gives text only"
F, I, B, S = StrictFloat, StrictInt, StrictBool, StrictStr
OBJECT = dict[str, Any]

UNIMPLEMENTED = (
    # OpenAI, both endpoints
    Unimplemented("functions", list[Any], ([],), FUNCTIONS),
    Unimplemented("function_call", S | OBJECT, ("none",), FUNCTIONS),
    # OpenAI completions
    Unimplemented("best_of", I, _best_of_is_n, "ranking more candidates than the n returned is not implemented; "
                  "ask for n choices", ("completions",)),
    Unimplemented("suffix", S, ("",), "insertion (text after the completion) is not implemented", ("completions",)),
    Unimplemented("max_completion_tokens", I, (), "it is a chat field; /v1/completions takes max_tokens",
                  ("completions",)),
    Unimplemented("tools", list[Any], ([],), TOOLS, ("completions",)),
    Unimplemented("tool_choice", S | OBJECT, ("none",), TOOLS, ("completions",)),
    Unimplemented("parallel_tool_calls", B, (), TOOLS, ("completions",)),
    # OpenAI chat
    Unimplemented("audio", OBJECT, (), TEXT_ONLY, ("chat",)),
    Unimplemented("modalities", list[S], (["text"],), TEXT_ONLY, ("chat",)),
    Unimplemented("prediction", OBJECT, (), "predicted outputs are not implemented", ("chat",)),
    Unimplemented("store", B, (False,), NOT_STORED, ("chat",)),
    Unimplemented("metadata", dict[S, S], ({},), NOT_STORED + ", so there is nothing to tag", ("chat",)),
    Unimplemented("reasoning_effort", S, (), "there is no reasoning control", ("chat",)),
    Unimplemented("verbosity", S, (), "there is no verbosity control", ("chat",)),
    Unimplemented("service_tier", S, ("auto", "default"), "there is one service tier", ("chat",)),
    Unimplemented("web_search_options", OBJECT, (), "there is no web search", ("chat",)),
    # llama-server's /completion fields (it takes them on both OpenAI routes too)
    Unimplemented("dry_multiplier", F, (0,), PENALTY),
    Unimplemented("dry_base", F, (1.75,), PENALTY),
    Unimplemented("dry_allowed_length", I, (2,), PENALTY),
    Unimplemented("dry_penalty_last_n", I, (-1, 0, 64), PENALTY),
    Unimplemented("dry_sequence_breakers", list[S], (["\n", ":", "\"", "*"],), PENALTY),
    Unimplemented("dynatemp_range", F, (0,), SAMPLER),
    Unimplemented("dynatemp_exponent", F, (1,), SAMPLER),
    Unimplemented("typical_p", F, (1,), SAMPLER),
    Unimplemented("xtc_probability", F, (0,), SAMPLER),
    Unimplemented("xtc_threshold", F, (0.1,), SAMPLER),
    Unimplemented("mirostat", I, (0,), SAMPLER),
    Unimplemented("mirostat_tau", F, (5,), SAMPLER),
    Unimplemented("mirostat_eta", F, (0.1,), SAMPLER),
    Unimplemented("top_n_sigma", F, (-1,), SAMPLER),
    Unimplemented("min_keep", I, (0,), SAMPLER),
    Unimplemented("samplers", S | list[S], samplers_as_applied,
                  f"the only chain applied here is {', '.join(SAMPLER_ORDER)} (a sampler left out must be off)"),
    Unimplemented("n_probs", I, (0,), LOGPROBS),
    Unimplemented("post_sampling_probs", B, (False,), LOGPROBS),
    Unimplemented("t_max_predict_ms", I, (0,), "per-request time limits are not implemented (the server has --timeout)"),
    Unimplemented("id_slot", I, (-1,), "each request takes the next free slot"),
    Unimplemented("cache_prompt", B, (True,), "a prompt's cached KV is always reused"),
    Unimplemented("n_cache_reuse", I, (0,), "KV shifting is not implemented"),
    Unimplemented("n_keep", I, (0, -1), "the context is never shifted"),
    Unimplemented("n_indent", I, (0,), "indentation limits are not implemented"),
    Unimplemented("return_tokens", B, (False,), "token ids are not returned (streamed chunks carry specstack.tokens)"),
    Unimplemented("return_progress", B, (False,), "prompt progress is not reported"),
    Unimplemented("timings_per_token", B, (False,), "timings come once per response, under speculative"),
    Unimplemented("sse_ping_interval", F, (), "streams are pinged every 15 s"),
    Unimplemented("response_fields", list[S], ([],), "responses are always whole"),
    Unimplemented("lora", list[Any], ([],), "LoRA adapters are not supported"),
    Unimplemented("image_data", list[Any], ([],), TEXT_ONLY),
    Unimplemented("multimodal_data", list[Any], ([],), TEXT_ONLY),
    # llama-server's chat fields
    Unimplemented("chat_template", S, (), TEMPLATE, ("chat",)),
    Unimplemented("chat_template_kwargs", OBJECT, ({},), TEMPLATE, ("chat",)),
    Unimplemented("add_generation_prompt", B, (True,), "the assistant's turn is always opened", ("chat",)),
    Unimplemented("reasoning_format", S, ("none",), "reasoning is not parsed out of the text", ("chat",)),
    Unimplemented("reasoning_control", B, (False,), "there is no reasoning control", ("chat",)),
)


def _request_model(base: type[BaseModel], route: str) -> type[BaseModel]:
    """``base`` plus the route's ``UNIMPLEMENTED`` fields, each optional and strictly typed (``Strict*`` types)."""
    fields = {u.name: (Optional[u.type], None) for u in UNIMPLEMENTED if route in u.routes}  # types: Strict*
    return create_model(base.__name__.lstrip("_").replace("Fields", "Request"), __base__=base, **fields)


CompletionRequest = _request_model(_CompletionFields, "completions")
ChatRequest = _request_model(_ChatFields, "chat")


def unsupported(body: _Common) -> None:
    """400 for a field this server would otherwise ignore: the client must know it was not honoured."""
    route = "chat" if isinstance(body, _ChatFields) else "completions"
    for u in UNIMPLEMENTED:
        value = getattr(body, u.name, None) if route in u.routes else None
        if value is not None and not u.accepts(value, body):
            allowed = "" if callable(u.neutral) or not u.neutral else \
                " or send " + " or ".join(json.dumps(v) for v in u.neutral)
            raise ApiError(400, f"{u.name} is not supported by specstack serve: {u.why}; leave it out{allowed} "
                                f"(got {_shown_value(value)})", param=u.name)
    if body.stream_options is not None and not body.stream:  # OpenAI's and vLLM's 400: it says nothing otherwise
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise ApiError(400, "stream_options.include_obfuscation: this server adds no obfuscation to stream chunks; "
                            "leave it out or send false", param="stream_options.include_obfuscation")
    if isinstance(body, _CompletionFields) and body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (it needs the prompt tokens' logprobs); ask for "
                       "one or the other", param="echo")
    if isinstance(body, _ChatFields) and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    bad = _invalid_text(body.model_dump(exclude_none=True))
    if bad is not None:
        raise ApiError(400, f"{bad} holds a lone UTF-16 surrogate (such as \\ud800), which is not Unicode text and "
                       "cannot be tokenized; send valid UTF-8", param=bad)


def _shown_value(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def requested_tokens(body: _Common, default: int = 16) -> tuple[int, str]:
    """How many tokens a request may generate, and the field that said so (errors name it): max_tokens,
    chat's max_completion_tokens or llama-server's n_predict; ``default`` when none is given (16, as OpenAI's
    completions, unless `serve --n-predict` says otherwise)."""
    given = [(name, getattr(body, name)) for name in ("max_tokens", "max_completion_tokens", "n_predict")
             if getattr(body, name, None) is not None]
    if not given:
        return default, "max_tokens"
    name, value = given[-1]
    if any(v != value for _, v in given):
        raise ApiError(400, f"{' and '.join(n for n, _ in given)} disagree ({', '.join(str(v) for _, v in given)}); "
                            "send one of them", param=name)
    if value < 1:
        raise ApiError(400, f"{name} must be >= 1 (got {value}); this server has no unlimited generation", param=name)
    return value, name


def requested_choices(body: _Common) -> int:
    """Choices asked for: ``n``, or llama-server's ``n_cmpl``."""
    if body.n_cmpl is None:
        return body.n
    if "n" in body.model_fields_set and body.n != body.n_cmpl:
        raise ApiError(400, f"n and n_cmpl disagree ({body.n} and {body.n_cmpl}); send one of them", param="n_cmpl")
    return body.n_cmpl


def field_path(loc: Any) -> str | None:
    """A pydantic error location as the request field it names: ``speculative.k``, ``messages[0].content``.

    A union's member tags (``str``, ``list[int]``) and the leading ``body`` are not fields."""
    path = ""
    for part in loc[:len(loc) - len(_tail(loc))]:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".") or None


def _tail(loc: Any) -> tuple:
    """The part of an error location from the first union member tag on (empty when there is none)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS):
            return tuple(loc[i:])
    return ()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _invalid_text(value: Any, where: str = "") -> str | None:
    """The path of the first string that cannot be UTF-8 (JSON's "\\ud800" decodes to a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _invalid_text(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def exactness(w: RoleBackend) -> dict[str, Any]:
    """The ``--exact`` mode a role runs in and why (auto decides at load, by measurement)."""
    shapes = w.target.shapes if w.target is not None and w.target.shapes.settled else None
    if shapes is None:
        return {"requested": w.role.exact, "mode": None, "why": "not loaded yet"}
    return {"requested": w.role.exact, "mode": "on" if shapes.exact else "off", "why": shapes.why}


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


DISCONNECT_POLL_S = 0.25  # how often a waiting request looks for its client having gone


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.response = error(status, message, kind, param, code, headers)


class Guard:
    """Body size, body read time and API key, checked before any route runs: a plain ASGI middleware.

    Starlette's ``@app.middleware("http")`` wraps ``receive``, so a route's ``request.is_disconnected()``
    never saw a non-streaming client leave, and its generation held a slot for minutes (vLLM moved to a
    plain ASGI middleware for the same reason).  A body is read here whole, up to the size limit and within
    ``body_timeout_s``: one without a Content-Length (``Transfer-Encoding: chunked``) cannot reach the
    tokenizer by being unannounced, and one that stops arriving is a 408, not a connection held forever.
    """

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None, body_timeout_s: float = 30.0) -> None:
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) + 4 for k, v in scope.get("headers", [])) > MAX_HEAD_BYTES:
            # HeadLimitedH11 refuses such a head as it arrives; this catches one that came another way (a pipelined
            # request read whole in one go, or uvicorn's httptools protocol, which has no limit).
            return await error(431, HEAD_TOO_LARGE, code="request_header_fields_too_large",
                               headers={"Connection": "close"})(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(length, scope, receive, send)
        if self.api_key and needs_key(scope["path"]) and not authorized(headers.get("authorization"), self.api_key):
            return await error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "authentication_error",
                               code="invalid_api_key")(scope, receive, send)
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
            except asyncio.TimeoutError:
                return await error(408, f"the request body did not arrive whole within {self.body_timeout_s:g} s "
                                        "(short of its Content-Length, or a chunked body never ended)",
                                   code="request_timeout", headers={"Connection": "close"})(scope, receive, send)
            except _BodyTooLarge:
                return await self._too_large(f"more than {self.max_body_bytes}", scope, receive, send)
            if body is None:  # the client went away
                return None
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body; None when the client disconnects, ``_BodyTooLarge`` when it grows past the limit."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _too_large(self, size: str, scope: dict, receive: Any, send: Any) -> None:
        await error(413, f"the request body has {size} bytes; the limit is {self.max_body_bytes} "
                         "(start the server with a larger --max-body)", code="body_too_large")(scope, receive, send)


# What --api-key guards: the OpenAI routes and llama-server's (``llama_api``); the probes (/health, /v1/health,
# /metrics) and the live page (which sends the key itself) stay open, and an unknown path is a plain 404.
PUBLIC_PATHS = frozenset({"/v1/health"})  # llama-server's public endpoints (server-http.cpp), beside /health
LLAMA_PATHS = frozenset({"/completion", "/completions", "/tokenize", "/detokenize", "/apply-template", "/props",
                         "/slots", "/embedding", "/embeddings"})


def needs_key(path: str) -> bool:
    path = path.rstrip("/")
    return path not in PUBLIC_PATHS and (path.startswith("/v1/") or path in LLAMA_PATHS)


class _BodyTooLarge(Exception):
    """A body that grew past --max-body while it was read."""


def authorized(header: str | None, key: str) -> bool:
    """``Authorization: Bearer KEY``, the scheme in any case (RFC 7235: auth schemes are case-insensitive)."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that gives the body already read, then passes on (a disconnect is still seen)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# The request line and headers together, at most: nginx's large_client_header_buffers (4 x 8 KiB) and
# h11's own default are in the same range.  A longer head is answered 431.
MAX_HEAD_BYTES = 32 << 10
HEAD_TOO_LARGE = (f"the request line and headers are over {MAX_HEAD_BYTES} bytes; send less (a long header value "
                  "such as a cookie, or a body sent as a header)")
LINGER_S = 2.0  # how long a refused connection's further input is read and dropped before it is closed


class HeadLimitedH11(H11Protocol):
    """uvicorn's h11 protocol, answering a request head over ``MAX_HEAD_BYTES`` with 431 in OpenAI's error body.

    httptools, the protocol uvicorn picks when it is installed, takes a head of any size (10 MiB of
    headers got a 200), and h11 limits only a head still incomplete when a read ends (a whole 200 KB head
    in one read passed; an unfinished one is a plain 400).  So the head is measured here as it arrives.
    The connection then lingers a moment, its input dropped, so that the client reads the answer before
    the close (closing with unread input resets the connection, and the client may never see the 431)."""

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a request head is (still) arriving: count it to its blank line
            pending = self.conn.trailing_data[0] + data
            end = pending.find(b"\r\n\r\n")
            if (len(pending) if end < 0 else end + 4) > MAX_HEAD_BYTES:
                return self._refuse_head()
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) <= MAX_HEAD_BYTES:  # h11's own limit (h11_max_incomplete_event_size)
            return super().send_400_response(msg)
        self._refuse_head()

    def _refuse_head(self) -> None:
        body = json.dumps({"error": {"message": HEAD_TOO_LARGE, "type": "invalid_request_error", "param": None,
                                     "code": "request_header_fields_too_large"}}).encode()
        # Written as bytes: h11 sends no response to a request it has not read (nor, in every state, to one it failed).
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.data_received = lambda data: None  # type: ignore[method-assign]  # the rest of the head is dropped
        self.loop.call_later(LINGER_S, self.transport.close)


def http_options() -> dict[str, Any]:
    """The uvicorn settings `specstack serve` runs with (``uvicorn.run(app, **http_options())``): the head limit."""
    return {"http": HeadLimitedH11, "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def create_app(roles: list[Role], limits: Limits = Limits(), api_key: str | None = None, max_queue: int = 16,
               backends: dict[str, RoleBackend] | None = None,
               render_metrics: Callable[[], Awaitable[bytes]] | None = None,
               role_health: Callable[[], Awaitable[dict[str, tuple[str | None, dict[str, Any]]]]] | None = None,
               access_log: Callable[[str], None] | None = None, slots: bool = True) -> FastAPI:
    """The API over ``roles``: by default one ``RoleWorker`` each in this process; ``backends`` (by role name),
    ``render_metrics`` and ``role_health`` put other engines behind the same routes (``specstack serve --ray``).

    ``role_health`` gives, by role name, why the role cannot take traffic yet (None: it can) and what its
    /health entry adds (replicas up, under --ray).  ``access_log`` gets one line per request (``access``; None:
    none); ``slots=False`` turns llama-server's ``GET /slots`` off (``--no-slots``)."""
    metrics = ServerMetrics()
    workers: dict[str, RoleBackend] = backends if backends is not None else {
        r.name: RoleWorker(r, metrics, max_queue) for r in roles}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for w in workers.values():
            w.start()
        yield
        for w in workers.values():  # after uvicorn has drained in-flight requests
            await asyncio.to_thread(w.stop)

    # SIGTERM drains: uvicorn stops accepting and waits for open requests (up to --timeout), streams
    # too.  sse-starlette would otherwise end every open stream at once, without its finish chunk or [DONE].
    AppStatus.disable_automatic_graceful_drain()
    app = FastAPI(title="specstack", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.workers = workers
    app.state.metrics = metrics
    app.state.http_options = http_options()  # what uvicorn serves it with (`specstack serve`: the header limit)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON: {first.get('msg')}", param=None, code="invalid_json")
        param = field_path(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
            return error(400, f"Unrecognized request argument supplied: {param}", param=param)
        # A field of several types (prompt: text or token ids) fails once per type: say each.
        tried = [f"{e['loc'][len(e['loc']) - len(_tail(e['loc']))]}: {e['msg']}" for e in errors
                 if field_path(e.get("loc", ())) == param and _tail(e["loc"])]
        detail = f"none of its types fits ({'; '.join(dict.fromkeys(tried))})" if len(tried) > 1 else \
            first.get("msg", "invalid value")
        return error(400, f"{param or 'body'}: {detail}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    app.add_middleware(Guard, max_body_bytes=limits.max_body_bytes, api_key=api_key,
                       body_timeout_s=limits.body_timeout_s)
    app.add_middleware(AnswerCounter, metrics=metrics, roles=list(workers))  # outside Guard: its refusals count
    if access_log is not None:  # outermost: Guard's refusals are logged too
        app.add_middleware(AccessLog, write=access_log)

    def worker_for(model: str | None) -> RoleBackend:
        if model is None or model not in workers:
            if model is not None and len(workers) > 1:
                raise ApiError(404, f"model {model!r} is not served here; choose one of: {', '.join(workers)}",
                               "not_found_error", "model", "model_not_found")
            w = next(iter(workers.values()))
        else:
            w = workers[model]
        note_answer(role=w.role.name)  # the role an error answer from here on is counted under
        if not w.ready.is_set():
            raise ApiError(503, "the model is still loading; retry shortly", "unavailable_error", headers={"Retry-After": "2"})
        if w.load_error:
            raise ApiError(503, f"role {w.role.name!r} failed to load: {w.load_error}", "unavailable_error")
        return w

    @app.get("/health")
    @app.get("/v1/health")  # llama-server serves both, neither behind the key
    async def health() -> JSONResponse:
        failed = [f"{w.role.name}: {w.load_error}" for w in workers.values() if w.load_error]
        if failed:
            return error(503, "; ".join(failed), "unavailable_error", code="503")
        if not all(w.ready.is_set() for w in workers.values()):
            return error(503, "Loading model", "unavailable_error", code="503")
        extra = await role_health() if role_health is not None else {}
        down = [f"{name}: {why}" for name, (why, _) in extra.items() if why]
        if down:
            return error(503, "; ".join(down), "unavailable_error", code="503")
        return JSONResponse({"status": "ok", "roles": {
            w.role.name: {"exact": exactness(w), "lossy": getattr(w, "lossy", None),
                          **extra.get(w.role.name, (None, {}))[1]} for w in workers.values()}})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await render_metrics() if render_metrics is not None else metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": w.role.name, "object": "model", "created": 0, "owned_by": "specstack",
             "speculative": {"drafter": w.role.drafter, "k_policy": w.role.k_policy, "k": w.role.k,
                             "parallel": w.role.parallel, "exact": exactness(w)},
             "chat_template": w.template.origin if w.template else None,
             "n_ctx": w.target.n_ctx if w.target else None}
            for w in workers.values()]})

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        unsupported(body)
        w = worker_for(body.model)
        return await run(request, w, body, prompt_ids(body.prompt, w.target), chat=False, grammar=grammar_for(body, w))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        unsupported(body)
        w = worker_for(body.model)
        tools = tools_for(body, w)
        return await run(request, w, body, [chat_tokens(chat_prompt(body, w, tools), w.target)], chat=True,
                         grammar=grammar_for(body, w, tools), tools=tools)

    def chat_prompt(body: _Common, w: RoleBackend, tools: ToolPlan | None = None) -> RenderedChat:
        """A chat request's prompt through the role's template (chat, and llama-server's /apply-template);
        ``developer`` messages are system messages, as llama-server and vLLM read them.  The request's tools
        (``tools_for``) go to the template, with their format's instruction and example where it has them."""
        tools = tools if tools is not None else tools_for(body, w)
        try:
            # the keys each message was sent with (a template may test whether one is defined), but no refusal
            messages = chat_messages([m.model_dump(exclude_unset=True, exclude={"refusal"}) for m in body.messages])
            if tools is None:
                return render(messages, w.template)
            return render(messages, w.template, tools=list(tools.raw), tool_example=tools.format.example(tools.parallel),
                          system_note=tools.format.system_note)
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def tools_for(body: _Common, w: RoleBackend) -> ToolPlan | None:
        """A chat request's tools (None: none, or tool_choice none): which, how the model must call them, and the
        format its calls are read in (the role's ``tool_call_format``, else read from its chat template)."""
        if getattr(body, "tools", None) is None and getattr(body, "tool_choice", None) is None:
            return None
        template = w.template
        source = template.text if template is not None and template.kind == "jinja" else None
        try:
            p = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, source,
                          getattr(w.role, "tool_call_format", None))
        except ToolRequestError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except SpecstackError as exc:  # the role's tool_call_format names no format
            raise ApiError(500, f"role {w.role.name!r}: {exc}", "server_error") from None
        return p if p.active else None

    def prompt_ids(prompt: Any, target: Any) -> list[list[int]]:
        """A completions ``prompt`` as one token list per prompt (``inputs.completion_prompts``)."""
        try:
            return completion_prompts(prompt, target)
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="prompt") from None

    async def start(request: Request, w: RoleBackend, body: _Common, prompts: list[list[int]], chat: bool,
                    grammar: str | None = None) -> tuple[list[Job], dict[str, Any]]:
        """A request's jobs submitted and their first event (``ApiError`` for a refusal, 499 for a client gone)."""
        if grammar:
            await prepared(w, grammar, grammar_field(body))
        jobs = make_jobs(w, body, prompts, "messages" if chat else "prompt", grammar)
        token = SESSION.set(request.headers.get("x-session-id") or body.prompt_cache_key or body.user
                            or body.safety_identifier)
        try:
            w.submit(*jobs)
        except QueueFull as exc:
            raise ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(limits.retry_after_s)}) from None
        finally:
            SESSION.reset(token)
        first = await next_event(request, w, jobs)
        if first is None:
            raise ApiError(499, "the client closed the connection")  # the jobs were cancelled
        if first["type"] == "error":
            cancel_all(w, jobs)
            raise ApiError(first["status"], first["message"], first["kind"], param=first.get("param"),
                           code=first.get("code"), headers=first.get("headers"))
        return jobs, first

    async def prepared(w: RoleBackend, grammar: str, field: str) -> None:
        """Build the request's grammar on the grammar thread while the request waits, so that the role's engine
        thread, which decodes every other request, only copies it (``llama.grammar.GrammarCache``)."""
        prepare = getattr(w.target, "prepare_grammar", None)
        if prepare is None:  # a remote role builds it where it runs
            return
        try:
            await asyncio.wrap_future(prepare(grammar))
        except SpecstackError as exc:
            raise ApiError(400, f"{field}: {exc}", param=field) from None

    async def run(request: Request, w: RoleBackend, body: _Common, prompts: list[list[int]], chat: bool,
                  grammar: str | None = None, tools: ToolPlan | None = None) -> Response:
        jobs, first = await start(request, w, body, prompts, chat, grammar)
        outputs = outputs_for(w, jobs, tools)  # chat with tools: each choice read as a message
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        per_prompt = len(jobs) // len(prompts)
        echoes = [w.target.detokenize(job.prompt_ids) if getattr(body, "echo", False) else "" for job in jobs]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(stream(request, w, jobs, first, rid, chat, include_usage, echoes, per_prompt,
                                              outputs), ping=15)
        texts = list(echoes)
        logprobs = [LogprobsOut(w.target, chat, len(echo)) for echo in echoes]
        finals: dict[int, dict[str, Any]] = {}
        event: dict[str, Any] | None = first
        while True:
            i = event["index"]
            if event["type"] == "error":
                cancel_all(w, jobs)
                return error_event(event)
            if event["type"] == "delta":
                texts[i] += event["text"]
                logprobs[i].add(event)
                if outputs is not None:
                    outputs[i].add(event, deltas=False)
            else:
                finals[i] = event
                if len(finals) == len(jobs):
                    break
            event = await next_event(request, w, jobs)
            if event is None:
                return Response(status_code=499)
        wanted = jobs[0].config.logprobs is not None
        finals_list = [finals[i] for i in range(len(jobs))]
        request.state.usage = total_usage(finals_list, per_prompt)  # for the access log
        for output in outputs or ():
            output.finish()
        return JSONResponse(final_body(rid, w.role.name, texts, finals_list, chat,
                                       [lp.body() for lp in logprobs] if wanted else None, per_prompt, outputs))

    def cancel_all(w: RoleBackend, jobs: list[Job]) -> None:
        for job in jobs:
            w.cancel(job)

    def make_jobs(w: RoleBackend, body: _Common, prompts: list[list[int]], prompt_field: str = "prompt",
                  grammar: str | None = None) -> list[Job]:
        """``n`` jobs per prompt (a request's choices), checked once: choice i of a prompt samples with ``seed + i``
        (a negative or absent seed: each its own random one), and all share one events queue, their events tagged
        with the choice's index (prompt p's choice i is ``p * n + i``).  ``prompt_field`` is what the prompts came
        from (chat: ``messages``), which their errors name; ``grammar`` is the GBNF the request's own fields ask
        for (None: the role's default grammar, if any; ``controls.request_constraints``)."""
        n = requested_choices(body)
        if n * len(prompts) > limits.max_n:
            field = "n_cmpl" if body.n_cmpl is not None else "n"
            if len(prompts) > 1:
                raise ApiError(400, f"{len(prompts)} prompts x {field} {n} are {n * len(prompts)} choices; this server "
                                    f"allows at most {limits.max_n} per request", param=prompt_field)
            raise ApiError(400, f"{field} is {n}; this server allows at most {limits.max_n} choices per request",
                           param=field)
        target = w.target
        limit = min(limits.max_prompt_tokens or target.capacity - 1, target.capacity - 1)
        for p, ids in enumerate(prompts):
            where = f"{prompt_field}[{p}]" if len(prompts) > 1 else prompt_field
            if not ids:
                raise ApiError(400, f"the prompt is empty ({where})", param=prompt_field)
            if len(ids) > limit:
                raise ApiError(400, f"the prompt ({where}) has {len(ids)} tokens; this model's context allows "
                                    f"{limit} (prompt plus at least one new token)",
                               param=prompt_field, code="context_length_exceeded")
            if any(not 0 <= t < target.n_vocab for t in ids):
                raise ApiError(400, f"prompt token ids must be in 0..{target.n_vocab - 1} ({where})", param=prompt_field)
        max_tokens, tokens_field = requested_tokens(body, limits.default_max_tokens)
        if max_tokens > limits.max_tokens:
            raise ApiError(400, f"{tokens_field} is {max_tokens}; this server allows at most {limits.max_tokens}",
                           param=tokens_field)
        spec = body.speculative.model_dump(exclude_none=True) if body.speculative else {}
        if "drafter" in spec:
            check_drafter(spec["drafter"], w.role)
        try:
            check_drafter_options(spec)
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="speculative") from None
        drafter = spec.get("drafter", w.role.drafter)
        unused = inapplicable(drafter, set(spec))
        if unused is not None:
            raise ApiError(400, f"speculative.{unused.dest} applies to drafter {' or '.join(sorted(unused.configs))}, "
                           f"not {drafter!r}; leave it out or choose one of those", param=f"speculative.{unused.dest}")
        if spec.get("tree") and not w.role.spec().verifies_trees:  # it would silently be verified as a chain
            raise ApiError(400, f"speculative.tree: role {w.role.name!r} cannot verify token trees (a role verifies them "
                           "with tree = true and parallel = 1 in its roles file); leave tree out",
                           param="speculative.tree")
        try:
            constraints, stop_ids = request_constraints(body, w.role.controls(), grammar, vocab=target,
                                                        max_tokens=max_tokens)
            stops = stop_strings(body)
        except ControlError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        seed = body.seed if body.seed is not None else w.role.seed
        try:
            sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                      min_p=body.min_p, seed=seed)
            config = GenerationConfig(max_tokens=max_tokens, stop=stops, sampling=sampling,
                                      logprobs=wanted_logprobs(body), constraints=constraints, stop_token_ids=stop_ids)
        except SpecstackError as exc:
            raise ApiError(400, str(exc)) from None
        events: asyncio.Queue = asyncio.Queue()
        deadline = time.perf_counter() + limits.timeout_s if limits.timeout_s > 0 else None
        seeded = seed is not None and seed >= 0
        loop = asyncio.get_running_loop()
        return [Job(ids, config if i == 0 else dataclasses.replace(
                        config, sampling=dataclasses.replace(sampling, seed=seed + i if seeded else seed)),
                    spec, loop, events, deadline, index=p * n + i)
                for p, ids in enumerate(prompts) for i in range(n)]

    def check_drafter(name: str, role: Role) -> None:
        """A request's drafter: a known name, and mtp only where the role's model has a NextN head (refused here,
        from the GGUF's metadata, rather than by the engine thread once the job is queued)."""
        try:
            check_name(name, "speculative.drafter")
            check_mtp(role.model, name, f"speculative.drafter {name!r} on role {role.name!r}",
                      "mtp needs a model with NextN layers: ask for a role whose model has them")
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="speculative.drafter") from None

    async def next_event(request: Request, w: RoleBackend, jobs: list[Job]) -> dict[str, Any] | None:
        """The next event of any of a request's jobs; None (and the jobs cancelled) when the client disconnects.

        The client is checked every ``DISCONNECT_POLL_S`` whether or not events keep coming: a plain
        response's tokens arrive faster than that, and checking only when none came never noticed
        a client that had left (the generation ran on for minutes, holding its slot)."""
        head = jobs[0]
        while True:
            now = time.monotonic()
            if now - head.checked_at >= DISCONNECT_POLL_S:
                head.checked_at = now
                if await request.is_disconnected():
                    cancel_all(w, jobs)
                    return None
            try:
                event = await asyncio.wait_for(head.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if event["type"] == "error" and event.get("metered"):
                note_answer(metered=True)  # the worker counted this failure: its answer is not counted again
            return event

    async def stream(request: Request, w: RoleBackend, jobs: list[Job], event: dict[str, Any], rid: str, chat: bool,
                     include_usage: bool, echoes: list[str] | None = None, per_prompt: int = 1,
                     outputs: list[ChoiceOutput] | None = None) -> AsyncIterator[str]:
        """The choices' chunks as they come, each with its ``index``; every choice ends with its finish chunk,
        the usage chunk (each prompt counted once) and ``[DONE]`` follow the last.  With ``outputs`` (a chat with
        tools) each chunk carries what the re-read message gained: content, or a tool call's id, name and
        arguments as they grow."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        finished: dict[int, dict[str, Any]] = {}
        echoes = echoes or [""] * len(jobs)
        offsets = [len(echo) for echo in echoes]  # text_offset of each choice's next token

        def piece(i: int, choice: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
            return chunk(rid, obj, created, w.role.name, {**choice, "index": i}, include_usage, extra)

        try:
            for i in range(len(jobs)):
                if chat:
                    yield piece(i, {"delta": {"role": "assistant"}, "finish_reason": None})
                if echoes[i]:  # completions' echo: the prompt's text first, even when no token follows
                    yield piece(i, {"text": echoes[i], "logprobs": None, "finish_reason": None})
            while True:
                i = event["index"]
                if event["type"] == "delta":
                    lp = None
                    if event.get("logprobs") is not None:
                        lp = LogprobsOut(w.target, chat, offsets[i])
                        lp.add(event)
                        lp = lp.body()
                    offsets[i] += len(event["text"])
                    if outputs is not None:
                        for n, delta in enumerate(outputs[i].add(event)):
                            yield piece(i, {"delta": delta, "logprobs": lp if n == 0 else None, "finish_reason": None},
                                        {"tokens": event["tokens"]} if n == 0 else None)
                    else:
                        choice = ({"delta": {"content": event["text"]}, "logprobs": lp} if chat
                                  else {"text": event["text"], "logprobs": lp})
                        yield piece(i, {**choice, "finish_reason": None}, {"tokens": event["tokens"]})
                elif event["type"] == "done":
                    finished[i] = event
                    reason = event["finish_reason"]
                    if outputs is not None:
                        for delta in outputs[i].finish():
                            yield piece(i, {"delta": delta, "logprobs": None, "finish_reason": None})
                        reason = outputs[i].finish_reason(reason)
                    choice = {"delta": {}} if chat else {"text": "", "logprobs": None}
                    yield piece(i, {**choice, "finish_reason": reason}, {"speculative": summary(event["stats"])})
                    if len(finished) == len(jobs):
                        usage = total_usage([finished[j] for j in range(len(jobs))], per_prompt)
                        request.state.usage = usage  # for the access log
                        if include_usage:
                            yield json.dumps({"id": rid, "object": obj, "created": created, "model": w.role.name,
                                              "choices": [], "usage": usage})
                        yield "[DONE]"
                        return
                else:
                    finished[i] = event
                    cancel_all(w, [j for j in jobs if j.index not in finished])
                    yield json.dumps({"error": {"message": event["message"], "type": event["kind"],
                                                "param": event.get("param"), "code": event["status"]}})
                    return
                event = await jobs[0].events.get()
        finally:
            if len(finished) < len(jobs):
                cancel_all(w, [j for j in jobs if j.index not in finished])  # the client went away mid-stream

    def grammar_for(body: _Common, w: RoleBackend, tools: ToolPlan | None = None) -> str | None:
        """The GBNF a body's own fields ask for (``grammar``, ``json_schema``, ``response_format``, a chat's
        ``tools``: ``structured.request_grammar``); None: the role's default, "": none (tools own the output)."""
        try:
            grammar = request_grammar(response_format=body.response_format, json_schema=body.json_schema,
                                      grammar=body.grammar, tools=tools)
        except StructuredError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        # An explicit free request (``grammar: ""``, ``response_format`` text) turns a role's default grammar off.
        fmt = body.response_format if isinstance(body.response_format, dict) else {}
        free = body.grammar == "" or fmt.get("type") == "text"
        return "" if grammar is None and (tools is not None or free) else grammar

    preserved: dict[tuple[str, str], dict[int, str]] = {}

    def outputs_for(w: RoleBackend, jobs: list[Job], tools: ToolPlan | None) -> list[ChoiceOutput] | None:
        """Each chat choice's output read as a message when the request has tools (None: plain text)."""
        if tools is None:
            return None
        key = (w.role.name, tools.format.name)
        if key not in preserved:
            preserved[key] = preserved_tokens(w.target, tools.format.markers)
        return [ChoiceOutput(tools, w.target, job, preserved[key]) for job in jobs]

    # What llama-server's routes (``llama_api``, on the same workers) share with these.
    app.state.api = ServeApi(workers=workers, limits=limits, worker_for=worker_for, start=start, next_event=next_event,
                             cancel_all=cancel_all, chat_prompt=chat_prompt, prompt_ids=prompt_ids,
                             unsupported=unsupported, grammar_for=grammar_for, slots=slots)
    app.include_router(import_module(".llama_api", __package__).router)
    return app


@dataclass(frozen=True)
class ServeApi:
    """The routes' shared parts, for the routes of ``llama_api`` (``request.app.state.api``)."""

    workers: dict[str, RoleBackend]
    limits: Limits
    worker_for: Callable[[str | None], RoleBackend]
    start: Callable[..., Awaitable[tuple[list[Job], dict[str, Any]]]]
    next_event: Callable[..., Awaitable[dict[str, Any] | None]]
    cancel_all: Callable[[RoleBackend, list[Job]], None]
    chat_prompt: Callable[[Any, RoleBackend], RenderedChat]
    prompt_ids: Callable[[Any, Any], list[list[int]]]
    unsupported: Callable[[Any], None]
    grammar_for: Callable[[Any, RoleBackend], str | None]
    slots: bool = True


def error_event(event: dict[str, Any]) -> JSONResponse:
    """An engine's error event as the response (a scale-out 429 carries its code and Retry-After)."""
    return error(event["status"], event["message"], event["kind"], param=event.get("param"), code=event.get("code"),
                 headers=event.get("headers"))


def chunk(rid: str, obj: str, created: int, model: str, choice: dict[str, Any], include_usage: bool,
          extra: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [{"index": 0, **choice}]}
    if include_usage:
        body["usage"] = None
    if extra:
        body["specstack"] = extra
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


def wanted_logprobs(body: _Common) -> int | None:
    """Alternatives per token a request asks for (None: no logprobs): completions' ``logprobs: N``,
    chat's ``logprobs: true`` with ``top_logprobs: N``."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


class LogprobsOut:
    """A response's ``logprobs`` in the OpenAI shape of its endpoint, from the engine's ``TokenLogprob``s.

    Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob) and ``text_offset``;
    chat: ``content``, a list of ``{token, logprob, bytes, top_logprobs}``.
    """

    def __init__(self, target: Any, chat: bool, offset: int = 0) -> None:
        self._target, self.chat, self.offset = target, chat, offset
        self.items: list[tuple[str, bytes, Any]] = []

    def add(self, event: dict[str, Any]) -> None:
        for lp in event.get("logprobs") or ():
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


def total_usage(finals: list[dict[str, Any]], per_prompt: int = 1) -> dict[str, int]:
    """A request's usage over its choices (in ``index`` order, ``per_prompt`` choices of each prompt): each prompt
    once (it was processed once), every choice's tokens."""
    prompt = sum(f["usage"]["prompt_tokens"] for f in finals[::max(1, per_prompt)])
    completion = sum(f["usage"]["completion_tokens"] for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def final_body(rid: str, model: str, texts: list[str], finals: list[dict[str, Any]], chat: bool,
               logprobs: list[dict[str, Any]] | None = None, per_prompt: int = 1,
               outputs: list[ChoiceOutput] | None = None) -> dict[str, Any]:
    """A whole response: one choice per text (``index`` in order), the usage over all, and speculation's
    summary (per choice under ``speculative.choices`` when there are several).  With ``outputs`` (a chat with
    tools) each choice's message is its text read back: content and tool_calls."""
    choices = []
    for i, (text, event) in enumerate(zip(texts, finals)):
        lp = logprobs[i] if logprobs is not None else None
        if chat and outputs is not None:
            choices.append({"index": i, "message": outputs[i].message(),
                            "finish_reason": outputs[i].finish_reason(event["finish_reason"]), "logprobs": lp})
        elif chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": event["finish_reason"], "logprobs": lp})
        else:
            choices.append({"index": i, "text": text, "finish_reason": event["finish_reason"], "logprobs": lp})
    spec = summary(finals[0]["stats"])
    if len(finals) > 1:
        spec = {**spec, "choices": [summary(f["stats"]) for f in finals]}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": total_usage(finals, per_prompt), "speculative": spec}
