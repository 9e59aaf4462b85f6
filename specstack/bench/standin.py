"""Cost-faithful stand-in targets: a big model that computes exactly a small model's function.

A stand-in zero-pads a llama-architecture or LFM2 (``lfm2``, short-conv/attention hybrid) GGUF
to a wider hidden size, a wider FFN and more attention heads, and adds layers that write nothing
to the residual stream. Its logits equal the source's, while every decode step moves the bytes
and does the FLOPs of the big shape. So acceptance comes from the real (small) trained model and
cost comes from the big one.

Why it is exact (d = source width, W = stand-in width; original coordinates come first):

- The residual stream holds m copies of the source's d coordinates, then zeros: the embedding
  columns are repeated m times and every weight that writes to the residual (attention output,
  FFN down, LFM2's short-conv out_proj) has its rows repeated m times and zero rows after that.
  Zero coordinates stay zero.
- RMSNorm over W coordinates: mean_W(x^2) = (m d / W) mean_d(x^2). With epsilon scaled by
  c^2 = m d / W and the norm weight by c on the first copy (zero elsewhere), the normalised
  coordinates the next matrices read are unchanged, and the other copies read as zeros.
  m is the smallest count with W / (m d) a power of 4 (m = 1 when W/d is 1, 4, 16, ..; m = 2
  for 2, 8, 32, ..; m = 3 for 3, 12, ..): then c is a power of two and every rescaling
  is exact in floating point, so the stand-in's logits equal the source's bit for bit. With
  m = 1 and W/d = 2 the norms would be off by an F32 ulp, which Q8_0 activation rounding
  amplifies to logit differences of ~0.04 and real greedy flips. Widths that are not a whole
  multiple of d fall back to m = 1, c = sqrt(d / W): close, not bit-exact.
- Extra query heads have zero Wq rows, so they attend uniformly over values they never pass on
  (their Wo columns are zero). KV heads grow in the same ratio and original heads come first, so
  llama.cpp's grouped-query mapping (query head h reads KV head h // (n_head / n_head_kv)) still
  sends original query heads to original KV heads. ``kv_heads`` may instead ask for fewer KV
  heads (a bigger group, R query heads per KV head instead of the source's r, to match a real
  model's KV-cache size): source query head h then sits at slot (h // r) R + h % r, so it still
  reads its own KV head. The R - r extra query heads of a source group read real values, which
  their zero Wo columns drop; exact in F16, and in Q8_0 when head_dim is a multiple of 32, but not
  in Q4_K_M (its 256-wide blocks then mix heads differently).
- Extra FFN units have zero gate/up rows and zero down columns.
- Extra layers copy a source layer's weights (realistic magnitudes, so no overflow) but have zero
  attention-output and FFN-down matrices, so they add exactly zero.

LFM2 (``lfm2``; llama.cpp ``src/models/lfm2.cpp``). The output norm is ``token_embd_norm``; each
layer is ``x += op(attn_norm(x)); x += ffn(ffn_norm(x))`` where op is GQA attention on layers
whose ``lfm2.attention.head_count_kv`` entry is > 0 and a gated short convolution on the others.

- One epsilon (``lfm2.attention.layer_norm_rms_epsilon``) serves the residual norms *and* the
  per-head q/k norms. The q/k norms act on head_dim values that padding does not change, so
  their epsilon must not be rescaled: LFM2 stand-ins therefore keep c = 1 by using m = W / d
  residual copies (W a multiple of d; W/d = 8 gives 8 copies). Then epsilon is the source's,
  and the logits are bit-identical. W not a multiple of d falls back to m = 1 and a rescaled
  epsilon, which the q/k norms also see: close, not bit-exact.
- attention layers: q/k/v/output as above; ``attn_q_norm``/``attn_k_norm`` (length head_dim,
  shared by all heads) are copied unchanged: a source head's q and k are the source's, and an
  extra head's zero q/k normalise to zero (rms_norm(0) = 0 * 1/sqrt(eps)).
- short-conv layers: ``shortconv.in_proj`` (d -> 3d: chunks B, C, x) becomes W -> 3W with each
  chunk padded separately (the source's d rows at the top of each W-row chunk, reading only the
  first residual copy, like q/k/v); so B, C and x of the extra channels are 0, their B*x is 0,
  the depthwise causal conv (``shortconv.conv``, {l_cache, W}; extra channels' taps are zero)
  gives 0 there and the source's exact values in the source channels (each channel's taps only
  see that channel), and C*conv is 0 in the extra channels. ``shortconv.out_proj`` writes the
  residual: rows repeated m times, the source's d columns first. The conv state grows to
  (l_cache - 1) x W per sequence, as it would in a real W-wide model.
- layer mix: extra layers are short-conv or attention so that the stand-in keeps the source's
  conv:attention ratio (``attn_layers`` overrides it, e.g. 6 of 16 as in LFM2-1.2B), spread
  evenly; ``lfm2.attention.head_count_kv`` is rewritten per layer (0 on conv layers). A filler
  layer copies a source layer of its own type with its output matrix and ffn_down zeroed.

Quantized stand-ins are made with llama.cpp's own quantizer. The source width fills whole quant
blocks, so the original blocks quantize identically. Q4_K_M also picks some tensor types by layer
index (``use_more_bits`` in llama-quant.cpp), so the source layers are placed at layer slots that
get the same types as in the source; the zero layers fill the other slots. For LFM2 two counters
matter (llama-quant.cpp walks tensors in layer order): ``ffn_down`` of layer i is Q6_K iff
use_more_bits(i, n_layer), and ``attn_v`` of the k-th *attention* layer is Q6_K iff
use_more_bits(k, n_attention_layers). The layout search picks the layer types and the live slots
so that both verdicts, and the layer type, match the source's for every source layer (it refuses
q4_k_m when no such layout exists near the requested mix). ``shortconv.conv`` is never quantized;
``shortconv.in_proj``/``out_proj`` get the default Q4_K.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import InvalidParameterError, ModelLoadError, SpecstackError, UnsupportedModelError

FTYPES = ("f16", "q8_0", "q4_k_m")
# Quant block length (elements per row block) per ftype; rows of the source must fill whole blocks.
_BLOCK = {"f16": 1, "q8_0": 32, "q4_k_m": 256}

_ARCH = "llama"
ARCHS = ("llama", "lfm2")
_PER_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Mixture of experts: a router (F32) and stacked expert matrices [n_expert, rows, cols].
_PER_LAYER_MOE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# LFM2: attention layers and short-conv layers share the norms and the SwiGLU FFN.
_LFM2_ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_LFM2_CONV = ("attn_norm", "shortconv.in_proj", "shortconv.conv", "shortconv.out_proj",
              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Matrices that write the residual stream: rows repeated m times; zero in filler layers.
_WRITES_RESIDUAL = ("attn_output", "ffn_down", "shortconv.out_proj")


class StandinError(SpecstackError):
    """A stand-in cannot be made from this source with these settings."""


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a llama-architecture (dense or MoE) or LFM2 model, as llama.cpp reads it.

    For LFM2, ``layer_kv[i]`` is layer i's KV head count (0: a short-conv layer) and ``n_head_kv``
    that of the first attention layer.
    """

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int  # per expert for MoE models
    n_vocab: int
    tied_output: bool
    n_expert: int = 0  # 0: dense
    n_expert_used: int = 0
    arch: str = "llama"
    layer_kv: tuple[int, ...] = ()  # lfm2 only
    l_cache: int = 0  # lfm2 only: short-conv kernel length

    @property
    def per_layer(self) -> tuple[str, ...]:
        """Tensor kinds of a llama layer (see ``layer_kinds`` for LFM2's two layer types)."""
        return _PER_LAYER_MOE if self.n_expert else _PER_LAYER

    def is_attention(self, i: int) -> bool:
        return self.layer_kv[i] > 0 if self.arch == "lfm2" else True

    def kv_heads(self, i: int) -> int:
        return self.layer_kv[i] if self.arch == "lfm2" else self.n_head_kv

    def layer_kinds(self, i: int) -> tuple[str, ...]:
        if self.arch == "lfm2":
            return _LFM2_ATTN if self.is_attention(i) else _LFM2_CONV
        return self.per_layer

    @property
    def n_attention_layers(self) -> int:
        return sum(self.is_attention(i) for i in range(self.n_layer))

    @property
    def output_norm(self) -> str:
        return "token_embd_norm" if self.arch == "lfm2" else "output_norm"

    @property
    def n_params(self) -> int:
        d, hd = self.n_embd, self.head_dim
        ffn = 3 * d * self.n_ff * max(1, self.n_expert) + d * self.n_expert
        total = 0
        for i in range(self.n_layer):
            if self.is_attention(i):
                mix = d * hd * (2 * self.n_head + 2 * self.kv_heads(i)) + (2 * hd if self.arch == "lfm2" else 0)
            else:
                mix = 4 * d * d + self.l_cache * d  # in_proj (3 d x d), out_proj, conv taps
            total += mix + ffn + 2 * d
        embd = self.n_vocab * d * (1 if self.tied_output else 2)
        return total + embd + d


