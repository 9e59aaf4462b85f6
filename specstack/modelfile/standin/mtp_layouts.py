"""The real models an MTP stand-in imitates, and the reduced shape a request asks for (pure, no I/O).

A layout is a real model's hyper-parameters as its Hugging Face config gives them (so the stand-in's
per-layer cost is that model's); ``mtp_shape`` cuts it to ``--layers`` trunk layers and, when asked,
narrows it (``--width``) or gives it fewer experts (``--experts``). The NextN (MTP) block is always
one extra block after the trunk, as in the single-head models llama.cpp drafts from with ``draft-mtp``; step35
has ``n_nextn`` of them (chained heads, one per draft position; ``mtp_shape``'s ``nextn`` picks fewer).

Narrowing keeps the head sizes (attention and gated-delta-net alike: the family's smaller members keep
them too, and llama.cpp's shapes stay valid) and scales the head *counts* and FFN widths by
width / real width, keeping each model's grouping (query heads per KV head, value heads per key head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import InvalidParameterError

BLOCK = 32  # FFN widths are rounded up to whole Q8_0 blocks so that every ftype can hold them


@dataclass(frozen=True)
class MtpLayout:
    """One real model's shape. ``arch`` is llama.cpp's architecture name; FFN widths of 0 are absent."""

    name: str
    arch: str
    model: str  # the real model this layout copies, for messages and docs
    n_embd: int
    n_layer: int  # the real trunk depth (the NextN block comes on top)
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dims: int  # rotary dimensions per head (partial rotary)
    rope_base: float
    n_ctx: int
    eps: float
    n_ff: int = 0  # dense FFN (qwen35 everywhere; glm4moe's leading dense layers)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # the shared expert's width (glm4moe: n_ff_exp x n_expert_shared)
    n_expert_shared: int = 0
    n_dense_lead: int = 0  # glm4moe: leading dense layers before the MoE ones
    # gated delta net (qwen35*): every full_attn_interval-th layer is full attention, the rest recurrent
    full_attn_interval: int = 0
    ssm_conv: int = 0
    ssm_head_dim: int = 0  # key and value head size (llama.cpp needs them equal)
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    attn_bias: bool = False
    n_nextn: int = 1  # NextN blocks after the trunk (step35: 3 chained heads)
    nextn_dense: bool = False  # the NextN blocks have a dense FFN even where the trunk is MoE (step35)
    # sliding-window attention (step35): every swa_period-th layer (from 0) is full attention, the others
    # sliding with n_head_swa query heads and all rotary dims (full layers rotate half, llama.cpp's n_rot_full / 2)
    swa_period: int = 0
    n_swa: int = 0
    n_head_swa: int = 0
    rope_base_swa: float = 0.0

    @property
    def hybrid(self) -> bool:
        """Gated-delta-net layers between full-attention ones (qwen35, qwen35moe)."""
        return self.full_attn_interval > 0

    @property
    def moe(self) -> bool:
        return self.n_expert > 0


LAYOUTS: dict[str, MtpLayout] = {
    # Qwen3.5-35B-A3B / Qwen3.6-35B-A3B: 40 layers (30 gated delta net + 10 full attention), 256 experts, 8 routed +
    # 1 shared, one MTP block (the "30B-A3B class" of the issue: Qwen3.5's ~3B-active MoE).
    "qwen35moe": MtpLayout(
        name="qwen35moe", arch="qwen35moe", model="Qwen3.5-35B-A3B", n_embd=2048, n_layer=40, n_head=16,
        n_head_kv=2, head_dim=256, rope_dims=64, rope_base=10_000_000.0, n_ctx=262_144, eps=1e-6,
        n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, full_attn_interval=4, ssm_conv=4,
        ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=32),
    # Qwen3.5-9B: dense SwiGLU FFN, same hybrid attention, one MTP block.
    "qwen35": MtpLayout(
        name="qwen35", arch="qwen35", model="Qwen3.5-9B", n_embd=4096, n_layer=32, n_head=16, n_head_kv=4,
        head_dim=256, rope_dims=64, rope_base=10_000_000.0, n_ctx=262_144, eps=1e-6, n_ff=12288,
        full_attn_interval=4, ssm_conv=4, ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=32),
    # GLM-4.5-Air: 46 layers (the first dense), 128 experts, 8 routed + 1 shared, q/k/v biases, one MTP block.
    "glm4moe": MtpLayout(
        name="glm4moe", arch="glm4moe", model="GLM-4.5-Air", n_embd=4096, n_layer=46, n_head=96, n_head_kv=8,
        head_dim=128, rope_dims=64, rope_base=1_000_000.0, n_ctx=131_072, eps=1e-5, n_ff=10944, n_expert=128,
        n_expert_used=8, n_ff_exp=1408, n_ff_shexp=1408, n_expert_shared=1, n_dense_lead=1, attn_bias=True),
    # Step-3.5-Flash (196B-A11B): 45 layers (3 leading dense, then 288 experts, 8 routed + 1 shared), full attention
    # on every 4th layer and 512-token sliding windows between (96 query heads there, 64 on full layers, 8 KV
    # heads), head-wise attention gates, and 3 NextN blocks (dense, full attention) drafted as chained heads.
    "step35": MtpLayout(
        name="step35", arch="step35", model="Step-3.5-Flash", n_embd=4096, n_layer=45, n_head=64, n_head_kv=8,
        head_dim=128, rope_dims=128, rope_base=5_000_000.0, n_ctx=262_144, eps=1e-5, n_ff=11264, n_expert=288,
        n_expert_used=8, n_ff_exp=1280, n_ff_shexp=1280, n_dense_lead=3, n_nextn=3, nextn_dense=True,
        swa_period=4, n_swa=512, n_head_swa=96, rope_base_swa=10_000.0),
}


@dataclass(frozen=True)
class MtpShape:
    """A stand-in's concrete shape: ``layout`` reduced to ``n_layer`` trunk layers (plus ``n_nextn`` NextN blocks)."""

    layout: MtpLayout
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    ssm_k_heads: int
    ssm_v_heads: int
    n_nextn: int = 1
    n_head_swa: int = 0

    @property
    def arch(self) -> str:
        return self.layout.arch

    @property
    def n_block(self) -> int:
        """Trunk layers plus the NextN blocks (``<arch>.block_count``)."""
        return self.n_layer + self.n_nextn

    def is_swa(self, il: int) -> bool:
        """step35's pattern: sliding-window attention but on every ``swa_period``-th trunk layer (NextN: full)."""
        k = self.layout.swa_period
        return bool(k) and il < self.n_layer and il % k != 0

    def heads(self, il: int) -> int:
        """Query heads of layer ``il`` (sliding-window layers have their own count in step35)."""
        return self.n_head_swa if self.is_swa(il) else self.n_head

    def is_recurrent(self, il: int) -> bool:
        """llama.cpp's default layer pattern (qwen35*.cpp): recurrent unless (il + 1) % interval == 0."""
        k = self.layout.full_attn_interval
        return bool(k) and il < self.n_layer and (il + 1) % k != 0

    def is_moe(self, il: int) -> bool:
        if il >= self.n_layer and self.layout.nextn_dense:
            return False
        return self.layout.moe and il >= self.layout.n_dense_lead

    def describe(self) -> str:
        """One line: depth, width, heads, FFN and experts, for the CLI's report."""
        lay = self.layout
        parts = [f"{self.n_layer} layers + {self.n_nextn} NextN", f"width {self.n_embd}",
                 f"{self.n_head} heads ({self.n_head_kv} KV) x {lay.head_dim}"]
        if lay.hybrid:
            n_attn = sum(not self.is_recurrent(i) for i in range(self.n_layer))
            parts.append(f"{self.n_layer - n_attn} gated-delta-net + {n_attn} attention layers "
                         f"({self.ssm_k_heads}/{self.ssm_v_heads} k/v heads x {lay.ssm_head_dim})")
        if self.n_expert:
            parts.append(f"{self.n_expert} experts ({self.n_expert_used} used) x FFN {self.n_ff_exp}, shared {self.n_ff_shexp}")
        if self.n_ff:
            parts.append(f"dense FFN {self.n_ff}")
        return ", ".join(parts)


