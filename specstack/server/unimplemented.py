"""The fields of OpenAI's and llama-server's request schemas that this server does not do, each accepted only
at a value that changes nothing (``Unimplemented``), and llama-server's sampler chain read against the one
applied here.  Data and small tests only: ``schema`` builds the request models from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr

Neutral = tuple[Any, ...] | Callable[[Any, Any], bool]

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

    def accepts(self, value: Any, body: Any) -> bool:
        if callable(self.neutral):
            return self.neutral(value, body)
        return any(_same(value, v) for v in self.neutral)


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps numbers and booleans apart (``False == 0`` in Python)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


# llama.cpp's sampler names (``common_sampler_types_from_names``, alternative names, and the one-letter
# codes of a ``samplers`` string, last), by canonical name.
SAMPLER_NAMES = {
    "dry": ("dry", "d"), "top_k": ("top_k", "top-k", "k"), "typ_p": ("typ_p", "typical_p", "typical-p", "typical",
    "typ-p", "typ", "y"), "top_p": ("top_p", "top-p", "nucleus", "p"), "min_p": ("min_p", "min-p", "m"),
    "xtc": ("xtc", "x"), "temperature": ("temperature", "temp", "t"), "top_n_sigma": ("top_n_sigma", "top-n-sigma", "s"),
    "penalties": ("penalties", "e"), "infill": ("infill", "i"), "adaptive_p": ("adaptive_p", "adaptive-p", "a"),
}
_SAMPLER_BY_NAME = {alias: name for name, aliases in SAMPLER_NAMES.items()
                    for alias in (*aliases, name.replace("_", ""))}  # llama.cpp's no-dash spellings too: topk, minp
# Samplers this server applies, in its order (``constraints``, then ``sampling``), and each one's test for being
# off in a request (penalties: every penalty field left out or at its neutral value).
SAMPLER_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")
SAMPLER_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
PENALTIES_OFF = {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
# Samplers that do nothing at the neutral values this server requires of their settings (``UNIMPLEMENTED``;
# adaptive_p's target is always off: no request field sets it, and serve's --adaptive-target is taken negative only).
SAMPLER_IDLE = ("dry", "typ_p", "xtc", "top_n_sigma", "adaptive_p")
CHAIN_WHY = (f"the chain applied here is {', '.join(SAMPLER_ORDER)} in that order (a sampler left out is off); a chain "
             "in another order, or with a sampler not implemented here, cannot be honoured")


def _chain(value: str | list[str]) -> list[str | None]:
    """A ``samplers`` value (names, or llama.cpp's one-letter string) as canonical names (None: unknown)."""
    names = list(value) if isinstance(value, str) else value
    return [_SAMPLER_BY_NAME.get(n) for n in names]


def samplers_as_applied(value: str | list[str], body: Any) -> bool:
    """A llama-server ``samplers`` chain is honoured when its active samplers come in this server's order, each at
    most once (idle ones may stand anywhere): a sampler it leaves out is off, as in llama-server
    (``samplers_left_out``; ``jobs`` applies that)."""
    chain = _chain(value)
    if None in chain or "infill" in chain:
        return False
    active = [n for n in chain if n not in SAMPLER_IDLE]
    return len(set(active)) == len(active) and active == [n for n in SAMPLER_ORDER if n in active]


def applied_chain(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A chain (names, or llama.cpp's one-letter string) as canonical names, where this server can honour it
    (``samplers_as_applied``): a role's default chain (serve --samplers/--sampler-seq, the roles file's samplers).
    ValueError says which sampler is unknown, or why the chain cannot be honoured."""
    chain = _chain(value)
    names = list(value)
    unknown = [n for n, c in zip(names, chain) if c is None]
    if unknown:
        raise ValueError(f"unknown sampler {unknown[0]!r}: llama.cpp's are {', '.join(SAMPLER_NAMES)} (or their "
                         f"letters {''.join(a[-1] for a in SAMPLER_NAMES.values())})")
    if not samplers_as_applied(value, None):
        raise ValueError(CHAIN_WHY)
    return tuple(c for c in chain if c is not None)


def samplers_left_out(value: str | list[str] | None) -> tuple[str, ...]:
    """The samplers this server applies that a ``samplers`` chain leaves out, so off (none when no chain is sent):
    llama.cpp builds its chain from that list alone, so a left-out penalty or top_k does nothing there either,
    and without ``temperature`` it samples at 1."""
    if value is None:
        return ()
    chain = set(_chain(value))
    return tuple(n for n in SAMPLER_ORDER if n not in chain)


def _best_of_is_n(value: int, body: Any) -> bool:
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
    Unimplemented("typ_p", F, (1,), SAMPLER),  # llama.cpp's sampler name for typical_p
    Unimplemented("xtc_probability", F, (0,), SAMPLER),
    Unimplemented("xtc_threshold", F, (0.1,), SAMPLER),
    Unimplemented("mirostat", I, (0,), SAMPLER),
    Unimplemented("mirostat_tau", F, (5,), SAMPLER),
    Unimplemented("mirostat_eta", F, (0.1,), SAMPLER),
    Unimplemented("top_n_sigma", F, (-1,), SAMPLER),
    Unimplemented("min_keep", I, (0,), SAMPLER),
    Unimplemented("samplers", S | list[S], samplers_as_applied, CHAIN_WHY),
    Unimplemented("n_probs", I, (0,), LOGPROBS),
    Unimplemented("t_max_predict_ms", I, (0,), "per-request time limits are not implemented (the server has --timeout)"),
    Unimplemented("n_cache_reuse", I, (0,), "KV shifting is not implemented"),
    Unimplemented("n_keep", I, (0, -1), "the context is never shifted"),
    Unimplemented("n_indent", I, (0,), "indentation limits are not implemented"),
    Unimplemented("return_tokens", B, (False,), "token ids are not returned (streamed chunks carry specstack.tokens)"),
    Unimplemented("sse_ping_interval", F, (), "streams are pinged every 15 s"),
    Unimplemented("response_fields", list[S], ([],), "only llama-server's /completion and /infill cut their results "
                  "to response_fields (llama-server's OpenAI routes leave it unapplied)"),
    Unimplemented("lora", list[Any], ([],), "LoRA adapters are not supported"),
    Unimplemented("image_data", list[Any], ([],), TEXT_ONLY),
    Unimplemented("multimodal_data", list[Any], ([],), TEXT_ONLY),
    # llama-server's chat fields
    Unimplemented("chat_template", S, (), TEMPLATE, ("chat",)),
    Unimplemented("reasoning_control", B, (False,), "there is no reasoning control", ("chat",)),
)
