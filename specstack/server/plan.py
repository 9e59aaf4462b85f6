"""One request, one plan: a generating request read, checked and resolved once, in one call per kind of route,
into the ``RequestPlan`` its session runs (``session.start``).

Every generating route (OpenAI's chat and completions, llama-server's /completion and /infill, the Responses API,
Anthropic's messages, and Vertex AI's, which calls those) builds its plan here, so the request's pieces (role,
prompt ids, tools, reasoning split, grammar and its triggers, each choice's config, what its outputs are read as)
travel together as one typed value instead of loose arguments, and ``jobs`` (the checks) is entered from here
alone.  A refusal is an ``ApiError`` raised while building, in the order the fields were always checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fastapi import Request

from ..generation import GenerationConfig
from ..loading import SpeculationSpec
from .backends import Limits, RoleBackend, Served, served
from .chat import chat_tokens
from .jobs import (chat_prompt, grammar_for, input_tokens, job_configs, markers_for, prepare_grammar, prompt_ids,
                   reasoning_for, session_key, tools_for, verbose)
from .native import native_body
from .schema import unsupported
from .structured import grammar_field
from .tools import Reasoning, ToolPlan

# A route's own prompts from its checked body (llama-server's /infill): one token list per prompt
Prompts = Callable[[RoleBackend, Any, Limits], list[list[int]]]
# A route's own check once its role is known (Anthropic's thinking budget)
Check = Callable[[RoleBackend, Limits], None]


@dataclass(frozen=True)
class RequestPlan:
    """What a session runs: the role, the checked body, the prompts and each choice's config, and how the
    answer is read and shaped.

    ``configs``: one per choice of a prompt (every prompt has the same choices); ``markers``: the control-token
    markers kept where each choice's output is read as a message (tools, a thinking model, or a route that
    always answers with a message), None where the output is plain text."""

    backend: RoleBackend
    body: Any
    limits: Limits
    prompts: list[list[int]]
    configs: list[GenerationConfig]
    speculative: SpeculationSpec
    chat: bool
    session: str | None = None  # the request's session, which a scale-out backend routes by (``jobs.session_key``)
    tools: ToolPlan | None = None
    reasoning: Reasoning | None = None
    markers: dict[int, str] | None = None
    stream: bool = False
    # prompt progress, for a stream that asks (llama-server's ``return_progress``): chunks of their own before the
    # first token; a whole answer has nowhere to put them
    progress: bool = False
    per_prompt: int = 1  # choices per prompt: ``len(configs)``
    verbose: bool = False  # an OpenAI answer carries llama-server's ``__verbose``
    fields: list[str] | None = None  # llama-server's ``response_fields``: each final result cut to these


async def chat(request: Request, body: Any, always_message: bool = False, check: Check | None = None) -> RequestPlan:
    """A chat request's plan: its template, tools, reasoning split and grammar.  ``always_message``: each choice
    is read as a message even without tools or thinking (the Responses and Anthropic APIs answer with one);
    ``check``: the route's own check once the role is known."""
    unsupported(body)
    state = served(request)
    w = state.backend(body.model)
    if check is not None:
        check(w, state.limits)
    tools = tools_for(body, w)
    prompt = chat_prompt(body, w, tools)
    ids = [chat_tokens(prompt, w.target)]
    grammar = grammar_for(body, tools)
    reasoning = reasoning_for(body, w, prompt)
    return await _plan(request, state, w, body, ids, True, grammar, tools.triggers if tools is not None else (),
                       tools=tools, reasoning=reasoning,
                       markers=markers_for(w, tools, state.preserved, reasoning, always_message))


async def completion(request: Request, body: Any) -> RequestPlan:
    """OpenAI's /v1/completions plan: its prompts as given (text or ids, one or several)."""
    unsupported(body)
    state = served(request)
    w = state.backend(body.model)
    return await _plan(request, state, w, body, prompt_ids(body.prompt, w.target), False, grammar_for(body))


async def native(request: Request, body: Any, prompts: Prompts | None = None) -> RequestPlan:
    """llama-server's /completion plan (``prompts``: a route's own, /infill's fill-in-the-middle prompt): its
    body read as /v1/completions reads its own (``native.native_body``), its ``response_fields`` kept."""
    state = served(request)
    w = state.backend(body.model)
    fields = body.response_fields or []
    body = native_body(body)
    unsupported(body)
    ids = prompts(w, body, state.limits) if prompts is not None else prompt_ids(body.prompt, w.target)
    return await _plan(request, state, w, body, ids, False, grammar_for(body), fields=fields)


def chat_text(request: Request, body: Any) -> str:
    """The prompt a chat request would get, as text (llama-server's /apply-template), nothing run."""
    unsupported(body)
    return chat_prompt(body, served(request).backend(body.model)).text


def chat_input_tokens(request: Request, body: Any) -> dict[str, Any]:
    """A chat request's prompt token count (``jobs.input_tokens``), nothing run."""
    unsupported(body)
    return input_tokens(body, served(request).backend(body.model))


async def _plan(request: Request, state: Served, w: RoleBackend, body: Any, prompts: list[list[int]], chat: bool,
                grammar: str | None, triggers: tuple[str, ...] = (), **parts: Any) -> RequestPlan:
    """The common tail: the grammar built off the engine thread while the request waits (``jobs.prepare_grammar``),
    then each choice's config; ``triggers``: the grammar is lazy, free text until one of them (a tool call under
    ``tool_choice: auto``)."""
    if grammar:
        grammar, triggers = await prepare_grammar(w, grammar, grammar_field(body), triggers)
    configs, spec = job_configs(w, body, prompts, state.limits, "messages" if chat else "prompt", grammar, triggers)
    stream = bool(body.stream)
    return RequestPlan(w, body, state.limits, prompts, configs, spec, chat, session_key(request, body),
                       stream=stream, progress=stream and bool(getattr(body, "return_progress", None)),
                       per_prompt=len(configs), verbose=verbose(body, state), **parts)
