"""A request's logit controls: OpenAI's, llama-server's and vLLM's sampling fields as the engine's ``Constraints``.

One function, ``request_constraints``, reads every field below from a request (a pydantic request model or a
plain dict, such as llama-server's ``/completion`` body) over its role's defaults (``ConstraintDefaults``, set
by the roles file or ``serve``'s flags) and returns the ``Constraints`` plus the stop token ids the engine
applies at every draft position, exactly as plain decoding applies them:

- ``repeat_penalty`` (vLLM's ``repetition_penalty`` is the same number), ``repeat_last_n`` (-1: the whole
  context, 0: no window), ``frequency_penalty`` and ``presence_penalty``: llama.cpp's penalty sampler, over
  the last ``repeat_last_n`` tokens of prompt and output (as llama-server counts them; OpenAI counts the
  output only);
- ``logit_bias``: OpenAI's object ``{"123": 5}`` or llama-server's list ``[[123, 5], [456, false]]``
  (``false`` bans the token); a key that is not a token id is text, and each of its tokens gets the bias,
  as llama-server does; biases lie in [-100, 100]; a request's list replaces its role's (``serve -l``);
- ``min_tokens`` (vLLM): no end of generation, and no stop token, before that many output tokens;
- ``ignore_eos``: end-of-generation tokens are never chosen (the role's, ``serve --ignore-eos``, where a
  request sends none);
- ``stop`` entries that are integers, and vLLM's ``stop_token_ids``: tokens that end the generation as
  end-of-generation does;
- the grammar (GBNF) the caller worked out from ``grammar``, ``json_schema``, ``response_format`` or tools;
  without one, the role's default grammar applies, and an empty one means none.

Errors are ``ConstraintError`` with the field to name in the 400 (``param``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

from pydantic import BaseModel, Field, StrictInt, StrictStr

from ..constraints import LOGIT_BIAS_LIMIT, Constraints
from ..errors import InvalidParameterError

# The request fields read here (beside ``stop``, which every request model has), and the types they are read
# with (strict: "1.1" is not a number, nor true a count).
CONSTRAINT_FIELDS = ("repeat_penalty", "repetition_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty",
                  "logit_bias", "min_tokens", "ignore_eos", "stop_token_ids")
_TOKEN_ID = re.compile(r"-?[0-9]+")


class ConstraintError(InvalidParameterError):
    """A logit control that cannot be applied: a 400 whose ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ConstraintFields(BaseModel):
    """The request fields of the logit controls, for a route's pydantic request model to inherit."""

    repeat_penalty: Optional[float] = Field(None, strict=True)
    repetition_penalty: Optional[float] = Field(None, strict=True)  # vLLM's name for repeat_penalty
    repeat_last_n: Optional[int] = Field(None, strict=True)
    frequency_penalty: Optional[float] = Field(None, strict=True)
    presence_penalty: Optional[float] = Field(None, strict=True)
    # OpenAI: {"token id": bias}; llama-server also [[id or text, bias or false], ...].  Entries are checked
    # by ``parse_logit_bias`` (400 naming logit_bias).
    logit_bias: Optional[Union[dict[StrictStr, Any], list[Any]]] = None
    min_tokens: Optional[int] = Field(None, strict=True)
    ignore_eos: Optional[bool] = Field(None, strict=True)
    stop_token_ids: Optional[list[StrictInt]] = None


