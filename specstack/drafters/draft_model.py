"""Draft model: a second, smaller GGUF on its own llama.cpp context proposes tokens.

Its KV cache follows the committed tokens: before each proposal it drops
what diverged (rejected drafts) and evaluates only the tokens it has not
seen (usually the last one or two), never re-prefilling from scratch.
Drafting stops early when the draft's confidence falls below ``p_min``
(llama.cpp's --draft-p-min).  At temperature 0 drafts are argmax (q=None);
otherwise tokens are sampled at ``draft_temp`` and q is returned for
rejection sampling, which keeps the output distribution the target's.

Example: after drafting ``x, y`` the draft KV holds ``[a, b, c, x]`` (the
last drafted token is never evaluated).  The target accepts ``x`` and then
emits ``z``, so the context is ``[a, b, c, x, z]``: the drafter keeps its KV,
evaluates just ``[z]`` and drafts from those logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..paths import DEFAULT_DRAFT
from ..sampling import sample, softmax
from ..target import LlamaModel, ModelConfig
from ..types import Draft
from .base import BuildContext, config_from_options, register


@dataclass(frozen=True)
class DraftModelConfig:
    """draft_model: GGUF path; draft_temp: None = the target's temperature; p_min: stop below this confidence."""

    draft_model: Path = DEFAULT_DRAFT
    draft_temp: float | None = None
    p_min: float = 0.0
    draft_threads: int = 0  # 0 = same as the target
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_min < 1.0:
            raise InvalidParameterError(f"p_min must be in [0, 1) (got {self.p_min})")
        if self.draft_temp is not None and self.draft_temp < 0:
            raise InvalidParameterError(f"draft_temp must be >= 0 (got {self.draft_temp})")


class DraftModelDrafter:
    """Proposes by running a small model autoregressively, one token per forward pass."""

    name = "draft-model"

    def __init__(self, model: LlamaModel, temperature: float, config: DraftModelConfig, target_vocab: int | None = None) -> None:
        self.model = model
        # A "compatible" draft may have more ids than the target (extra control tokens):
        # it must never propose those, and q must be over the target's vocabulary.
        self.n_vocab = target_vocab or model.n_vocab
        self.config = config
        self.temperature = config.draft_temp if config.draft_temp is not None else temperature
        self._sampled = temperature > 0.0 and self.temperature > 0.0
        self._rng = np.random.default_rng(None if config.seed is None else config.seed + 1)
        self._rule = None  # policy hook: is one more draft token worth verifying?
        self._cached: list[int] = []  # tokens in the draft KV cache, in order
        self._synced = 0  # prefix of _cached known to equal the committed context

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.model.reset()
        self._cached = []
        self._synced = 0

    def bind_policy(self, policy: object) -> None:
        """Let a cost-aware policy decide token by token, from the draft's confidence."""
        make_rule = getattr(policy, "continue_rule", None)
        self._rule = make_rule(self.name) if make_rule is not None else None

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        pass  # the next propose() re-syncs against the context

    def end(self) -> None:
        pass

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft.empty(self.name)
        t0 = time.perf_counter()
        logits = self._sync(context_ids)
        tokens: list[int] = []
        confs: list[float] = []
        qs: list[np.ndarray] = []
        while True:
            tok, conf, q = self._pick(logits)
            if conf < self.config.p_min:
                break
            confs.append(conf)
            if self._rule is not None and not self._rule(confs, time.perf_counter() - t0):
                break
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if len(tokens) == max_tokens:
                break
            logits = self._eval([tok])
        q_arr = np.stack(qs) if qs else None
        return Draft(token_ids=tuple(tokens), source=self.name, q=q_arr)

    def _sync(self, context_ids: Sequence[int]) -> np.ndarray:
        """Make the draft KV equal ``context_ids[:-1]`` plus evaluate the rest; return last logits."""
        cached, n = self._cached, len(context_ids)
        i = min(self._synced, n)
        limit = min(len(cached), n - 1)  # always re-evaluate at least the last token
        while i < limit and cached[i] == context_ids[i]:
            i += 1
        if i < len(cached):
            self.model.truncate(i)
            del cached[i:]
        self._synced = n
        return self._eval(context_ids[i:])

    def _eval(self, tokens: Sequence[int]) -> np.ndarray:
        self._cached.extend(tokens)
        return self.model.eval(tokens)[-1]  # [V] view of the last row

    def _pick(self, logits: np.ndarray) -> tuple[int, float, np.ndarray | None]:
        """(token, confidence, q row or None).  Confidence is the draft's probability of its token."""
        logits = logits[: self.n_vocab]
        if not self._sampled:
            tok = int(logits.argmax())
            if self.config.p_min <= 0.0 and self._rule is None:
                return tok, 1.0, None
            conf = float(1.0 / np.exp(logits.astype(np.float64) - logits[tok]).sum())
            return tok, conf, None
        q = softmax(logits[None, :], self.temperature)[0]
        if q.shape[0] < self.n_vocab:  # a smaller draft vocabulary: the target's extra ids get q = 0
            q = np.pad(q, (0, self.n_vocab - q.shape[0]))
        tok = sample(q, self._rng)
        return tok, float(q[tok]), q


def _load_checked(ctx: BuildContext, config: DraftModelConfig) -> LlamaModel:
    """Refuse a draft whose vocabulary differs from the target's, before loading any weights."""
    from ..check import require_draftable

    require_draftable(ctx.target.path, config.draft_model)
    return LlamaModel(
        ModelConfig(
            path=Path(config.draft_model),
            n_ctx=ctx.target.n_ctx,
            n_threads=config.draft_threads or ctx.target.n_threads,
            min_batch=1,  # draft logits need not be batch-invariant
        ),
        role="draft model",
    )


@register("draft-model")
def _build(ctx: BuildContext) -> DraftModelDrafter:
    config = config_from_options(DraftModelConfig, ctx.options)
    return DraftModelDrafter(_load_checked(ctx, config), ctx.temperature, config, target_vocab=ctx.target.n_vocab)
