"""The request schema: what ``/v1/completions``, ``/v1/chat/completions`` and llama-server's routes take.

Pydantic models with strict types (``"2"`` is not 2, ``true`` not 1); every field is honoured or refused with
a 400 that names it (``unsupported``: the ``unimplemented`` table, stream options, echo with logprobs, lone
surrogates).  The functions here read a body's derived settings (tokens, choices, logprobs) and turn a
validation error into OpenAI's error body.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationInfo, create_model,
                      field_validator)
from pydantic_core import PydanticCustomError

from ..drafters.options import DRAFTER_FLAGS
from ..draft_length import MAX_DRAFT, POLICIES
from ..sampling import MAX_LOGPROBS
from .chat import ROLES
from .request_constraints import ConstraintFields
from .inputs import ROLE_ALIASES
from .tools.reasoning import FORMATS as REASONING_FORMATS
from .responses import ApiError, error
from .unimplemented import UNIMPLEMENTED

CHAT_ROLES = ROLES + tuple(ROLE_ALIASES)  # a message's role as sent (``developer`` is read as ``system``)


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
    return create_model("Speculative", __config__=ConfigDict(extra="forbid", allow_inf_nan=False), **fields)


Speculative = _speculative_model()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, strict=True)
    include_obfuscation: Optional[bool] = Field(None, strict=True)  # nothing is obfuscated here: only false


class _Common(ConstraintFields):
    """The fields both endpoints honour (the logit controls' with them: ``request_constraints.ConstraintFields``).  Anything
    else is a 400: the schemas' other fields by the ``UNIMPLEMENTED`` table, unknown ones as OpenAI does
    ("Unrecognized request argument supplied").  NaN and the infinities (JSON's ``NaN``, ``Infinity``, which
    Python's parser takes) are refused as not finite: ``temperature: NaN`` was refused as "less than or equal to
    100"."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = Field(None, strict=True)
    # strict: JSON true is not 1 (max_tokens: true used to mean one token), nor 2.0 an integer; -1: as many as
    # the server allows (llama-server's "until the end"; ``requested_tokens``)
    max_tokens: int | None = Field(None, ge=-1, strict=True)
    n_predict: int | None = Field(None, strict=True)  # llama-server's name for max_tokens (``requested_tokens``)
    # llama-server's: false prefills the whole prompt, no cached prefix reused (``GenerationConfig.reuse_prompt``)
    cache_prompt: bool | None = Field(None, strict=True)
    # llama-server's: the slot the request runs in (-1: the next free one) (``GenerationConfig.slot``)
    id_slot: int | None = Field(None, strict=True)
    # None: the role's default (serve --temp, ...), else the route's: llama-server's on /completion, OpenAI's on
    # /v1/* (``jobs.sampling_for``)
    temperature: float | None = Field(None, ge=0, le=100, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    top_k: int | None = Field(None, ge=0, strict=True)
    min_p: float | None = Field(None, ge=0, le=1, strict=True)
    seed: int | None = Field(None, strict=True)
    # Session keys for routing (``SESSION``) when no x-session-id is sent: OpenAI's prompt_cache_key groups
    # requests that share a prefix; user (deprecated) and safety_identifier name the end user.
    prompt_cache_key: str | None = Field(None, strict=True)
    user: str | None = Field(None, strict=True)
    safety_identifier: str | None = Field(None, strict=True)
    stop: str | list[StrictStr | StrictInt] | None = None  # an integer entry is a stop token id (``request_constraints``)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, strict=True, description="choices; at most Limits.max_n")
    n_cmpl: int | None = Field(None, ge=1, strict=True)  # llama-server's name for n
    speculative: Speculative | None = None
    # llama-server's dotted speculation keys (its /props lists them): n_max is k and k_max, p_min the draft's
    # confidence floor, n_min accepted and not used (a short draft is verified all the same; ``jobs._speculative``)
    spec_n_max: int | None = Field(None, alias="speculative.n_max", ge=1, le=MAX_DRAFT, strict=True)
    spec_n_min: int | None = Field(None, alias="speculative.n_min", ge=0, strict=True)
    spec_p_min: float | None = Field(None, alias="speculative.p_min", ge=0, le=1, strict=True)
    # llama-server's reports: timings_per_token accepted and not used (timings come with each result's end);
    # return_progress streams a chat's prompt progress (``worker.RoleWorker._progress``), other routes send none
    timings_per_token: bool | None = Field(None, strict=True)
    # llama-server's: the answer's __verbose (its native result: the prompt as read, settings, timings); None: the
    # server's (serve --verbose) (``jobs.verbose``)
    verbose: bool | None = Field(None, strict=True)
    return_progress: bool | None = Field(None, strict=True)
    # llama-server's: logprobs (n_probs) read from the distribution each token was sampled from, filters and
    # temperature applied (``GenerationConfig.post_sampling_probs``); /completion shows them as prob and top_probs
    post_sampling_probs: bool | None = Field(None, strict=True)
    # llama-server's backend sampling (sampling on the accelerator): here the sampler always runs on the host, on
    # the same distributions, so either value is honoured as it is (the results are llama-server's both ways)
    backend_sampling: bool | None = Field(None, strict=True)
    # Structured output (``structured``): OpenAI's response_format, llama-server's json_schema and grammar (GBNF)
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = Field(None, strict=True)
    # llama-server's: how a thinking model's <think> block is returned (``tools.reasoning``); chat routes parse it,
    # the completion routes return the text as generated whatever it says (as llama-server's /completion)
    reasoning_format: Optional[Literal[REASONING_FORMATS]] = None


class PromptObject(BaseModel):
    """llama-server's JSON prompt, ``{"prompt_string": ..., "multimodal_data": [...]}``: its text (or ids, or a mix)
    is a prompt like any other; multimodal data is refused where it is read (``inputs``: text only here)."""

    model_config = ConfigDict(extra="forbid")
    prompt_string: StrictStr | list[StrictInt | StrictStr]
    multimodal_data: list[StrictStr] | None = None


class _CompletionFields(_Common):
    # text, token ids, llama-server's mix of both ([12, "text", 34]), its JSON prompt object, or a list of these:
    # one choice set per prompt
    prompt: str | PromptObject | list[StrictInt | StrictStr | list[StrictInt | StrictStr] | PromptObject]
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
    max_completion_tokens: int | None = Field(None, ge=-1, strict=True)
    logprobs: bool = Field(False, strict=True)
    # Template variables (``enable_thinking``, ...), rendered into the role's Jinja template as llama-server does;
    # OpenAI's reasoning_effort goes in as the variable of that name ("none": enable_thinking false)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(None, strict=True)
    # llama-server's and vLLM's: open the assistant's turn (default true), or continue the last message instead
    # (true, "content" or "reasoning_content"; a last assistant message is continued unasked) (``continuation``)
    add_generation_prompt: bool | None = Field(None, strict=True)
    continue_final_message: StrictBool | Literal["content", "reasoning_content"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)




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


def requested_tokens(body: _Common, default: int = -1) -> tuple[int, str]:
    """How many tokens a request may generate, and the field that said so (errors name it): max_tokens,
    chat's max_completion_tokens or llama-server's n_predict; ``default`` when none is given (-1, llama-server's:
    to the end of text or of the context, unless `serve --n-predict` says otherwise)."""
    given = [(name, getattr(body, name)) for name in ("max_tokens", "max_completion_tokens", "n_predict")
             if getattr(body, name, None) is not None]
    if not given:
        return default, "max_tokens"
    name, value = given[-1]
    if any(v != value for _, v in given):
        raise ApiError(400, f"{' and '.join(n for n, _ in given)} disagree ({', '.join(str(v) for _, v in given)}); "
                            "send one of them", param=name)
    if value < 1 and value != -1:
        raise ApiError(400, f"{name} must be >= 1, or -1 for as many as the server allows (got {value})", param=name)
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
    """The part of an error location from the first union member tag on (empty when there is none); a dotted
    key (llama-server's ``speculative.n_max``) is a field."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (not _is_key(part) or part in _TYPE_TAGS):
            return tuple(loc[i:])
    return ()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_key(part: str) -> bool:
    return all(word.isidentifier() for word in part.split("."))


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



def wanted_logprobs(body: _Common) -> int | None:
    """Alternatives per token a request asks for (None: no logprobs): completions' ``logprobs: N``,
    chat's ``logprobs: true`` with ``top_logprobs: N``."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def invalid_response(exc: RequestValidationError) -> JSONResponse:
    """A body that fails the schema as OpenAI's 400: invalid JSON, an unknown field in OpenAI's words, or the
    field and why (a field of several types says why each failed)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error(400, f"the request body is not valid JSON ({first.get('msg')}): send one JSON object, e.g. "
                     "curl -H 'Content-Type: application/json' -d '{\"prompt\": \"...\"}'", param=None,
                     code="invalid_json")
    param = field_path(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
        return error(400, f"Unrecognized request argument supplied: {param}", param=param)
    # A field of several types (prompt: text or token ids) fails once per type: say each.
    tried = [f"{e['loc'][len(e['loc']) - len(_tail(e['loc']))]}: {e['msg']}" for e in errors
             if field_path(e.get("loc", ())) == param and _tail(e["loc"])]
    detail = f"none of its types fits ({'; '.join(dict.fromkeys(tried))})" if len(tried) > 1 else \
        first.get("msg", "invalid value")
    return error(400, f"{param or 'body'}: {detail}", param=param)