@dataclass(frozen=True)
class StandinPlan:
    """How the source maps into the stand-in.

    ``layer_source[i]`` is the source layer whose weights stand-in layer i holds, and
    ``layer_live[i]`` says whether it is the real one (True) or a zero-output copy.
    """

    src: LlamaShape
    out: LlamaShape
    layer_source: tuple[int, ...]
    layer_live: tuple[bool, ...]
    copies: int  # m: copies of the source's residual coordinates
    norm_scale: float  # c = sqrt(m d / W); norm weights are multiplied by c, epsilon by c^2
    # Q4_K_M gives every source layer the same tensor types in the stand-in (see live_layer_slots).
    q4_types_match: bool = True

    @property
    def bit_exact(self) -> bool:
        """True when c is a power of two, so the rescaled norms round exactly like the source's.

        LFM2's q/k norms share the residual norms' epsilon but act on unscaled values: only
        c = 1 (epsilon unchanged) is exact there. A changed GQA group size (``kv_heads``) is
        exact in F16 (see ``exact_for``)."""
        if self.src.arch == "lfm2":
            return self.norm_scale == 1.0
        return math.frexp(self.norm_scale)[0] == 0.5

    @property
    def regrouped_heads(self) -> bool:
        """True when some attention layer's query heads per KV head differ from the source's."""
        o, s = self.out, self.src
        return any(o.is_attention(i) and o.n_head // o.kv_heads(i) != s.n_head // s.kv_heads(j)
                   for i, j in enumerate(self.layer_source))

    def exact_for(self, ftype: str) -> bool:
        """Whether the stand-in quantized to ``ftype`` should give the equally quantized source's
        logits bit for bit (what the module docstring argues; the tests measure it)."""
        if not self.bit_exact:
            return False
        if ftype == "q4_k_m":
            return self.q4_types_match and not self.regrouped_heads
        if ftype == "q8_0":
            return not self.regrouped_heads or self.src.head_dim % 32 == 0
        return True


