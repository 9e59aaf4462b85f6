"""SuffixDecoding: draft from suffix trees over this request and over earlier outputs.

Oliaro et al., arXiv 2411.04975, as ArcticInference runs it: a per-request
tree over prompt + output and a global tree over previous requests' outputs
(FIFO-evicted to a token budget, optionally cached on disk); each step both are
queried and the draft with the higher score (expected accepted tokens) wins.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import InvalidParameterError
from ..retrieval import suffix_draft
from ..retrieval.lookup import Lookup
from ..retrieval.suffix_match import SuffixMatcher
from ..retrieval.suffix_tree import SuffixTree
from ..retrieval.suffix_tree_file import Vocab
from ..types import Draft
from .base import BuildContext, DraftRequest, LlamaCpp, config_from_options, register

NAME = "suffix"  # its registry name, for those that name it (default method lists, messages)

_LOCAL = 0  # sequence id of the request in its own tree


@dataclass(frozen=True)
class SuffixConfig:
    """SuffixDecoding settings (names follow ArcticInference).

    max_depth: longest suffix the trees index (and longest match), in tokens.
    max_spec_factor, max_spec_offset: a match of m tokens drafts at most
      floor(max_spec_factor * m + max_spec_offset) tokens (and at most k).
    min_token_prob: stop a draft when its path probability falls below this.
    global_budget_tokens: tokens kept in the global tree; the oldest requests
      are evicted first (about 270 bytes of memory per token); 0 disables it.
    global_prompts: also put each request's prompt in the global tree, so the
      next request's prompt can match where an earlier prompt ended and draft
      that prompt's output from the first step (on the bundled repetitive
      workload: 3.45x instead of 3.16x, modelled from replayed drafts); costs
      budget.  ArcticInference keeps outputs only: set False for that.
    cache_path: .npz file holding the global tree: loaded when the drafter is
      made (if it exists), saved at the end of every request.  It records the
      target's vocabulary; a file from another vocabulary is refused.
    """

    max_depth: int = 64
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    global_budget_tokens: int = 250_000
    global_prompts: bool = True
    cache_path: str | None = None
    tree: bool = False  # propose best-first trees (verified in one batch) instead of one chain

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise InvalidParameterError(f"suffix needs max_depth >= 1 (got {self.max_depth})")
        if not (math.isfinite(self.max_spec_factor) and self.max_spec_factor >= 0):
            raise InvalidParameterError(
                f"suffix needs max_spec_factor >= 0 (got {self.max_spec_factor})"
            )
        if not math.isfinite(self.max_spec_offset):
            raise InvalidParameterError(
                f"suffix needs a finite max_spec_offset (got {self.max_spec_offset})"
            )
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidParameterError(
                f"suffix needs 0 <= min_token_prob <= 1 (got {self.min_token_prob})"
            )
        if self.cache_path:
            import tempfile

            parent = Path(self.cache_path).expanduser().resolve().parent
            try:  # probe by writing: root passes a permission check that a read-only filesystem still refuses
                with tempfile.NamedTemporaryFile(dir=parent, prefix=".specstack-probe-"):
                    pass
            except OSError as exc:
                raise InvalidParameterError(
                    f"suffix cache {self.cache_path}: cannot write in {parent} ({exc.strerror or exc}); the global "
                    "tree is saved there after each request, so pick a writable path") from None
        if self.global_budget_tokens < 0:
            raise InvalidParameterError(
                f"suffix needs global_budget_tokens >= 0 (got {self.global_budget_tokens}); "
                "use 0 to turn the global tree off"
            )


@dataclass
class _Generation:
    """One generation's request tree and its streaming match in the global tree."""

    prompt: list[int]
    output: list[int]
    local: SuffixTree
    matcher: SuffixMatcher


