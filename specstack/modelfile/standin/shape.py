"""The shapes a stand-in is planned from and to: ``LlamaShape`` and ``StandinPlan``.

Pure data, shared by every other module of the package; the package docstring argues why a
plan's stand-in computes the source's function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ...errors import SpecstackError

FTYPES = ("f16", "q8_0", "q4_k_m")
ARCHS = ("llama", "lfm2", "gemma3")

# Tensor kinds per layer ("blk.{i}.{kind}.weight"), in llama.cpp's order.
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
# Gemma 3: per-head q/k norms and sandwich norms after attention and after the FFN.
_GEMMA3 = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
           "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


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
    # A quantized source (gemma3 only): its ftype name ("q4_k_m", "q8_0", or "file type N"), and the
    # largest quant block length of the tensors whose rows are n_embd / n_head x head_dim / n_ff long.
    quantized: str | None = None
    row_blocks: tuple[int, int, int] = (1, 1, 1)

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
        if self.arch == "gemma3":
            return _GEMMA3
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
                mix = d * hd * (2 * self.n_head + 2 * self.kv_heads(i)) + (2 * hd if self.arch != "llama" else 0)
            else:
                mix = 4 * d * d + self.l_cache * d  # in_proj (3 d x d), out_proj, conv taps
            total += mix + ffn + (4 if self.arch == "gemma3" else 2) * d
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
    # Q4_K_M gives every source layer the same tensor types in the stand-in (see llama.live_layer_slots).
    q4_types_match: bool = True

    @property
    def bit_exact(self) -> bool:
        """True when c is a power of two, so the rescaled norms round exactly like the source's.

        LFM2's q/k norms share the residual norms' epsilon but act on unscaled values: only
        c = 1 (epsilon unchanged) is exact there; so it is for Gemma 3, whose embedding scale
        sqrt(n_embd) changes with the width too (``gemma3``). A changed GQA group size (``kv_heads``) is
        exact in F16 (see ``exact_for``). A cut vocabulary (``--vocab``) is never exact."""
        if self.out.n_vocab != self.src.n_vocab:  # --vocab: a different function (the ``vocab`` module)
            return False
        if self.src.arch in ("lfm2", "gemma3"):  # gemma3: see the gemma3 module
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
        logits bit for bit (what the package docstring argues; the tests measure it)."""
        if not self.bit_exact:
            return False
        if self.src.arch == "gemma3":  # a quantized source's blocks are copied; head_dim fills whole blocks
            return True
        if ftype == "q4_k_m":
            return self.q4_types_match and not self.regrouped_heads
        if ftype == "q8_0":
            return not self.regrouped_heads or self.src.head_dim % 32 == 0
        return True


class LayerLayout(NamedTuple):
    """Where the source layers sit in the stand-in; ``plan_standin`` turns it into a ``StandinPlan``."""

    source: tuple[int, ...]  # the source layer each stand-in layer holds
    live: tuple[bool, ...]  # True: the real layer; False: a zero-output copy
    q4_types_match: bool  # Q4_K_M gives every source layer its source tensor types
    attention: tuple[bool, ...] = ()  # lfm2 only: each layer's type (True: attention)
