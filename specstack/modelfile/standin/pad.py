"""Padding one tensor of the stand-in from the source's (pure numpy).

Arrays are [rows = out features, cols = in features]. One function per job: the shape a tensor
kind has in the stand-in (``kind_shape``) and how the source's values fill it (``layer_tensor``)
for every kind: llama and LFM2 attention, the dense FFN, MoE routers and stacked experts (padded
expert by expert), and LFM2's short convolution. The package docstring says why each padding
leaves the source's function unchanged.
"""

from __future__ import annotations

import numpy as np

from .shape import StandinPlan

# Matrices that write the residual stream: rows repeated m times; zero in filler layers.
_WRITES_RESIDUAL = ("attn_output", "ffn_down", "shortconv.out_proj")


def pad2(a: np.ndarray, rows: int, cols: int, dtype: np.dtype, *, row_copies: int = 1,
          col_copies: int = 1) -> np.ndarray:
    """Zero-pad ``a`` to [rows, cols], repeating it ``row_copies`` times down / ``col_copies`` across."""
    out = np.zeros((rows, cols), dtype=dtype)
    r, c = a.shape
    for i in range(row_copies):
        for j in range(col_copies):
            out[i * r:(i + 1) * r, j * c:(j + 1) * c] = a
    return out


def pad_norm(w: np.ndarray, plan: StandinPlan) -> np.ndarray:
    """RMSNorm weight times c on the first residual copy, zero elsewhere: only the first copy is
    read, so the matrices after a norm see the other copies as zeros."""
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


def kind_shape(kind: str, plan: StandinPlan, i: int) -> tuple[tuple[int, ...], np.dtype]:
    """numpy shape and dtype of tensor ``kind`` of stand-in layer i."""
    o = plan.out
    q_dim, kv_dim = o.n_head * o.head_dim, o.kv_heads(i) * o.head_dim
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    if kind == "ffn_gate_inp":
        return (o.n_expert, o.n_embd), f32
    if kind.endswith("_exps"):
        inner, dtype = kind_shape(kind[: -len("_exps")], plan, i)
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


def layer_tensor(kind: str, a: np.ndarray, plan: StandinPlan, i: int) -> np.ndarray:
    """Tensor ``kind`` of stand-in layer i, from ``a``, the same tensor of source layer
    ``plan.layer_source[i]``."""
    o, s, m = plan.out, plan.src, plan.copies
    d, hd = s.n_embd, s.head_dim
    j, live = plan.layer_source[i], plan.layer_live[i]
    shape, dtype = kind_shape(kind, plan, i)
    if kind in ("attn_norm", "ffn_norm"):
        return pad_norm(a, plan)
    if kind in ("attn_q_norm", "attn_k_norm"):  # per head over head_dim: unchanged
        return np.array(a, dtype=np.float32)
    if kind == "ffn_gate_inp":  # the router reads the norm output: its choice stays the source's
        return pad2(a, o.n_expert, o.n_embd, np.dtype(np.float32))
    if kind.endswith("_exps"):
        base = kind[: -len("_exps")]
        return np.stack([layer_tensor(base, e, plan, i) for e in a])
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
    return pad2(a, *shape, dtype, row_copies=m if kind in _WRITES_RESIDUAL else 1)
