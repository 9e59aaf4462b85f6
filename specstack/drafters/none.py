"""The ``none`` drafter: never proposes, so the loop does plain decoding.

Running the baseline through the same loop as speculation means the same
evaluation path, sampling and statistics: an honest comparison.
"""

from __future__ import annotations

from typing import Sequence

from ..types import Draft
from .base import BuildContext, register


class NoDrafter:
    name = "none"

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        return Draft.empty(self.name)

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        pass

    def end(self) -> None:
        pass


@register("none")
def _build(ctx: BuildContext) -> NoDrafter:
    return NoDrafter()
