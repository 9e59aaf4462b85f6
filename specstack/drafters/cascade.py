"""Cascade: try draft sources in order; the first whose draft is long enough wins.

The research notes' combined stack (prompt lookup, then the suffix tree,
then the draft model), like llama.cpp's chained --spec-type list but with
per-source minimum lengths and per-source statistics: each sub-drafter
names itself in ``Draft.source``, so reports and the cost policy see which
source produced which accepted tokens.

Example: ``cascade:prompt-lookup,suffix,draft-model`` (or with ``+`` between
sources, where the name sits in a comma-separated list) with min_len 3.  If
prompt lookup finds ``[7, 8, 9, 4]`` it is used; if it finds only ``[7]``,
the suffix tree is asked, and if that is short too the draft model drafts.
Every source observes every step, so each keeps its own state in sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import InvalidParameterError
from ..types import Draft
from .base import BuildContext, Drafter, create, register


@dataclass(frozen=True)
class CascadeConfig:
    """sources: drafter names in priority order; min_len: tokens a non-last source must offer."""

    sources: tuple[str, ...]
    min_len: int = 3

    def __post_init__(self) -> None:
        if len(self.sources) < 1:
            raise InvalidParameterError("cascade needs at least one source, e.g. cascade:prompt-lookup,suffix,draft-model")
        if any(s.startswith("cascade") for s in self.sources):
            raise InvalidParameterError("a cascade cannot contain another cascade")
        if len(set(self.sources)) != len(self.sources):
            raise InvalidParameterError(f"cascade lists a source twice: {','.join(self.sources)}")
        if self.min_len < 1:
            raise InvalidParameterError(f"cascade min_len must be >= 1 (got {self.min_len})")


class CascadeDrafter:
    name = "cascade"

    def __init__(self, drafters: Sequence[Drafter], config: CascadeConfig) -> None:
        self.drafters = list(drafters)
        self.config = config
        self.name = "cascade:" + ",".join(d.name for d in self.drafters)

    def bind_policy(self, policy: object) -> None:
        for d in self.drafters:
            bind = getattr(d, "bind_policy", None)
            if bind is not None:
                bind(policy)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        for d in self.drafters:
            d.begin(prompt_ids)

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        need = min(self.config.min_len, max_tokens)
        best = Draft.empty(self.name)
        for i, d in enumerate(self.drafters):
            draft = d.propose(context_ids, max_tokens)
            if len(draft) >= need or i == len(self.drafters) - 1:
                return draft if len(draft) >= len(best) else best
            if len(draft) > len(best):
                best = draft  # kept in case nothing later reaches min_len
        return best

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        for d in self.drafters:
            d.observe(new_ids, num_accepted)

    def end(self) -> None:
        for d in self.drafters:
            d.end()


@register("cascade")
def _build(ctx: BuildContext) -> CascadeDrafter:
    spec = (ctx.options.get("spec") or "").replace("+", ",")  # '+' also separates (for comma lists)
    sources = tuple(s.strip() for s in spec.split(",") if s.strip())
    config = CascadeConfig(sources=sources, min_len=int(ctx.options.get("cascade_min_len") or 3))
    return CascadeDrafter([create(name, ctx) for name in config.sources], config)
