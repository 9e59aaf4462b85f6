"""A request's parts read and checked: its prompts, tools, template, grammar, reasoning split and each choice's
``GenerationConfig``.

Module functions with explicit inputs (the role's backend, the body, the limits), so each can be imported and
tested alone; the plan builder (``plan``) is their one caller on the request path, and every route builds its
plan there, so every check, limit, constraint and speculation setting holds on all of them.  Each refusal is an
``ApiError`` that names its field.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import Request

from ..drafters.base import Asked, check_name, check_target
from ..drafters.options import check_drafter_options, inapplicable
from ..errors import SpecstackError
from ..generation import GenerationConfig
from ..loading import SpeculationSpec
from ..sampling import SamplingParams
from .backends import Limits, RoleBackend
from .chat import RenderedChat, render
from .continuation import continuation, render_continued
from .request_constraints import ConstraintError, request_constraints, stop_strings
from .inputs import chat_messages, completion_prompts
from .responses import ApiError
from .roles import SERVE_ALTERNATIVES, Role
from .schema import requested_choices, requested_tokens, wanted_logprobs
from .structured import StructuredError, request_grammar
from .tools import (Reasoning, ToolPlan, ToolRequestError, forced_opening, plan as tool_plan, preserved_tokens,
                    template_tags)
from .unimplemented import PENALTIES_OFF, SAMPLER_OFF, samplers_left_out


# A request's sampling where it, its role and its route set none: OpenAI's (no filter, temperature 1) and
# llama-server's (common.h's defaults, on its own /completion)
# llama-server's sampling defaults (common_params_sampling), on every route: /completion, /v1/* and /props alike
LLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def prompt_ids(prompt: Any, target: Any) -> list[list[int]]:
    """A completions ``prompt`` as one token list per prompt (``inputs.completion_prompts``)."""
    try:
        return completion_prompts(prompt, target)
    except SpecstackError as exc:
        raise ApiError(400, str(exc), param="prompt") from None


def tools_for(body: Any, w: RoleBackend) -> ToolPlan | None:
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


def input_tokens(body: Any, w: RoleBackend) -> dict[str, Any]:
    """How many tokens a chat request's prompt is, rendered as its generating route renders it (template, tools,
    continuation), nothing generated: llama-server's ``input_tokens`` answer, for a client that fits a chat to the
    context (OpenAI's chat, the Responses API and Anthropic's ``count_tokens`` each translate to a chat first)."""
    from .chat import chat_tokens

    return {"input_tokens": len(chat_tokens(chat_prompt(body, w, tools_for(body, w)), w.target))}


def chat_prompt(body: Any, w: RoleBackend, tools: ToolPlan | None = None) -> RenderedChat:
    """A chat request's prompt through the role's template (chat, and llama-server's /apply-template);
    ``developer`` messages are system messages, as llama-server and vLLM read them.  The request's tools
    (``tools_for``) go to the template, with their format's instruction and example where it has them; its
    ``add_generation_prompt`` and ``continue_final_message`` (or a last assistant message) say whether the
    assistant's turn is opened or the last message continued (``continuation``)."""
    tools = tools if tools is not None else tools_for(body, w)
    try:
        # the keys each message was sent with (a template may test whether one is defined), but no refusal
        messages = chat_messages([m.model_dump(exclude_unset=True, exclude={"refusal"}) for m in body.messages])
        opened, mode = continuation(messages, getattr(body, "add_generation_prompt", None),
                                    getattr(body, "continue_final_message", None))
        kwargs: dict[str, Any] = {"extra": template_kwargs(body, w.role)}
        if tools is not None:
            kwargs.update(tools=list(tools.raw), tool_example=tools.format.example(tools.parallel),
                          system_note=tools.format.system_note)
        if mode is not None:
            return render_continued(messages, w.template, mode, **kwargs)
        return render(messages, w.template, generation_prompt=opened, **kwargs)
    except SpecstackError as exc:
        raise ApiError(400, str(exc), param=_param(str(exc))) from None


def _param(message: str) -> str:
    """The field a refused chat names first (``continue_final_message: ...``), else ``messages``."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return head if head in ("add_generation_prompt", "continue_final_message") else "messages"


def template_kwargs(body: Any, role: Role | None = None) -> dict[str, Any] | None:
    """A chat request's template variables, as llama-server passes them: ``chat_template_kwargs`` (such as
    ``enable_thinking``), and OpenAI's ``reasoning_effort`` as the variable of that name, where "none" means
    ``enable_thinking: false`` instead.  A role's ``reasoning`` on or off (serve --reasoning) is the default
    ``enable_thinking``, as llama-server's."""
    kwargs = {}
    thinking = getattr(role, "reasoning", None)
    if thinking in ("on", "off"):
        kwargs["enable_thinking"] = thinking == "on"
    kwargs.update(getattr(body, "chat_template_kwargs", None) or {})
    effort = getattr(body, "reasoning_effort", None)
    if effort == "none":
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif effort:
        kwargs["reasoning_effort"] = effort
    return kwargs or None