# ---------------------------------------------------------------------------------------------
# Planning (pure)
# ---------------------------------------------------------------------------------------------

def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # Copied from llama.cpp src/llama-quant.cpp: Q4_K_M/Q5_K_M give attn_v and ffn_down of
    # these layers Q6_K.
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def live_layer_slots(n_src: int, n_out: int) -> list[int]:
    """Stand-in layer indices for the source layers, in order.

    Picks the earliest slots whose ``use_more_bits`` pattern equals the source's, so Q4_K_M gives
    each source layer the same tensor types in both models. Greedy earliest matching finds such a
    subsequence whenever one exists; otherwise the source layers go first.
    """
    slots: list[int] = []
    pos = 0
    for j in range(n_src):
        want = _use_more_bits(j, n_src)
        while pos < n_out and _use_more_bits(pos, n_out) != want:
            pos += 1
        if pos >= n_out:
            return list(range(n_src))
        slots.append(pos)
        pos += 1
    return slots


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
    v_out = np.array([_use_more_bits(a, a_out) for a in range(a_out)], dtype=bool)
    inf = 1 << 40
    cost = np.full((n_src + 1, a_out + 1), inf, dtype=np.int64)
    cost[0, 0] = 0
    choices = []  # per slot: 0 none, 1 conv filler, 2 attention filler, 3 a source layer

    def relax(new: np.ndarray, ch: np.ndarray, dst: tuple, cand: np.ndarray, code: int) -> None:
        better = cand < new[dst]
        new[dst] = np.where(better, cand, new[dst])
        ch[dst] = np.where(better, code, ch[dst])

    for p in range(n_out):
        new = np.full_like(cost, inf)
        ch = np.zeros(cost.shape, dtype=np.int8)
        miss_conv, miss_attn = int(ideal[p]), int(not ideal[p])
        for j, is_attn in enumerate(src_attn):  # source layers first: ties place them early
            if q4 and _use_more_bits(p, n_out) != _use_more_bits(j, n_src):
                continue
            if is_attn:
                cand = cost[j, :-1] + miss_attn
                if q4:
                    cand = np.where(v_out == _use_more_bits(int(rank[j]), a_src), cand, inf)
                relax(new, ch, (j + 1, slice(1, None)), cand, 3)
            else:
                relax(new, ch, (j + 1, slice(None)), cost[j] + miss_conv, 3)
        relax(new, ch, (slice(None), slice(None)), cost + miss_conv, 1)
        relax(new, ch, (slice(None), slice(1, None)), cost[:, :-1] + miss_attn, 2)
        cost = np.minimum(new, inf)
        choices.append(ch)
    if cost[n_src, a_out] >= inf:
        return None
    types, slots = [False] * n_out, []
    j, a = n_src, a_out
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


def residual_copies(d: int, width: int) -> int:
    """m: how many copies of the d source coordinates to keep, so that width / (m d) is a power
    of 4 (see the module docstring); 1 when width is not a whole multiple of d."""
    if width % d:
        return 1
    ratio = width // d
    while ratio % 4 == 0:
        ratio //= 4
    return ratio


