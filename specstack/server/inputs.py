"""Request inputs as llama-server reads them: completion prompts (text, token ids, a mix, or several) and chat roles.

A completion's text is tokenized with special tokens parsed, as llama-server does for raw prompts: the client
wrote the whole prompt, markup included (``<start_of_turn>`` is one control token).  Chat message text never
is (``chat.chat_tokens``): there the template writes the markup and a message's text stays text.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from ..errors import InvalidParameterError


class PromptVocabulary(Protocol):
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...


def completion_prompts(prompt: Any, vocab: PromptVocabulary) -> list[list[int]]:
    """Token ids of each prompt in a completions ``prompt`` (llama-server's ``tokenize_input_prompts``).

    A string is one prompt (BOS where the model asks for it, special tokens parsed); a list of integers is one
    prompt of token ids; a list of integers and strings together is one prompt, its strings tokenized in place
    (BOS only before a leading string); any other list holds several prompts, each a string, a list of ids or
    such a mix, or llama-server's JSON object (``{"prompt_string": ...}``).  Each prompt is answered with its own
    choices.
    """
    if isinstance(prompt, str):
        return [_text(prompt, vocab, True)]
    if hasattr(prompt, "prompt_string"):
        return [_object(prompt, vocab, "prompt")]
    if not isinstance(prompt, list):
        raise InvalidParameterError("prompt must be text, token ids, or a list of these")
    if any(isinstance(p, int) and not isinstance(p, bool) for p in prompt) and all(
            isinstance(p, (int, str)) and not isinstance(p, bool) for p in prompt):
        return [_mixed(prompt, vocab)]
    if not prompt:
        return [[]]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(_text(p, vocab, True))
        elif isinstance(p, list) and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in p):
            out.append(_mixed(p, vocab))
        elif hasattr(p, "prompt_string"):
            out.append(_object(p, vocab, f"prompt[{i}]"))
        else:
            raise InvalidParameterError(f"prompt[{i}] must be text, token ids, or a mix of both (got {type(p).__name__})")
    return out


def _object(prompt: Any, vocab: PromptVocabulary, where: str) -> list[int]:
    """llama-server's JSON prompt object (``schema.PromptObject``): its ``prompt_string`` as text, ids or a mix.
    Its ``multimodal_data`` is refused, as llama-server refuses it on a model without a projector."""
    if getattr(prompt, "multimodal_data", None):
        raise InvalidParameterError(f"{where}.multimodal_data: multimodal prompts are not supported (specstack serves "
                                    "text only, no projector is loaded); send prompt_string alone")
    text = prompt.prompt_string
    return _text(text, vocab, True) if isinstance(text, str) else _mixed(text, vocab)


def _mixed(parts: Sequence[int | str], vocab: PromptVocabulary) -> list[int]:
    ids: list[int] = []
    for i, part in enumerate(parts):
        ids.extend(_text(part, vocab, i == 0) if isinstance(part, str) else [part])
    return ids


def _text(text: str, vocab: PromptVocabulary, first: bool) -> list[int]:
    return vocab.tokenize(text, add_special=first, parse_special=True)


# Message roles read as another (vLLM and llama-server read OpenAI's ``developer`` as ``system``).
ROLE_ALIASES = {"developer": "system"}


def chat_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each role as the chat template knows it (``developer`` is ``system``)."""
    return [{**m, "role": ROLE_ALIASES[m["role"]]} if m.get("role") in ROLE_ALIASES else dict(m) for m in messages]