@dataclass(frozen=True)
class ConstraintDefaults:
    """A role's logit controls, used where a request gives none (the roles file's keys of the same names;
    ``serve --repeat-penalty``, ``--grammar``, ... for the one role without a roles file)."""

    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: str | None = None  # GBNF
    # llama-server's --ignore-eos and -l/--logit-bias: a request's own ignore_eos wins, and its own logit_bias
    # replaces these (as llama-server clears its defaults for a request's list)
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    def check(self) -> None:
        """Each value in the range a request's field must lie in (``ConstraintError`` naming it)."""
        request_constraints({}, self)

    def settings(self) -> dict[str, Any]:
        """As llama-server's ``/props`` names them."""
        return {"repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "grammar": self.grammar or "", "ignore_eos": self.ignore_eos}


class Tokenizer(Protocol):
    n_vocab: int

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...


def request_constraints(body: Any, defaults: ConstraintDefaults = ConstraintDefaults(), grammar: str | None = None, *,
                        vocab: Tokenizer | None = None, max_tokens: int | None = None,
                        ) -> tuple[Constraints, tuple[int, ...]]:
    """The ``Constraints`` and stop token ids of a request ``body`` (a model or a dict) over its role's
    ``defaults``.  ``grammar``: GBNF from the request's own fields (None: the role's default; ``""``: none).
    ``vocab`` checks token ids and tokenizes text keys of ``logit_bias``; ``max_tokens`` bounds ``min_tokens``."""
    repeat = _number(body, "repeat_penalty")
    vllm = _number(body, "repetition_penalty")
    if repeat is not None and vllm is not None and repeat != vllm:
        raise ConstraintError(f"repeat_penalty and repetition_penalty disagree ({repeat} and {vllm}); they are the "
                           "same setting (llama-server's and vLLM's names): send one of them", "repetition_penalty")
    repeat_field = "repetition_penalty" if vllm is not None and repeat is None else "repeat_penalty"
    repeat = repeat if repeat is not None else vllm
    values: dict[str, Any] = {
        "repeat_penalty": defaults.repeat_penalty if repeat is None else repeat,
        "repeat_last_n": _pick(_integer(body, "repeat_last_n"), defaults.repeat_last_n),
        "frequency_penalty": _pick(_number(body, "frequency_penalty"), defaults.frequency_penalty),
        "presence_penalty": _pick(_number(body, "presence_penalty"), defaults.presence_penalty),
        "min_tokens": _pick(_integer(body, "min_tokens"), 0),
        "ignore_eos": bool(_pick(_get(body, "ignore_eos"), defaults.ignore_eos)),
    }
    if not (values["repeat_penalty"] > 0 and math.isfinite(values["repeat_penalty"])):
        raise ConstraintError(f"{repeat_field} must be > 0 (got {values['repeat_penalty']}); 1 means none", repeat_field)
    if values["repeat_last_n"] < -1:
        raise ConstraintError(f"repeat_last_n must be >= -1 (got {values['repeat_last_n']}); -1 means the whole context, "
                           "0 no penalty window", "repeat_last_n")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= values[name] <= 2.0:
            raise ConstraintError(f"{name} must be in [-2, 2] (got {values[name]}), as in the OpenAI API", name)
    if values["min_tokens"] < 0:
        raise ConstraintError(f"min_tokens must be >= 0 (got {values['min_tokens']})", "min_tokens")
    if max_tokens is not None and values["min_tokens"] > max_tokens:
        raise ConstraintError(f"min_tokens ({values['min_tokens']}) is more than the tokens the request may generate "
                           f"({max_tokens})", "min_tokens")
    bias = _get(body, "logit_bias")
    values["logit_bias"] = parse_logit_bias(bias, vocab) if bias is not None else defaults.logit_bias
    chosen = defaults.grammar if grammar is None else grammar
    values["grammar"] = chosen if chosen and chosen.strip() else None
    try:
        constraints = Constraints(**values)
    except InvalidParameterError as exc:  # every field is checked above; this names the one Constraints refused
        raise ConstraintError(str(exc), next((n for n in values if n in str(exc)), "body")) from None
    return constraints, stop_token_ids(body, vocab)


def stop_strings(body: Any) -> tuple[str, ...]:
    """The text entries of ``stop`` (a string or a list of strings and token ids); empty ones are refused."""
    stop = _get(body, "stop")
    entries = [stop] if isinstance(stop, str) else list(stop or [])
    texts = tuple(s for s in entries if isinstance(s, str))
    if any(not s for s in texts):
        raise ConstraintError("stop strings must be non-empty", "stop")
    return texts


def stop_token_ids(body: Any, vocab: Tokenizer | None = None) -> tuple[int, ...]:
    """The token ids among ``stop``'s entries, then ``stop_token_ids``'s, each once, in order."""
    stop = _get(body, "stop")
    found: list[tuple[int, str]] = [(t, "stop") for t in (stop if isinstance(stop, list) else [])
                                    if isinstance(t, int) and not isinstance(t, bool)]
    found += [(t, "stop_token_ids") for t in (_get(body, "stop_token_ids") or [])]
    for token, field in found:
        if token < 0 or (vocab is not None and token >= vocab.n_vocab):
            top = f"0..{vocab.n_vocab - 1}" if vocab is not None else "0 or more"
            raise ConstraintError(f"{field}: token id {token} is outside the vocabulary ({top})", field)
    return tuple(dict.fromkeys(t for t, _ in found))


def parse_logit_bias(value: Mapping[str, Any] | Sequence[Any], vocab: Tokenizer | None = None,
                     ) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` in OpenAI's object form or llama-server's list form as (token id, bias) pairs.

    A key that is not an integer is text: each of its tokens (tokenized without BOS, as llama-server does)
    gets the bias.  ``false`` bans a token (-inf).  A token named twice keeps its last bias."""
    if isinstance(value, Mapping):
        entries = list(value.items())
    else:
        entries = []
        for i, item in enumerate(value):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ConstraintError(f"logit_bias[{i}] must be a pair [token id or text, bias] (got "
                                   f"{_short(item)})", "logit_bias")
            entries.append((item[0], item[1]))
    out: dict[int, float] = {}
    for key, bias in entries:
        amount = _bias(key, bias)
        for token in _bias_tokens(key, vocab):
            out[token] = amount
    return tuple(out.items())


def _bias(key: Any, bias: Any) -> float:
    if bias is False:
        return -math.inf
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise ConstraintError(f"logit_bias for {_short(key)} must be a number in [-100, 100], or false to ban the "
                           f"token (got {_short(bias)})", "logit_bias")
    if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
        raise ConstraintError(f"logit_bias for {_short(key)} must be in [-100, 100] (got {bias}); false bans the token",
                           "logit_bias")
    return float(bias)


def _bias_tokens(key: Any, vocab: Tokenizer | None) -> list[int]:
    if isinstance(key, str) and _TOKEN_ID.fullmatch(key.strip()):
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        if key < 0 or (vocab is not None and key >= vocab.n_vocab):
            top = f"0..{vocab.n_vocab - 1}" if vocab is not None else "0 or more"
            raise ConstraintError(f"logit_bias: token id {key} is outside the vocabulary ({top})", "logit_bias")
        return [key]
    if not isinstance(key, str) or not key:
        raise ConstraintError(f"logit_bias: {_short(key)} is neither a token id nor text", "logit_bias")
    if vocab is None:
        raise ConstraintError(f"logit_bias: {_short(key)} is not a token id", "logit_bias")
    return list(dict.fromkeys(vocab.tokenize(key, add_special=False)))


def _get(body: Any, name: str) -> Any:
    return body.get(name) if isinstance(body, Mapping) else getattr(body, name, None)


def _number(body: Any, name: str) -> float | None:
    value = _get(body, name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConstraintError(f"{name} must be a number (got {_short(value)})", name)
    return None if value is None else float(value)


def _integer(body: Any, name: str) -> int | None:
    value = _get(body, name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConstraintError(f"{name} must be an integer (got {_short(value)})", name)
    return value


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
