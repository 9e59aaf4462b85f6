"""llama-server's ``/infill``: fill in the middle between a prefix and a suffix, with extra files as context.

The prompt is llama-server's (``format_prompt_infill`` in ``tools/server/server-common.cpp``), the repo-level
FIM pattern of Qwen2.5-Coder's paper (arXiv 2409.12186), so a model trained for it (and the editor plugins
llama.vscode and llama.vim, which send these fields) gets the tokens it expects::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra 0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix [FIM_SUF]suffix [FIM_MID]prompt

with the prefix and suffix cut to fit a batch (3:1), the extra chunks to fill the context left after the batch
and twice ``n_predict``, and BOS (where the model asks for one) after the chunks, as llama-server places it.  Without a ``[FIM_SEP]`` token each chunk
follows a ``--- snippet ---`` line instead.  The result is a token prompt that ``/completion``'s path then runs,
under speculation like any other.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from .responses import ApiError
from .schema import CompletionRequest

CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # llama-server's k_chunk_prefix_str, where the model has no [FIM_SEP]
NEEDED = (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))


class ExtraChunk(BaseModel):
    """One file of ``input_extra``: its text and, optionally, its name.  Other keys are ignored, as llama-server
    ignores them (llama.vscode sends the time it read the chunk)."""

    model_config = ConfigDict(extra="ignore")
    text: StrictStr
    filename: StrictStr = "tmp"


class InfillRequest(CompletionRequest):
    """``/completion``'s body with llama-server's infill fields; ``prompt`` is the text after the prefix that the
    middle starts with (optional)."""

    prompt: StrictStr = ""
    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[ExtraChunk] = Field(default_factory=list)


def check_fim(target: Any) -> dict[str, int | None]:
    """The model's FIM tokens; 501 naming the missing ones, as llama-server answers a model without them."""
    ids = target.fim_ids()
    missing = [f"{word} token is missing." for name, word in NEEDED if ids[name] is None]
    if missing:
        raise ApiError(501, f"Infill is not supported by this model: {' '.join(missing)} /infill needs a model "
                            "trained for fill-in-the-middle whose GGUF names its FIM tokens (tokenizer.ggml."
                            "fim_pre_token_id ...), such as Qwen2.5-Coder or CodeLlama", "not_supported_error",
                       code="not_supported")
    return ids


def infill_prompt(target: Any, body: InfillRequest, n_batch: int, n_predict: int, n_ctx: int) -> list[int]:
    """The token prompt of an infill request (llama-server's ``format_prompt_infill``, without ``--spm-infill``)."""
    fim = check_fim(target)

    def tok(text: str) -> list[int]:
        return target.tokenize(text, add_special=False, parse_special=False)

    extra = _extra_tokens(target, fim, body.input_extra, tok)
    prompt = tok(body.prompt)
    prefix, suffix = tok(body.input_prefix), tok(body.input_suffix)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim["pre"]] + prefix[len(prefix) - n_prefix:] + prompt
    bos = target.bos_id if target.add_bos and target.bos_id >= 0 else None
    # llama-server puts the extra chunks before BOS (it inserts BOS, then the chunks, at the front): kept, so that
    # both servers give a model the same prompt
    return extra[len(extra) - n_extra:] + ([bos] if bos is not None else []) + head + [fim["suf"]] + \
        suffix[:n_suffix] + [fim["mid"]]


def _extra_tokens(target: Any, fim: dict[str, int | None], chunks: list[ExtraChunk], tok: Any) -> list[int]:
    """The repository part: ``[FIM_REP]myproject``, each chunk after its file's ``[FIM_SEP]`` name (or a snippet
    line), and the current file's ``[FIM_SEP]filename``."""
    out: list[int] = []
    if fim["rep"] is not None:
        out += [fim["rep"]] + tok("myproject\n")
    for chunk in chunks:
        out += [fim["sep"]] + tok(chunk.filename + "\n") if fim["sep"] is not None else tok(CHUNK_SEPARATOR)
        out += tok(chunk.text)
    if fim["sep"] is not None:
        out += [fim["sep"]] + tok("filename\n")
    return out