def plan_standin(src: LlamaShape, width: int, layers: int, ffn: int | None = None,
                 ftype: str = "f16", *, kv_heads: int | None = None,
                 attn_layers: int | None = None) -> StandinPlan:
    """Check the request and work out the stand-in's shape and layer layout.

    ``kv_heads``: the stand-in's KV heads per attention layer (default: the source's query heads
    per KV head are kept). ``attn_layers`` (LFM2 only): how many layers are attention layers
    (default: the source's share of ``layers``).
    """
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown --ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    lfm2 = src.arch == "lfm2"
    if attn_layers is not None and not lfm2:
        raise InvalidParameterError("--attn-layers applies to hybrid (lfm2) sources only")
    hd = src.head_dim
    ratios = sorted({src.n_head // src.kv_heads(i) for i in range(src.n_layer) if src.is_attention(i)})
    if width < src.n_embd:
        raise InvalidParameterError(
            f"--width {width} is smaller than the source's hidden size {src.n_embd}; a stand-in can only grow")
    if kv_heads is None:
        ratio = math.lcm(*ratios) if ratios else 1
        if width % (hd * ratio):
            raise InvalidParameterError(
                f"--width {width} must be a multiple of {hd * ratio} (head_dim {hd} x {ratio} query heads per KV "
                f"head), so whole heads can be added in the source's grouped-query ratio")
    else:
        if width % hd or (width // hd) % kv_heads:
            raise InvalidParameterError(
                f"--width {width} must be a multiple of head_dim {hd} x --kv-heads {kv_heads}")
        group = width // hd // kv_heads
        max_kv = max((src.kv_heads(i) for i in range(src.n_layer) if src.is_attention(i)), default=0)
        if kv_heads < max_kv or (ratios and group < ratios[-1]):
            raise InvalidParameterError(
                f"--kv-heads {kv_heads}: need at least the source's {max_kv} KV heads and at least "
                f"{ratios[-1] if ratios else 1} query heads per KV head ({width // hd} heads in all)")
    if layers < src.n_layer:
        raise InvalidParameterError(
            f"--layers {layers} is fewer than the source's {src.n_layer} layers; a stand-in can only grow")
    if layers > 512:
        raise InvalidParameterError(f"--layers {layers} is more than llama.cpp's limit of 512")
    n_ff = ffn if ffn is not None else round(src.n_ff * width / src.n_embd)
    if n_ff < src.n_ff:
        raise InvalidParameterError(f"--ffn {n_ff} is smaller than the source's FFN width {src.n_ff}")
    block = _BLOCK[ftype]
    for what, n_src, n_new in (("hidden size", src.n_embd, width), ("FFN width", src.n_ff, n_ff)):
        if n_src % block or n_new % block:
            raise InvalidParameterError(
                f"{ftype} quantizes rows in blocks of {block}: the source {what} ({n_src}) and the stand-in's "
                f"({n_new}) must both be multiples of {block}, or the quantized stand-in would not match")
    n_head = width // hd

    def out_kv(j: int) -> int:  # KV heads of a stand-in attention layer holding source layer j
        return kv_heads if kv_heads is not None else n_head // (src.n_head // src.kv_heads(j))

    if lfm2:
        src_attn = [src.is_attention(j) for j in range(src.n_layer)]
        types, slots, q4_ok = lfm2_layer_layout(src_attn, layers, attn_layers)
        if ftype == "q4_k_m" and not q4_ok:
            raise InvalidParameterError(
                f"no layout of {layers} layers ({'--attn-layers ' + str(attn_layers) if attn_layers else 'the source mix'}) "
                f"gives every source layer its Q4_K_M tensor types (use_more_bits); try a layer count "
                f"or --attn-layers close to this one")
        pools = {t: [j for j in range(src.n_layer) if src_attn[j] == t] for t in (False, True)}
        used = {False: 0, True: 0}
        source, live = [], [False] * layers
        for i, t in enumerate(types):  # fillers cycle through the source layers of their type
            source.append(pools[t][used[t] % len(pools[t])])
            used[t] += 1
        for j, slot in enumerate(slots):
            source[slot], live[slot] = j, True
        layer_kv = tuple(out_kv(source[i]) if types[i] else 0 for i in range(layers))
        first_kv = next((k for k in layer_kv if k), 0)
        m = width // src.n_embd if width % src.n_embd == 0 else 1
    else:
        slots = live_layer_slots(src.n_layer, layers)
        q4_ok = [_use_more_bits(p, layers) for p in slots] == [_use_more_bits(j, src.n_layer) for j in range(src.n_layer)]
        source = [i % src.n_layer for i in range(layers)]
        live = [False] * layers
        for j, slot in enumerate(slots):
            source[slot], live[slot] = j, True
        layer_kv, first_kv = (), out_kv(0)
        m = residual_copies(src.n_embd, width)
    out = LlamaShape(n_embd=width, n_layer=layers, n_head=n_head, n_head_kv=first_kv, head_dim=hd,
                     n_ff=n_ff, n_vocab=src.n_vocab, tied_output=src.tied_output, n_expert=src.n_expert,
                     n_expert_used=src.n_expert_used, arch=src.arch, layer_kv=layer_kv, l_cache=src.l_cache)
    return StandinPlan(src=src, out=out, layer_source=tuple(source), layer_live=tuple(live),
                       copies=m, norm_scale=math.sqrt(m * src.n_embd / width), q4_types_match=q4_ok)


# ---------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------

def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_shape(reader) -> LlamaShape:
    """The shape of an open ``gguf.GGUFReader`` (llama or lfm2); raises for anything else."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"stand-ins need a llama-architecture or lfm2 model; this one is {arch!r}")

    def need(key: str) -> int:
        v = _field(reader, f"{arch}.{key}")
        if not isinstance(v, int):
            raise UnsupportedModelError(f"source lacks a single integer {arch}.{key} (got {v!r})")
        return v

    d, n_head, n_layer = need("embedding_length"), need("attention.head_count"), need("block_count")
    kv = _field(reader, f"{arch}.attention.head_count_kv")
    if arch == "lfm2":
        layer_kv = tuple(kv) if isinstance(kv, list) else (kv,) * n_layer if isinstance(kv, int) else None
        if layer_kv is None or len(layer_kv) != n_layer:
            raise UnsupportedModelError(f"source lacks {arch}.attention.head_count_kv for each of its {n_layer} layers")
        n_head_kv = next((k for k in layer_kv if k), 0)
        l_cache = need("shortconv.l_cache")
    else:
        if not isinstance(kv, int):
            raise UnsupportedModelError(f"source lacks a single integer {arch}.attention.head_count_kv (got {kv!r})")
        layer_kv, n_head_kv, l_cache = (), kv, 0
    head_dim = _field(reader, f"{arch}.attention.key_length") or d // n_head
    if head_dim * n_head != d or (_field(reader, f"{arch}.attention.value_length") or head_dim) != head_dim:
        raise UnsupportedModelError("stand-ins need head_dim x n_head == embedding_length")
    for k in layer_kv or (n_head_kv,):
        if k and n_head % k:
            raise UnsupportedModelError(f"n_head {n_head} is not a multiple of n_head_kv {k}")
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise UnsupportedModelError("source has no token_embd.weight")
    n_expert = _field(reader, f"{arch}.expert_count") or 0
    if n_expert and arch != "llama":
        raise UnsupportedModelError(f"stand-ins support mixture-of-experts llama models only, not {arch}")
    n_ff = (_field(reader, f"{arch}.expert_feed_forward_length") or need("feed_forward_length")) if n_expert \
        else need("feed_forward_length")
    return LlamaShape(n_embd=d, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, n_vocab=int(emb.shape[1]),
                      tied_output="output.weight" not in names, n_expert=n_expert,
                      n_expert_used=_field(reader, f"{arch}.expert_used_count") or 0,
                      arch=arch, layer_kv=layer_kv, l_cache=l_cache)


# ---------------------------------------------------------------------------------------------
# Padding one tensor (pure numpy; arrays are [rows = out features, cols = in features])
# ---------------------------------------------------------------------------------------------

def _pad2(a: np.ndarray, rows: int, cols: int, dtype: np.dtype, *, row_copies: int = 1,
          col_copies: int = 1) -> np.ndarray:
    """Zero-pad ``a`` to [rows, cols], repeating it ``row_copies`` times down / ``col_copies`` across."""
    out = np.zeros((rows, cols), dtype=dtype)
    r, c = a.shape
    for i in range(row_copies):
        for j in range(col_copies):
            out[i * r:(i + 1) * r, j * c:(j + 1) * c] = a
    return out


def _pad_norm(w: np.ndarray, plan: StandinPlan) -> np.ndarray:
    # Only the first copy is read: the matrices after a norm see the other copies as zeros.
    out = np.zeros(plan.out.n_embd, dtype=np.float32)
    out[: plan.src.n_embd] = (w.astype(np.float64) * plan.norm_scale).astype(np.float32)
    return out


def _head_slots(plan: StandinPlan, i: int, j: int) -> np.ndarray:
    """Stand-in query head of each source query head (stand-in layer i holds source layer j):
    head h of KV group g = h // r goes to slot g R + h % r, so it still reads KV head g."""
    r = plan.src.n_head // plan.src.kv_heads(j)
    big_r = plan.out.n_head // plan.out.kv_heads(i)
    h = np.arange(plan.src.n_head)
    return (h // r) * big_r + h % r


def _kind_shape(kind: str, plan: StandinPlan, i: int) -> tuple[tuple[int, ...], np.dtype]:
    """numpy shape and dtype of tensor ``kind`` of stand-in layer i."""
    o = plan.out
    q_dim, kv_dim = o.n_head * o.head_dim, o.kv_heads(i) * o.head_dim
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    if kind == "ffn_gate_inp":
        return (o.n_expert, o.n_embd), f32
    if kind.endswith("_exps"):
        inner, dtype = _kind_shape(kind[: -len("_exps")], plan, i)
        return (o.n_expert, *inner), dtype
    return {
        "attn_norm": ((o.n_embd,), f32), "ffn_norm": ((o.n_embd,), f32),
        "attn_q": ((q_dim, o.n_embd), f16), "attn_k": ((kv_dim, o.n_embd), f16),
        "attn_v": ((kv_dim, o.n_embd), f16), "attn_output": ((o.n_embd, q_dim), f16),
        "attn_q_norm": ((o.head_dim,), f32), "attn_k_norm": ((o.head_dim,), f32),
        "ffn_gate": ((o.n_ff, o.n_embd), f16), "ffn_up": ((o.n_ff, o.n_embd), f16),
        "ffn_down": ((o.n_embd, o.n_ff), f16),
        "shortconv.in_proj": ((3 * o.n_embd, o.n_embd), f16),
        "shortconv.conv": ((o.n_embd, o.l_cache), f32),  # ggml {l_cache, n_embd}; never quantized
        "shortconv.out_proj": ((o.n_embd, o.n_embd), f16),
    }[kind]


def _layer_tensor(kind: str, a: np.ndarray, plan: StandinPlan, i: int) -> np.ndarray:
    """Tensor ``kind`` of stand-in layer i, from ``a``, the same tensor of source layer
    ``plan.layer_source[i]``."""
    o, s, m = plan.out, plan.src, plan.copies
    d, hd = s.n_embd, s.head_dim
    j, live = plan.layer_source[i], plan.layer_live[i]
    shape, dtype = _kind_shape(kind, plan, i)
    if kind in ("attn_norm", "ffn_norm"):
        return _pad_norm(a, plan)
    if kind in ("attn_q_norm", "attn_k_norm"):  # per head over head_dim: unchanged
        return np.array(a, dtype=np.float32)
    if kind == "ffn_gate_inp":  # the router reads the norm output: its choice stays the source's
        return _pad2(a, o.n_expert, o.n_embd, np.dtype(np.float32))
    if kind.endswith("_exps"):
        base = kind[: -len("_exps")]
        return np.stack([_layer_tensor(base, e, plan, i) for e in a])
    if kind in _WRITES_RESIDUAL and not live:
        return np.zeros(shape, dtype=dtype)
    out = np.zeros(shape, dtype=dtype)
    if kind == "attn_q":
        for h, t in enumerate(_head_slots(plan, i, j)):
            out[t * hd:(t + 1) * hd, :d] = a[h * hd:(h + 1) * hd]
        return out
    if kind == "attn_output":
        for h, t in enumerate(_head_slots(plan, i, j)):
            for c in range(m):
                out[c * d:(c + 1) * d, t * hd:(t + 1) * hd] = a[:, h * hd:(h + 1) * hd]
        return out
    if kind == "shortconv.in_proj":  # chunks B, C, x: each d -> W on its own
        for k in range(3):
            out[k * o.n_embd:k * o.n_embd + d, :d] = a[k * d:(k + 1) * d]
        return out
    if kind == "shortconv.conv":  # extra channels get zero input, so their taps do not matter
        out[:d] = a
        return out
    return _pad2(a, *shape, dtype, row_copies=m if kind in _WRITES_RESIDUAL else 1)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _as_float(t) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q

    if t.tensor_type in (Q.F16, Q.F32):
        return np.asarray(t.data)
    if t.tensor_type == Q.BF16:
        from gguf.quants import dequantize

        return dequantize(t.data, t.tensor_type)
    raise UnsupportedModelError(
        f"tensor {t.name} is {t.tensor_type.name}; make stand-ins from an F32/F16/BF16 source and "
        f"quantize with --ftype instead")


def _layer_kind(name: str) -> tuple[int, str]:
    """"blk.3.shortconv.in_proj.weight" -> (3, "shortconv.in_proj")."""
    _, i, rest = name.split(".", 2)
    return int(i), rest.rsplit(".", 1)[0]


def _tensor_jobs(reader, plan: StandinPlan) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, make array) for every stand-in tensor, in llama.cpp's usual order."""
    o, s = plan.out, plan.src
    by_name = {t.name: t for t in reader.tensors}
    out_norm = f"{s.output_norm}.weight"
    known = {"token_embd.weight", out_norm, "output.weight", "rope_freqs.weight"}
    known |= {f"blk.{j}.{k}.weight" for j in range(s.n_layer) for k in s.layer_kinds(j)}
    unknown = sorted(set(by_name) - known)
    if unknown:
        raise UnsupportedModelError(
            f"source has tensors a plain {s.arch} stand-in cannot pad: {', '.join(unknown[:5])}")
    missing = sorted(known - set(by_name) - {"output.weight", "rope_freqs.weight"})
    if missing:
        raise UnsupportedModelError(f"source lacks tensors: {', '.join(missing[:5])}")
    f16 = np.dtype(np.float16)

    def mat(name: str, rows: int, cols: int, col_copies: int = 1):
        return lambda: _pad2(_as_float(by_name[name]), rows, cols, f16, col_copies=col_copies)

    # The embedding writes the residual (m copies); as the tied output it is read through the
    # output norm, which zeroes all but the first copy.
    yield "token_embd.weight", mat("token_embd.weight", o.n_vocab, o.n_embd, plan.copies)
    if s.arch == "lfm2":
        yield out_norm, lambda: _pad_norm(_as_float(by_name[out_norm]), plan)
    if "rope_freqs.weight" in by_name:
        yield "rope_freqs.weight", lambda: np.array(_as_float(by_name["rope_freqs.weight"]), dtype=np.float32)
    for i in range(o.n_layer):
        j = plan.layer_source[i]
        for kind in o.layer_kinds(i):
            src = by_name[f"blk.{j}.{kind}.weight"]
            yield (f"blk.{i}.{kind}.weight",
                   (lambda src=src, kind=kind, i=i: _layer_tensor(kind, _as_float(src), plan, i)))
    if s.arch != "lfm2":
        yield out_norm, lambda: _pad_norm(_as_float(by_name[out_norm]), plan)
    if not s.tied_output:
        yield "output.weight", mat("output.weight", o.n_vocab, o.n_embd)


def _shape_of(name: str, plan: StandinPlan) -> tuple[tuple[int, ...], np.dtype]:
    """numpy shape and dtype of a stand-in tensor, without building it."""
    o = plan.out
    if name in ("token_embd.weight", "output.weight"):
        return (o.n_vocab, o.n_embd), np.dtype(np.float16)
    if name == f"{o.output_norm}.weight":
        return (o.n_embd,), np.dtype(np.float32)
    if name == "rope_freqs.weight":
        return (o.head_dim // 2,), np.dtype(np.float32)
    i, kind = _layer_kind(name)
    return _kind_shape(kind, plan, i)


def _copy_metadata(reader, writer, plan: StandinPlan, eps: float) -> None:
    from gguf import GGUFValueType as V

    o, arch = plan.out, plan.src.arch
    updates = {
        f"{arch}.embedding_length": o.n_embd,
        f"{arch}.feed_forward_length": o.n_ff,
        f"{arch}.expert_feed_forward_length": o.n_ff,
        f"{arch}.attention.head_count": o.n_head,
        f"{arch}.attention.head_count_kv": list(o.layer_kv) if arch == "lfm2" else o.n_head_kv,
        f"{arch}.block_count": o.n_layer,
    }
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        if f.name in updates:
            val = updates[f.name]
            if isinstance(val, list) and vtype != V.ARRAY:
                vtype = V.ARRAY
            if vtype == V.ARRAY:  # lfm2's per-layer head_count_kv
                sub = f.types[-1] if len(f.types) > 1 else V.INT32
                writer.add_key_value(f.name, val if isinstance(val, list) else [val], V.ARRAY, sub_type=sub)
            else:
                writer.add_key_value(f.name, val, vtype)
        elif f.name == f"{arch}.attention.layer_norm_rms_epsilon":
            writer.add_key_value(f.name, eps, V.FLOAT32)
        elif f.name == "general.file_type":
            writer.add_key_value(f.name, 1, V.UINT32)  # LLAMA_FTYPE_MOSTLY_F16
        elif f.name == "general.name":
            writer.add_key_value(f.name, f"{f.contents()}-standin-w{o.n_embd}-l{o.n_layer}", V.STRING)
        elif vtype == V.ARRAY:
            sub = f.types[-1]
            # Raw bytes for strings: token pieces need not be valid UTF-8.
            val = [bytes(f.parts[i]) for i in f.data] if sub == V.STRING else f.contents()
            writer.add_key_value(f.name, val, V.ARRAY, sub_type=sub)
        elif vtype == V.STRING:
            writer.add_key_value(f.name, bytes(f.parts[-1]), V.STRING)
        else:
            writer.add_key_value(f.name, f.contents(), vtype)
    src_name = _field(reader, "general.name") or "?"
    writer.add_key_value("specstack.standin.source", str(src_name), V.STRING)
    writer.add_key_value("specstack.standin.residual_copies", plan.copies, V.UINT32)
    writer.add_key_value("specstack.standin.live_layers",
                         [i for i, live in enumerate(plan.layer_live) if live], V.ARRAY, sub_type=V.INT32)


def write_standin_f16(src: Path, out: Path, width: int, layers: int, *, ffn: int | None = None,
                      ftype_for_checks: str = "f16", progress: bool = True, kv_heads: int | None = None,
                      attn_layers: int | None = None) -> StandinPlan:
    """Write the F16 stand-in, one tensor at a time (peak memory: the largest tensor)."""
    import gguf

    from ..ui import Progress

    reader = _open(src)
    plan = plan_standin(read_shape(reader), width, layers, ffn, ftype_for_checks, kv_heads=kv_heads,
                        attn_layers=attn_layers)
    s, o = plan.src, plan.out
    eps_key = f"{s.arch}.attention.layer_norm_rms_epsilon"
    eps_src = _field(reader, eps_key)
    if not isinstance(eps_src, float):
        raise UnsupportedModelError(f"source lacks {eps_key}")
    eps = float(np.float32(eps_src) * np.float32(plan.copies * s.n_embd / o.n_embd))

    jobs = list(_tensor_jobs(reader, plan))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, s.arch)
    try:
        alignment = _field(reader, "general.alignment")
        if alignment:
            writer.data_alignment = int(alignment)
        _copy_metadata(reader, writer, plan, eps)
        for name, _ in jobs:
            shape, dtype = _shape_of(name, plan)
            writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        tick = Progress("make-standin", len(jobs), unit="tensors", quiet=not progress)
        for i, (name, make) in enumerate(jobs, 1):
            arr = make()
            expect = _shape_of(name, plan)
            assert arr.shape == expect[0] and arr.dtype == expect[1], (name, arr.shape, arr.dtype, expect)
            writer.write_tensor_data(arr)
            tick.update(i, note=name)
        tick.close()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return plan


def _open(path: Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"source model {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/struct errors on non-GGUF input
        raise ModelLoadError(f"cannot read {path} as GGUF: {exc}") from exc


def read_source_shape(path: Path) -> LlamaShape:
    """The shape of the GGUF at ``path`` (ModelLoadError when it is missing or not a GGUF)."""
    return read_shape(_open(path))


def quantize_gguf(src: Path, out: Path, ftype: str, *, threads: int = 2, verbose: bool = False) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``, via target.py)."""
    from ..target import quantize

    if ftype not in ("q8_0", "q4_k_m"):
        raise InvalidParameterError(f"cannot quantize to {ftype!r}; choose one of q8_0, q4_k_m")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("llama-cpp-python")  # llama-cpp-python's log callback filters on it
    old_level = log.level
    log.setLevel(logging.DEBUG if verbose else logging.ERROR)
    try:
        rc = quantize(src, out, ftype, threads=threads)
    finally:
        log.setLevel(old_level)
    if rc != 0:
        raise StandinError(f"llama.cpp failed to quantize {src} to {ftype} (return code {rc})")
    return out


def make_standin(src: Path, out: Path, width: int, layers: int, ftype: str = "f16", *,
                 ffn: int | None = None, threads: int = 2, progress: bool = True,
                 kv_heads: int | None = None, attn_layers: int | None = None) -> Path:
    """Write a stand-in of ``src`` with hidden size ``width`` and ``layers`` layers to ``out``.

    The FFN grows in proportion to ``width`` unless ``ffn`` is given. ``ftype`` "f16" writes the
    padded model directly; "q8_0" and "q4_k_m" write it to a temporary F16 file next to ``out``
    and quantize that with llama.cpp. ``kv_heads`` and ``attn_layers`` (LFM2) are as in
    ``plan_standin``. Returns ``out``.
    """
    out = Path(out)
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    kw = {"ffn": ffn, "progress": progress, "kv_heads": kv_heads, "attn_layers": attn_layers}
    if ftype == "f16":
        write_standin_f16(Path(src), out, width, layers, **kw)
        return out
    tmp = out.with_name(out.name + ".f16.partial")
    try:
        write_standin_f16(Path(src), tmp, width, layers, ftype_for_checks=ftype, **kw)
        if progress:
            print(f"make-standin: quantizing to {ftype} with llama.cpp", file=sys.stderr, flush=True)
        quantize_gguf(tmp, out, ftype, threads=threads)
    finally:
        tmp.unlink(missing_ok=True)
    return out
