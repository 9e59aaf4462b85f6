"""Layer layout for LFM2 (short-conv/attention hybrid) sources.

An LFM2 stand-in has two layer types, so placing the source layers means choosing each stand-in
layer's type too: keep the source's conv:attention share, spread evenly, and (for Q4_K_M) put every
source layer where llama.cpp gives it the same tensor types as in the source. Both Q4_K_M counters
(ffn_down by layer index, attn_v by attention-layer index) must agree, which a greedy scan cannot
guarantee; hence the dynamic programme in ``_layout_dp``. Tensor padding for LFM2 is in ``pad``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import InvalidParameterError
from .llama import use_more_bits, place_source_layers
from .shape import LayerLayout, LlamaShape


def _spread(n_attn: int, n_out: int) -> tuple[bool, ...]:
    """n_attn attention layers spread evenly over n_out (integer Bresenham)."""
    return tuple((p + 1) * n_attn // n_out > p * n_attn // n_out for p in range(n_out))


def _layout_dp(src_attn: Sequence[bool], n_out: int, a_out: int, q4: bool
               ) -> tuple[tuple[bool, ...], list[int]] | None:
    """Layer types and source-layer slots for an n_out-layer stand-in with a_out attention
    layers, as close to evenly spread as possible (fewest layers whose type differs from
    ``_spread``), or None when none exists.

    Every source layer keeps its type and order; with ``q4`` it also keeps its Q4_K_M verdicts:
    ffn_down by layer index (use_more_bits(slot, n_out) == use_more_bits(j, n_src)) and, for
    attention layers, attn_v by attention-layer index (llama-quant.cpp counts attn_v tensors).
    Dynamic programme over (slot, source layers placed, attention layers so far).
    """
    n_src, a_src = len(src_attn), sum(src_attn)
    if not (a_src <= a_out and n_src - a_src <= n_out - a_out):
        return None
    ideal = _spread(a_out, n_out)
    rank = np.cumsum([0] + [int(t) for t in src_attn])[:-1]
    v_out = np.array([use_more_bits(a, a_out) for a in range(a_out)], dtype=bool)
    inf = 1 << 40
    cost = np.full((n_src + 1, a_out + 1), inf, dtype=np.int64)
    cost[0, 0] = 0
    choices = []  # per slot: 0 none, 1 conv filler, 2 attention filler, 3 a source layer
    for p in range(n_out):
        new = np.full_like(cost, inf)
        ch = np.zeros(cost.shape, dtype=np.int8)
        miss_conv, miss_attn = int(ideal[p]), int(not ideal[p])
        for j, is_attn in enumerate(src_attn):  # source layers first: ties place them early
            if q4 and use_more_bits(p, n_out) != use_more_bits(j, n_src):
                continue
            if is_attn:
                cand = cost[j, :-1] + miss_attn
                if q4:
                    cand = np.where(v_out == use_more_bits(int(rank[j]), a_src), cand, inf)
                _relax(new, ch, (j + 1, slice(1, None)), cand, 3)
            else:
                _relax(new, ch, (j + 1, slice(None)), cost[j] + miss_conv, 3)
        _relax(new, ch, (slice(None), slice(None)), cost + miss_conv, 1)
        _relax(new, ch, (slice(None), slice(1, None)), cost[:, :-1] + miss_attn, 2)
        cost = np.minimum(new, inf)
        choices.append(ch)
    if cost[n_src, a_out] >= inf:
        return None
    return _trace_back(choices, src_attn, a_out)


def _relax(new: np.ndarray, ch: np.ndarray, dst: tuple, cand: np.ndarray, code: int) -> None:
    """One DP step: where ``cand`` beats the best cost so far at ``dst``, take it and note ``code``."""
    better = cand < new[dst]
    new[dst] = np.where(better, cand, new[dst])
    ch[dst] = np.where(better, code, ch[dst])


def _trace_back(choices: list[np.ndarray], src_attn: Sequence[bool], a_out: int
                ) -> tuple[tuple[bool, ...], list[int]]:
    """Layer types and source slots of the optimum ``_layout_dp`` found, from its per-slot choices."""
    n_out = len(choices)
    types, slots = [False] * n_out, []
    j, a = len(src_attn), a_out
    for p in range(n_out - 1, -1, -1):
        code = choices[p][j, a]
        if code == 3:
            j -= 1
            types[p] = bool(src_attn[j])
            slots.append(p)
        else:
            types[p] = bool(code == 2)
        a -= types[p]
    assert j == 0 and a == 0
    return tuple(types), slots[::-1]


def lfm2_layer_layout(src_attn: Sequence[bool], n_out: int, n_attn: int | None = None
                      ) -> tuple[tuple[bool, ...], list[int], bool]:
    """Layer types (True: attention) of an ``n_out``-layer LFM2 stand-in, the slots of the
    source layers, and whether Q4_K_M then gives every source layer its source tensor types.

    The stand-in keeps the source's attention share (``n_attn`` overrides it), spread as evenly
    as the constraints allow. When no layout with that count keeps the Q4_K_M types, counts up to
    a quarter away are tried (nearest first, only when ``n_attn`` is not given); failing that,
    the layer types alone are kept.
    """
    n_src, a_src = len(src_attn), sum(src_attn)
    lo, hi = a_src, n_out - (n_src - a_src)
    if a_src == 0:  # a filler copies a source layer of its type, so a type the source lacks is out
        hi = 0
    elif a_src == n_src:
        lo = n_out
    if n_attn is not None:
        if not lo <= n_attn <= hi:
            raise InvalidParameterError(
                f"--attn-layers {n_attn}: need between {lo} and {hi} with {n_out} layers (at least the "
                f"source's {a_src} attention and {n_src - a_src} conv layers, and no layer type it lacks)")
        target, candidates = n_attn, [n_attn]
    else:
        target = min(hi, max(lo, round(n_out * a_src / n_src)))
        reach = max(2, target // 4)
        candidates = sorted((a for a in range(lo, hi + 1) if abs(a - target) <= reach),
                            key=lambda a: (abs(a - target), a))
    for a in candidates:
        found = _layout_dp(src_attn, n_out, a, q4=True)
        if found is not None:
            return found[0], found[1], True
    found = _layout_dp(src_attn, n_out, target, q4=False)
    assert found is not None  # the count lies in [lo, hi], so the types alone always fit
    return found[0], found[1], False


def lfm2_standin_layout(src: LlamaShape, layers: int, ftype: str, attn_layers: int | None) -> LayerLayout:
    """The ``layers``-layer stand-in's layout for an LFM2 source (see ``lfm2_layer_layout``);
    refuses q4_k_m when no layout keeps every source layer's Q4_K_M tensor types."""
    src_attn = [src.is_attention(j) for j in range(src.n_layer)]
    types, slots, q4_ok = lfm2_layer_layout(src_attn, layers, attn_layers)
    if ftype == "q4_k_m" and not q4_ok:
        raise InvalidParameterError(
            f"no layout of {layers} layers ({'--attn-layers ' + str(attn_layers) if attn_layers else 'the source mix'}) "
            f"gives every source layer its Q4_K_M tensor types (use_more_bits); try a layer count "
            f"or --attn-layers close to this one")
    pools = {t: [j for j in range(src.n_layer) if src_attn[j] == t] for t in (False, True)}
    used = {False: 0, True: 0}
    fillers = []
    for t in types:  # fillers cycle through the source layers of their type
        fillers.append(pools[t][used[t] % len(pools[t])])
        used[t] += 1
    source, live = place_source_layers(fillers, slots)
    return LayerLayout(source, live, q4_ok, types)


def lfm2_residual_copies(d: int, width: int) -> int:
    """m = W / d, so c = 1 and epsilon stays the source's: LFM2's q/k norms share that epsilon but
    see unpadded head_dim values (package docstring). 1 when W is not a multiple of d: inexact."""
    return width // d if width % d == 0 else 1
