"""REST: draft the most frequent continuation of the context's longest match in a corpus.

He et al., arXiv 2311.08252 (FasterDecoding/REST).  The corpus is a static,
memory-mapped suffix-array datastore (``specstack datastore build``); each
step looks up the longest suffix of the context (``max_match`` down to
``min_match`` tokens) and drafts what most often followed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..retrieval.datastore import Datastore
from ..errors import InvalidParameterError, VocabMismatchError
from ..types import Draft
from .base import BuildContext, DraftRequest, Needs, config_from_options, register

NAME = "rest"  # its registry name, for those that name it (default method lists, messages)

DEMO_STORE = Path("~/.cache/specstack/datastore-stdlib")


@dataclass(frozen=True)
class RestConfig:
    """REST settings.

    datastore: folder made by ``specstack datastore build`` (required).
    max_match, min_match: longest and shortest context suffix to look up.
    max_candidates: occurrences read per lookup (an even sample if more).
    min_token_prob: stop the draft when fewer than this fraction of the
      occurrences agree with it.  REST has no floor (0), but on a CPU every
      drafted token costs verification time: on held-out code a 0.2 floor
      drafted 40% fewer tokens for 4% fewer accepted ones.
    """

    datastore: str | None = None
    max_match: int = 16
    min_match: int = 2
    max_candidates: int = 1024
    min_token_prob: float = 0.2
    tree: bool = False  # propose candidate trees (verified in one batch) instead of one chain

    def __post_init__(self) -> None:
        if not self.datastore:
            raise InvalidParameterError(
                "rest needs a datastore (--datastore STORE): build one with "
                "`specstack datastore build CORPUS... -o STORE`, or run "
                f"scripts/build_demo_datastore.sh for a standard-library store in {DEMO_STORE}"
            )
        if not 1 <= self.min_match <= self.max_match <= 64:
            raise InvalidParameterError(
                f"rest needs 1 <= min_match <= max_match <= 64 "
                f"(got min_match={self.min_match}, max_match={self.max_match})"
            )
        if self.max_candidates < 1:
            raise InvalidParameterError(f"rest needs max_candidates >= 1 (got {self.max_candidates})")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidParameterError(f"rest needs 0 <= min_token_prob <= 1 (got {self.min_token_prob})")


class RestDrafter:
    """Most frequent continuation of the longest context suffix found in the datastore.

    Example: a store holding ``[5, 6, 7, 5, 6, 8, 5, 6, 7]``; for a context
    ending ``[4, 5, 6]`` the longest match is ``[5, 6]`` (3 occurrences, so
    m=2), followed by 7 twice and 8 once: the draft starts with 7, then goes on
    with what followed ``5, 6, 7`` (``5`` once, the document end once).
    """

    name = NAME
    scores_drafts = True  # each token's odds from the datastore's counts (``Draft.scores``)

    def __init__(self, config: RestConfig, store: Datastore | None = None) -> None:
        self.config = config
        self.store = store or Datastore(Path(str(config.datastore)).expanduser())

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        pass  # the datastore is static: nothing per request

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._one(r.context, r.budget.max_tokens, self.config.tree and r.budget.tree) for r in requests]

    def _one(self, context_ids: Sequence[int], max_tokens: int, tree: bool) -> Draft:
        c = self.config
        if max_tokens <= 0:
            return Draft.empty(self.name)
        if tree:
            return self.propose_tree(context_ids, max_tokens)
        r = self.store.propose(
            context_ids[-c.max_match :], max_tokens, c.max_match, c.min_match, c.max_candidates, c.min_token_prob
        )
        return r.draft(self.name, tree=False)

    def propose_tree(self, context_ids: Sequence[int], max_tokens: int, depth: int | None = None) -> Draft:
        """REST's candidate trie: the ``max_tokens`` most frequent prefixes, ``Draft.parents`` set."""
        c = self.config
        r = self.store.propose_tree(
            context_ids[-c.max_match :], depth or max_tokens, max_tokens,
            c.max_match, c.min_match, c.max_candidates, c.min_token_prob,
        )
        return r.draft(self.name, tree=True)

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        pass

    def end(self, seq: int = 0, complete: bool = True) -> None:
        pass


def check_store_matches_target(store: Datastore, target: object) -> None:
    """Refuse a store tokenized with another vocabulary: its ids would mean other text."""
    path = getattr(target, "path", None)
    want = store.fingerprint
    if path is None or not want:
        n_vocab = getattr(target, "n_vocab", None)
        if isinstance(n_vocab, int) and n_vocab != store.n_vocab:
            raise VocabMismatchError(
                f"datastore {store.path} has {store.n_vocab} tokens in its vocabulary, the target "
                f"{n_vocab}: rebuild it with `specstack datastore build CORPUS -m TARGET -o {store.path}`"
            )
        return
    from ..modelfile.meta import read_gguf

    have = read_gguf(path, tensors=False).vocab_fingerprint
    if have and have != want:
        raise VocabMismatchError(
            f"datastore {store.path} was tokenized for {store.meta.get('tokenizer', {}).get('model')}, "
            f"whose vocabulary differs from the target {path}: rebuild it with "
            f"`specstack datastore build CORPUS -m {path} -o {store.path}`"
        )


@register(NAME, needs=Needs(datastore=True))
def _build(ctx: BuildContext) -> RestDrafter:
    drafter = RestDrafter(config_from_options(RestConfig, ctx.options))
    if ctx.target is not None:
        check_store_matches_target(drafter.store, ctx.target)
    return drafter