def _scaled(n: int, s: float, unit: int = 1) -> int:
    """``n`` x ``s``, at least one ``unit`` and a whole number of them."""
    return max(unit, unit * round(n * s / unit))


def _ffn(n: int, s: float) -> int:
    """An FFN width scaled by ``s``, rounded up to a whole quant block (0 stays 0)."""
    return 0 if n == 0 else max(BLOCK, -(-round(n * s) // BLOCK) * BLOCK)


def mtp_shape(name: str, layers: int, width: int | None = None, experts: int | None = None,
              nextn: int | None = None) -> MtpShape:
    """The shape of layout ``name`` with ``layers`` trunk layers, narrowed to ``width``, given ``experts``
    experts and ``nextn`` NextN blocks when those are set; InvalidParameterError names what is wrong (and the
    layouts there are)."""
    lay = LAYOUTS.get(name)
    if lay is None:
        raise InvalidParameterError(f"unknown MTP layout {name!r}; choose one of {', '.join(LAYOUTS)}")
    if layers < 1:
        raise InvalidParameterError(f"--layers must be >= 1 (got {layers})")
    if lay.hybrid and layers < lay.full_attn_interval:
        raise InvalidParameterError(
            f"{name} puts full attention on every {lay.full_attn_interval}th layer: --layers must be >= "
            f"{lay.full_attn_interval} so that the trunk has one (got {layers})")
    w = lay.n_embd if width is None else width
    if w < BLOCK or w % BLOCK:
        raise InvalidParameterError(f"--width must be a positive multiple of {BLOCK} (got {w})")
    s = w / lay.n_embd
    kv = _scaled(lay.n_head_kv, s)
    n_ff_exp = _ffn(lay.n_ff_exp, s)
    # glm4moe's loader derives the shared expert's width: n_ff_exp x n_expert_shared
    n_ff_shexp = n_ff_exp * lay.n_expert_shared if lay.n_expert_shared else _ffn(lay.n_ff_shexp, s)
    k_heads = _scaled(lay.ssm_k_heads, s) if lay.hybrid else 0
    shape = MtpShape(
        layout=lay, n_layer=layers, n_embd=w, n_head=kv * (lay.n_head // lay.n_head_kv), n_head_kv=kv,
        n_ff=_ffn(lay.n_ff, s), n_expert=lay.n_expert, n_expert_used=lay.n_expert_used,
        n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
        ssm_k_heads=k_heads, ssm_v_heads=k_heads * (lay.ssm_v_heads // lay.ssm_k_heads) if lay.hybrid else 0,
        n_nextn=lay.n_nextn, n_head_swa=kv * (lay.n_head_swa // lay.n_head_kv) if lay.n_head_swa else 0)
    if nextn is not None:
        if not 1 <= nextn <= lay.n_nextn:
            raise InvalidParameterError(f"--nextn must be in 1..{lay.n_nextn} for {name} (got {nextn})")
        shape = replace(shape, n_nextn=nextn)
    if experts is not None:
        if not lay.moe:
            raise InvalidParameterError(f"--experts: {name} ({lay.model}) is dense; its layouts with experts are "
                                        f"{', '.join(n for n, x in LAYOUTS.items() if x.moe)}")
        if experts < 1:
            raise InvalidParameterError(f"--experts must be >= 1 (got {experts})")
        shape = replace(shape, n_expert=experts, n_expert_used=min(lay.n_expert_used, experts))
    return shape
