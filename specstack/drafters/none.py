"""The ``none`` drafter: never proposes, so the loop does plain decoding.

Running the baseline through the same loop as speculation means the same
evaluation path, sampling and statistics: an honest comparison.  It is plain
under a grammar too: the engine drafts a grammar's forced tokens
(``drafters.grammar``) for every drafter but this one, which declares ``drafts = False``
(``base.PlainDrafter``).
"""

from __future__ import annotations

from typing import Sequence

from ..types import Draft
from .base import BuildContext, DraftRequest, LlamaCpp, register


NAME = "none"


class NoDrafter:
    name = NAME
    drafts = False  # plain decoding: no grammar drafts either

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft.empty(self.name) for _ in requests]

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        pass

    def end(self, seq: int = 0, complete: bool = True) -> None:
        pass


@register(NAME, llama=LlamaCpp(peers=("llama-plain",)))  # llama.cpp's plain decoding beside ours
def _build(ctx: BuildContext) -> NoDrafter:
    return NoDrafter()
