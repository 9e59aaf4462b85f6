"""MoE self-draft: the target's own GGUF, loaded again with fewer active experts, drafts for it.

Running an MoE model with fewer experts (llama.cpp's
``--override-kv <arch>.expert_used_count=int:N``) is the research notes'
biggest production speed-up, but it is lossy: on ``pycoder-moe`` with 1 of 2
experts the argmax agrees with the full model on 78% of positions, and 0 of 6
greedy outputs stay identical.  As a *draft* the same reduced model is
lossless (the full model verifies every token) and is accepted about as
often, with no extra weights: llama.cpp memory-maps the file, so both
contexts share the weight pages and the draft adds about one KV cache.

It is a draft model in every other way (``draft_model.DraftModelDrafter``):
batched drafting across generations, lazy catch-up, the cost policy's
token-by-token rule, cascades and fusion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidParameterError
from ..llama import LlamaModel, ModelConfig
from .base import Asked, BuildContext, Needs, config_from_options, register
from .draft_model import _warm_up, DraftModelConfig, DraftModelDrafter

NAME = "moe-self"  # its registry name, for those that name it (default method lists, messages)

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo


@dataclass(frozen=True)
class MoeSelfConfig:
    """draft_experts: active experts per token in the draft (default 1)."""

    draft_experts: int = 1

    def __post_init__(self) -> None:
        if self.draft_experts < 1:
            raise InvalidParameterError(f"draft_experts must be >= 1 (got {self.draft_experts})")


def _check_target(meta: "GGUFInfo", asked: Asked) -> None:
    """``Needs.check``: a mixture-of-experts target with at least the draft's experts (``draft_experts``)."""
    meta.expert_override(config_from_options(MoeSelfConfig, asked.options).draft_experts, asked.where)


@register(NAME, needs=Needs(check=_check_target))
def _build(ctx: BuildContext) -> DraftModelDrafter:
    config = config_from_options(MoeSelfConfig, ctx.options)
    model = LlamaModel(
        ModelConfig(path=ctx.target.path, n_ctx=ctx.target.n_ctx, n_threads=ctx.target.n_threads, min_batch=1,
                    exact=False, n_slots=ctx.target.n_slots, unified=True, experts=config.draft_experts),
        role="moe-self draft",
    )
    _warm_up(model)
    drafter = DraftModelDrafter(model, ctx.temperature, config_from_options(DraftModelConfig, ctx.options),
                                target_vocab=ctx.target.n_vocab)
    drafter.name = NAME
    return drafter
