"""Turn target logits into the distribution p that both decoding paths sample from.

Plain and speculative decoding call the same function, so temperature, top-k,
top-p, min-p and the seed shape p identically in both (the precondition for
rejection sampling to be lossless).  The filter order follows llama.cpp's
default chain: top-k, then top-p, then min-p on the untempered softmax, then
temperature over the surviving tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import InvalidParameterError
from .types import TokenLogprob

MAX_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings.  ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise InvalidParameterError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding")
        if self.top_k < 0:
            raise InvalidParameterError(f"top_k must be >= 0 (got {self.top_k}); use 0 to disable it")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError(f"top_p must be in (0, 1] (got {self.top_p}); use 1.0 to disable it")
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidParameterError(f"min_p must be in [0, 1) (got {self.min_p}); use 0 to disable it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.entropy_seed)

    @property
    def entropy_seed(self) -> int | None:
        """The seed numpy gets: a negative seed means "random", as llama.cpp's -1 (LLAMA_DEFAULT_SEED)."""
        return None if self.seed is None or self.seed < 0 else self.seed


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax in float64 of ``logits / temperature``.  [n, V] -> [n, V]."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p for each row of ``logits`` [n, V] under ``params`` (temperature > 0)."""
    logits = np.atleast_2d(logits)
    if params.top_k == 0 and params.top_p >= 1.0 and params.min_p <= 0.0:
        return softmax(logits, params.temperature)
    return np.stack([_filtered_row(row, params) for row in logits])


def _filtered_row(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Apply top-k, top-p, min-p to one row, then temperature over the survivors."""
    n_vocab = logits.shape[0]
    if 0 < params.top_k < n_vocab:
        keep = np.argpartition(logits, -params.top_k)[-params.top_k :]
    else:
        keep = np.arange(n_vocab)
    keep = keep[np.argsort(-logits[keep], kind="stable")]  # descending by logit
    base = softmax(logits[keep][None, :])[0]
    if params.top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (always at least one token).
        cut = int(np.searchsorted(np.cumsum(base), params.top_p)) + 1
        keep, base = keep[:cut], base[:cut]
    if params.min_p > 0.0:
        mask = base >= params.min_p * base[0]
        keep = keep[mask]
    out = np.zeros(n_vocab, dtype=np.float64)
    out[keep] = softmax(logits[keep][None, :], params.temperature)[0]
    return out


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (not necessarily normalised) non-negative vector."""
    return sample_at(probs, rng.random())


def sample_at(probs: np.ndarray, u: float) -> int:
    """The token id at quantile ``u`` in [0, 1) of a (not necessarily normalised) non-negative vector."""
    cdf = np.cumsum(probs)
    total = cdf[-1]
    if not total > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    idx = int(np.searchsorted(cdf, u * total, side="right"))
    return min(idx, probs.shape[0] - 1)


class PositionUniforms:
    """One uniform number per output position of a generation, drawn from its seed alone.

    Plain decoding samples position t at quantile ``u[t]``; verifying a deterministic draft takes the
    target's token at ``u[t]`` too and accepts the draft token when they agree, which accepts it with
    probability p(x) and otherwise leaves the residual, as rejection sampling does. So whatever drafts
    a deterministic drafter proposes, and however many of them are accepted, position t gets the token
    plain decoding would sample there: a seeded run's text is the same with every such drafter (given
    the same p, which ``--exact on`` guarantees).
    """

    def __init__(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(None if seed is None else [seed, 0x5EED])
        self._values: list[float] = []
        self._base = 0  # the position of _values[0]; positions only move forward

    def at(self, start: int, n: int) -> list[float]:
        """The uniforms of positions ``start .. start + n - 1``."""
        if start < self._base:
            raise ValueError(f"position {start} was already sampled (next is {self._base})")
        missing = start + n - self._base - len(self._values)
        if missing > 0:
            self._values.extend(self._rng.random(max(missing, 64)).tolist())
        del self._values[: start - self._base]
        self._base = start
        return self._values[:n]


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], n_top: int) -> list[TokenLogprob]:
    """Log-softmax of the raw logits (no temperature or filters, as vLLM and the OpenAI API report them) at
    ``tokens[i]`` in row i, with the ``n_top`` most likely ids of each row.

    Only the rows asked for are touched (one pass over each 262k-wide row of a large vocabulary: about a
    millisecond), and only for requests that ask for logprobs.
    """
    out: list[TokenLogprob] = []
    for row, tok in zip(np.atleast_2d(logits), tokens):
        z = row.astype(np.float64)
        top = float(z.max())
        lse = top + float(np.log(np.exp(z - top).sum()))
        alts: tuple[tuple[int, float], ...] = ()
        if n_top > 0:
            ids = np.argpartition(-z, n_top - 1)[:n_top]
            ids = ids[np.lexsort((ids, -z[ids]))]  # most likely first; ties by id, so runs agree
            alts = tuple((int(i), float(z[i] - lse)) for i in ids)
        out.append(TokenLogprob(int(tok), float(z[int(tok)] - lse), alts))
    return out


def token_probs(probs: np.ndarray, tokens: Sequence[int], n_top: int) -> list[TokenLogprob]:
    """llama-server's ``post_sampling_probs``: each row's chosen token and its ``n_top`` most likely alternatives
    under the distribution the token was sampled from (``probs``: the sampler chain's p, filters and temperature
    applied), as logs of those probabilities.  Tokens the chain removed (p = 0) are never listed, so a row may
    have fewer than ``n_top`` alternatives, as llama-server's do."""
    out: list[TokenLogprob] = []
    with np.errstate(divide="ignore"):
        for row, tok in zip(np.atleast_2d(probs), tokens):
            p = np.asarray(row, dtype=np.float64)
            p = p / p.sum() if p.sum() > 0 else p
            alts: tuple[tuple[int, float], ...] = ()
            if n_top > 0:
                n = min(n_top, int(np.count_nonzero(p)))
                ids = np.argpartition(-p, n - 1)[:n] if n else np.array([], dtype=np.int64)
                ids = ids[np.lexsort((ids, -p[ids]))]
                alts = tuple((int(i), float(np.log(p[i]))) for i in ids)
            out.append(TokenLogprob(int(tok), float(np.log(p[int(tok)])) if 0 <= tok < len(p) else float("-inf"),
                                    alts))
    return out


def one_hot(n_vocab: int, tokens: Sequence[int]) -> np.ndarray:
    """The distribution greedy decoding samples from at each row: all of the mass on the chosen token."""
    out = np.zeros((len(tokens), n_vocab), dtype=np.float64)
    for i, tok in enumerate(tokens):
        if 0 <= tok < n_vocab:
            out[i, tok] = 1.0
    return out