class SuffixDrafter:
    """Suffix-tree drafts from this request's text and from earlier outputs.

    Example (max_spec_factor=1): prompt ``[7, 1, 2, 3, 9, 1, 2]``.  The
    request's tree has seen ``1, 2`` once before, followed by ``3``; the context
    ends with ``[1, 2]`` (m=2), so the draft is ``[3, 9]`` with probability
    1 each (the current occurrence, with no continuation yet, is not counted).
    Had an earlier request output ``1, 2, 3, 9, 4`` and ``1, 2, 5``, the global
    tree would propose ``[3, 9]`` at probability 1/2 and lose.
    """

    name = NAME
    scores_drafts = True  # each token's odds from the match's evidence (``Draft.scores``)

    def __init__(self, config: SuffixConfig | None = None, vocab: Vocab = Vocab()) -> None:
        self.config = cfg = config or SuffixConfig()
        self.vocab = vocab  # what saved trees are for, and what a loaded one must be for
        self.global_tree = SuffixTree(cfg.max_depth)
        self._next_seq = 0
        self._gens: dict[int, _Generation] = {}
        self._save_failed = False  # a failed cache save is reported once
        if cfg.cache_path and Path(cfg.cache_path).exists():
            self.load(cfg.cache_path)

    # --- Drafter protocol -------------------------------------------------------------
    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        prompt = [int(t) for t in prompt_ids]
        local = SuffixTree(self.config.max_depth)
        local.extend(_LOCAL, prompt)
        self._gens[seq] = _Generation(prompt, [], local, SuffixMatcher(self.global_tree, prompt))

    reads_context = True  # drafts after any context (``_states`` matches one that is not the generation's)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            tree = self.config.tree and r.budget.tree
            # the cost policy reads the match's evidence, not the counts alone (``Lookup.draft``)
            out.append(self._best(r.seq, r.context, r.budget.max_tokens, tree).draft(self.name, tree, evidence=True))
        return out

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        gen = self._gens.get(seq)
        if gen is None:
            return
        ids = [int(t) for t in new_ids]
        gen.local.extend(_LOCAL, ids)
        gen.matcher.extend(ids)
        gen.output.extend(ids)

    def end(self, seq: int = 0, complete: bool = True) -> None:
        gen = self._gens.pop(seq, None)
        if gen is None or not complete:  # a cancelled generation's partial output is not a whole answer
            return
        self._add_global(gen.prompt + gen.output if self.config.global_prompts else gen.output)
        if self.config.cache_path:
            try:
                self.save(self.config.cache_path)
            except OSError as exc:  # the output is already out: say so once, keep serving
                if not self._save_failed:
                    self._save_failed = True
                    print(f"specstack: warning: cannot save the suffix cache to {self.config.cache_path} "
                          f"({exc.strerror or exc}); the global tree lives in memory only until it can",
                          file=sys.stderr, flush=True)

    # --- drafts -----------------------------------------------------------------------
    def propose_chain(self, context_ids: Sequence[int], max_tokens: int, seq: int = 0) -> Lookup:
        """The better of the request-tree and global-tree path drafts (request wins ties), with its score."""
        return self._best(seq, context_ids, max_tokens, tree=False)

    def _best(self, seq: int, context_ids: Sequence[int], max_tokens: int, tree: bool) -> Lookup:
        """Query both trees (paths or best-first trees); the higher score wins, the request tree on ties."""
        gen = self._gens.get(seq)
        if gen is None or max_tokens <= 0:
            return Lookup()
        local_states, global_states, own = self._states(gen, context_ids)
        cfg = self.config
        args = (max_tokens, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob)
        query = suffix_draft.propose_tree if tree else suffix_draft.propose
        # the request's tree holds this very context as its open end: not evidence (``suffix_draft.propose``)
        best = query(gen.local, local_states, *args, open_end=own) if local_states else Lookup()
        if global_states:
            other = query(self.global_tree, global_states, *args)
            if other.score > best.score:
                best = other
        return best

    def _states(self, gen: "_Generation", context_ids: Sequence[int]) -> tuple[list, list, bool]:
        """Match states in both trees for the end of ``context_ids``, and whether that end is the request tree's
        own open end (then counted at every local match state).

        Normally the context is exactly prompt + committed output, so the
        request tree's own active nodes and the streaming matcher answer in
        O(1); any other context (the engine skipped an advance, or rolled back)
        is matched from scratch.
        """
        n = len(gen.prompt) + len(gen.output)
        last = gen.output[-1] if gen.output else gen.prompt[-1] if gen.prompt else None
        if len(context_ids) == n and (n == 0 or int(context_ids[-1]) == last):
            return gen.local.active_states(_LOCAL), gen.matcher.states(), True
        tail = [int(t) for t in context_ids[-self.config.max_depth :]]
        return gen.local.match_states(tail), self.global_tree.match_states(tail), False

    # --- the global tree --------------------------------------------------------------
    def _add_global(self, seq: Sequence[int]) -> None:
        budget = self.config.global_budget_tokens
        if budget <= 0 or not seq:
            return
        seq = seq[-budget:]  # a single request longer than the budget keeps its end
        while self.global_tree.n_tokens + len(seq) > budget:
            self.global_tree.remove(self.global_tree.seq_ids()[0])  # FIFO: oldest request first
        self.global_tree.extend(self._next_seq, seq)
        self.global_tree.close(self._next_seq)
        self._next_seq += 1

    def save(self, path: str | Path) -> None:
        """Write the global tree to ``path`` (.npz); ``load`` restores it exactly."""
        self.global_tree.save(path, self.vocab)

    def load(self, path: str | Path) -> None:
        """Replace the global tree with the one saved at ``path``, evicting down to the budget.

        A file saved for another vocabulary than ``self.vocab`` raises VocabMismatchError.
        """
        tree = SuffixTree.load(path, max_depth=self.config.max_depth, vocab=self.vocab)
        while tree.n_tokens > self.config.global_budget_tokens:
            tree.remove(tree.seq_ids()[0])
        for sid in tree.seq_ids():
            tree.close(sid)
        self.global_tree = tree
        self._next_seq = max(tree.seq_ids(), default=-1) + 1
        for gen in self._gens.values():
            gen.matcher = SuffixMatcher(tree, (gen.prompt + gen.output)[-self.config.max_depth :])


def target_vocab(target: object, with_fingerprint: bool = True) -> Vocab:
    """The target's vocabulary as a suffix cache records it (its GGUF fingerprint, if asked, and n_vocab)."""
    n_vocab = getattr(target, "n_vocab", None)
    path = getattr(target, "path", None) if with_fingerprint else None
    fingerprint = None
    if path is not None:
        from ..modelfile.meta import read_gguf

        fingerprint = read_gguf(path, tensors=False).vocab_fingerprint
    return Vocab(fingerprint, n_vocab if isinstance(n_vocab, int) else None)


# llama.cpp's n-gram statistics shared across requests: the suffix drafter's tree holds every slot's prompts and
# outputs
@register(NAME, llama=LlamaCpp(spec_types=("ngram-mod", "ngram-cache"), peers=("llama-ngram-cache",)))
def _build(ctx: BuildContext) -> SuffixDrafter:
    cfg = config_from_options(SuffixConfig, ctx.options)
    # The fingerprint reads the GGUF's vocabulary: only worth it when there is a cache file.
    return SuffixDrafter(cfg, target_vocab(ctx.target, bool(cfg.cache_path)) if ctx.target is not None else Vocab())