def verbose(body: Any, state: Any) -> bool:
    """Whether an OpenAI answer carries llama-server's ``__verbose`` (the native result, with the prompt as the
    model read it): the request's ``verbose``, else the server's (``serve --verbose``), as llama-server."""
    wanted = getattr(body, "verbose", None)
    return bool(getattr(state, "verbose", False) if wanted is None else wanted)


def grammar_for(body: Any, tools: ToolPlan | None = None) -> str | None:
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


async def prepare_grammar(w: RoleBackend, grammar: str, field: str,
                          triggers: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """Build the request's grammar on the grammar thread while the request waits, so that the role's engine
    thread, which decodes every other request, only copies it (the target's ``grammar_engine``; a remote role's
    replica builds it where it runs); the grammar and triggers the request runs with.  A lazy grammar (``triggers``)
    whose engine cannot wait for a trigger (``GrammarTraits.lazy``) would force the call from the first token, so
    the output stays free and parsed instead, as before lazy grammars."""
    engine = w.target.grammar_engine()
    if engine is None:
        return grammar, triggers
    try:
        state = await asyncio.wrap_future(engine.prepare(grammar))
    except SpecstackError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from None
    return (grammar, triggers) if not triggers or state.traits.lazy else ("", ())


def session_key(request: Request, body: Any) -> str | None:
    """The request's session, which a scale-out backend routes by: the ``x-session-id`` header, else the body's
    prompt_cache_key, user or safety_identifier."""
    return request.headers.get("x-session-id") or body.prompt_cache_key or body.user or body.safety_identifier


def job_configs(w: RoleBackend, body: Any, prompts: list[list[int]], limits: Limits, prompt_field: str = "prompt",
                grammar: str | None = None, triggers: tuple[str, ...] = ()) -> tuple[list[GenerationConfig],
                                                                               SpeculationSpec]:
    """Each choice's ``GenerationConfig`` (``n`` of them, the same for every prompt) and the request's speculative
    settings, checked once: choice i samples with ``seed + i`` (a negative or absent seed: each its own random
    one).  ``prompt_field`` is what the prompts came from (chat: ``messages``), which their errors name;
    ``grammar`` is the GBNF the request's own fields ask for (None: the role's default grammar, if any;
    ``request_constraints``), lazy after ``triggers`` (a tool call's opening words under ``tool_choice: auto``)
    where there are any."""
    n = _choices(body, prompts, limits, prompt_field)
    _check_prompts(prompts, w.target, limits, prompt_field)
    max_tokens = _max_tokens(body, limits, w.target.capacity)
    spec = _speculative(body, w.role)
    config = _generation_config(body, w, grammar, max_tokens, triggers)
    sampling, seed = config.sampling, config.sampling.seed
    seeded = seed is not None and seed >= 0
    return [config if i == 0 else dataclasses.replace(
                config, sampling=dataclasses.replace(sampling, seed=seed + i if seeded else seed))
            for i in range(n)], spec


def _choices(body: Any, prompts: list[list[int]], limits: Limits, prompt_field: str) -> int:
    """Choices per prompt (``n`` or ``n_cmpl``), all prompts' together within ``limits.max_n``."""
    n = requested_choices(body)
    if n * len(prompts) > limits.max_n:
        field = "n_cmpl" if body.n_cmpl is not None else "n"
        if len(prompts) > 1:
            raise ApiError(400, f"{len(prompts)} prompts x {field} {n} are {n * len(prompts)} choices; this server "
                                f"allows at most {limits.max_n} per request", param=prompt_field)
        raise ApiError(400, f"{field} is {n}; this server allows at most {limits.max_n} choices per request",
                       param=field)
    return n


def _check_prompts(prompts: list[list[int]], target: Any, limits: Limits, prompt_field: str) -> None:
    """Each prompt not empty, within the context (and ``limits.max_prompt_tokens``), its ids in the vocabulary."""
    limit = min(limits.max_prompt_tokens or target.capacity - 1, target.capacity - 1)
    for p, ids in enumerate(prompts):
        where = f"{prompt_field}[{p}]" if len(prompts) > 1 else prompt_field
        if not ids:
            raise ApiError(400, f"the prompt is empty ({where})", param=prompt_field)
        if len(ids) > limit:  # past the context: llama-server's type and counts (a slot's n_ctx), OpenAI's code
            context = len(ids) > target.capacity - 1
            raise ApiError(400, f"the prompt ({where}) has {len(ids)} tokens; this model's context allows "
                                f"{limit} (prompt plus at least one new token)",
                           "exceed_context_size_error" if context else "invalid_request_error",
                           param=prompt_field, code="context_length_exceeded",
                           fields={"n_prompt_tokens": len(ids), "n_ctx": target.n_ctx} if context else None)
        if any(not 0 <= t < target.n_vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in 0..{target.n_vocab - 1} ({where})", param=prompt_field)


def _max_tokens(body: Any, limits: Limits, capacity: int) -> int:
    """The tokens a request may generate; -1 (llama-server's "until the end", and the default) is the most this
    server allows: --max-tokens where given, else the slot's ``capacity`` (the context's end stops a generation
    before that, finish ``length``, as in llama-server)."""
    max_tokens, tokens_field = requested_tokens(body, limits.default_max_tokens)
    if max_tokens == -1:
        return limits.max_tokens or capacity
    if limits.max_tokens and max_tokens > limits.max_tokens:
        raise ApiError(400, f"{tokens_field} is {max_tokens}; this server allows at most {limits.max_tokens}",
                       param=tokens_field)
    return max_tokens


def _speculative(body: Any, role: Role) -> SpeculationSpec:
    """How the request speculates: its ``speculative`` settings, checked against the drafters' configs and the role
    (refused here, before the job is queued, rather than by the engine thread), over the role's own."""
    spec = _dotted(body, body.speculative.model_dump(exclude_none=True) if body.speculative else {})
    if not spec:  # the role's own settings, checked when its roles file was read
        return role.speculative()
    if "drafter" in spec:
        check_drafter(spec["drafter"], role)
    try:
        check_drafter_options(spec)
    except SpecstackError as exc:
        raise ApiError(400, str(exc), param="speculative") from None
    drafter = spec.get("drafter", role.drafter)
    unused = inapplicable(drafter, set(spec))
    if unused is not None:
        raise ApiError(400, f"speculative.{unused.dest} applies to drafter {' or '.join(sorted(unused.configs))}, "
                       f"not {drafter!r}; leave it out or choose one of those", param=f"speculative.{unused.dest}")
    if spec.get("tree") and not role.spec().verifies_trees:  # it would silently be verified as a chain
        raise ApiError(400, f"speculative.tree: role {role.name!r} cannot verify token trees (a role verifies them "
                       "with tree = true and parallel = 1 in its roles file); leave tree out",
                       param="speculative.tree")
    return role.speculative(spec.get("drafter")).with_request(spec)


def _dotted(body: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """llama-server's dotted keys in the ``speculative`` settings: ``speculative.n_max`` drafts at most n tokens a
    step (k and k_max), ``speculative.p_min`` is the draft's p_min; a value the object also sets must agree."""
    dotted = {"speculative.n_max": (body.spec_n_max, ("k", "k_max")), "speculative.p_min": (body.spec_p_min, ("p_min",))}
    for name, (value, keys) in dotted.items():
        if value is None:
            continue
        for key in keys:
            if spec.get(key, value) != value:
                raise ApiError(400, f"{name} ({value}) and speculative.{key} ({spec[key]}) disagree; send one of them",
                               param=name)
            spec[key] = value
    return spec


def sampling_for(body: Any, role: Role) -> dict[str, Any]:
    """temperature, top_k, top_p and min_p: the request's, else the role's (serve --temp, ...), else llama-server's
    (0.8, 40, 0.95, 0.05: what llama-server samples a /v1 request with, and what /props says); a sampler that the
    request's ``samplers`` chain (else its role's) leaves out is off, as llama-server builds its chain from that
    list alone."""
    values = {**LLAMA_SAMPLING, **role.sampling()}
    values.update({k: getattr(body, k) for k in LLAMA_SAMPLING if getattr(body, k) is not None})
    values.update({k: SAMPLER_OFF[k] for k in samplers_left_out(sampler_chain(body, role)) if k in SAMPLER_OFF})
    return values


def sampler_chain(body: Any, role: Role) -> Any:
    """The ``samplers`` chain a request runs: its own, else its role's (serve --samplers/--sampler-seq, the roles
    file's samplers), as llama-server starts every request from its server-wide chain; None: every sampler."""
    own = getattr(body, "samplers", None)
    return own if own is not None else getattr(role, "samplers", None)


def _generation_config(body: Any, w: RoleBackend, grammar: str | None, max_tokens: int,
                       triggers: tuple[str, ...] = ()) -> GenerationConfig:
    """The first choice's ``GenerationConfig``: the logit controls over the role's defaults, stops and sampling."""
    defaults = w.role.controls()
    if "penalties" in samplers_left_out(sampler_chain(body, w.role)):  # off, the role's default penalties too
        body = body.model_copy(update=dict.fromkeys((*PENALTIES_OFF, "repetition_penalty")))
        defaults = dataclasses.replace(defaults, **PENALTIES_OFF)
    try:
        constraints, stop_ids = request_constraints(body, defaults, grammar, vocab=w.target,
                                                    max_tokens=max_tokens)
        if triggers and constraints.grammar:
            constraints = dataclasses.replace(constraints, grammar_triggers=triggers)
        stops = stop_strings(body)
    except ConstraintError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    seed = body.seed if body.seed is not None else w.role.seed
    try:
        sampling = SamplingParams(**sampling_for(body, w.role), seed=seed)
        return GenerationConfig(max_tokens=max_tokens, stop=stops, sampling=sampling,
                                reuse_prompt=getattr(body, "cache_prompt", None) is not False,
                                slot=_slot(body, w.role),
                                logprobs=wanted_logprobs(body), constraints=constraints, stop_token_ids=stop_ids,
                                post_sampling_probs=bool(getattr(body, "post_sampling_probs", None)))
    except SpecstackError as exc:
        raise ApiError(400, str(exc)) from None


def _slot(body: Any, role: Role) -> int | None:
    """llama-server's ``id_slot``: the slot every choice of the request runs in, each as it frees (-1 or none: the
    next free one); one the role does not have is a 400."""
    slot = getattr(body, "id_slot", None)
    if slot is None or slot == -1:
        return None
    if not 0 <= slot < role.parallel:
        raise ApiError(400, f"id_slot {slot} is not a slot of role {role.name!r}: it has slots 0..{role.parallel - 1} "
                            "(or send -1: the next free one)", param="id_slot")
    return slot


def check_drafter(name: str, role: Role) -> None:
    """A request's drafter: a known name, and what it needs of the role's model there (``Needs.check``: mtp a NextN
    head, moe-self experts; refused here, from the GGUF's metadata, rather than by the engine thread once the job is
    queued)."""
    try:
        check_name(name, "speculative.drafter")
        given = {"draft_model": role.draft} if role.draft is not None else {}  # the file the worker hands it
        check_target(name, role.model, Asked(f"speculative.drafter {name!r} on role {role.name!r}", given,
                                             alternatives=f"{SERVE_ALTERNATIVES}; mtp needs a model with NextN layers: "
                                             "ask for a role whose model has them"))
    except SpecstackError as exc:
        raise ApiError(400, str(exc), param="speculative.drafter") from None


def reasoning_for(body: Any, w: RoleBackend, prompt: RenderedChat) -> Reasoning | None:
    """How a chat request's output is split into thinking and content (``tools.reasoning``): its
    ``reasoning_format``, else the role's (serve --reasoning-format), else llama-server's default ``auto``; None
    where nothing is split off: a template that shows no reasoning tags, or ``none`` on a prompt that does not
    open the think block."""
    template = w.template
    tags = template_tags(template.text if template is not None and template.kind == "jinja" else None)
    if tags is None:
        return None
    fmt = getattr(body, "reasoning_format", None) or getattr(w.role, "reasoning_format", None) or "auto"
    opening = forced_opening(prompt.text, tags[0])
    if fmt == "none" and not opening:
        return None
    return Reasoning(tags[0], tags[1], fmt, opening, stream=bool(getattr(body, "stream", False)))


def markers_for(w: RoleBackend, tools: ToolPlan | None, preserved: dict[tuple[str, ...], dict[int, str]],
                reasoning: Reasoning | None = None, always: bool = False) -> dict[int, str] | None:
    """The control-token markers a chat choice's output keeps when it is read as a message (``ChoiceOutput``), as
    it is when the request has tools or its model thinks; None: plain text, unless ``always``.  ``preserved``
    caches each (role, format, tags)'s markers."""
    if tools is None and reasoning is None and not always:
        return None
    tags = (reasoning.start, reasoning.end) if reasoning is not None else ()
    key = (w.role.name, tools.format.name if tools is not None else "", *tags)
    if key not in preserved:
        preserved[key] = preserved_tokens(w.target, (*(tools.format.markers if tools is not None else ()), *tags))
    return preserved[key]
