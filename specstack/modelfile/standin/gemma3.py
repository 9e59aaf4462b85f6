"""Gemma 3 stand-ins (llama.cpp ``src/models/gemma3.cpp``): planning checks, layout and padding.

Gemma 3 differs from llama in ways that each need their own padding (d = source width, W = the
stand-in's, m residual copies, beta = sqrt(W / (m d)), c = 1 / beta):

- The embedding is multiplied by sqrt(n_embd) inside llama.cpp, so widening the model scales the
  residual stream by sqrt(W / d). The stand-in's residual holds m copies of the source's, times
  beta: the embedding columns are repeated m times and divided by sqrt(m), where m is the largest
  power of 4 with m d <= W (so dividing is exact: a power of two, applied to F16 values or to the
  f16 scales of quant blocks).
- One epsilon serves the residual norms and the per-head q/k norms (over head_dim, which stays the
  source's). The stand-in's is epsilon c^2 (= epsilon when beta = 1). A pre-norm (attn_norm,
  ffn_norm, output_norm) over W of the residual sees mean_W = beta^2 m d / W mean_d = mean_d
  and returns beta times the source's normalised vector (its epsilon c^2 instead of epsilon is
  negligible against the residual's large mean square), so its weight is multiplied by c (first
  copy only; the other copies and the zero tail are read as zeros).
- The sandwich post-norms (post_attention_norm, post_ffw_norm) normalise what attention / the FFN
  write, which attn_output / ffn_down hold m times (rows repeated): mean_W = c^2 mean_d, and
  with epsilon c^2 the rms is exactly c times the source's. Their weight stays the source's,
  repeated m times, so they write beta times the source's output, as the residual needs. (These
  inputs can be tiny, e.g. an FFN output with mean square 1e-5 against epsilon 1e-6 in Gemma 3
  270M: keeping epsilon unscaled there moved the logits by up to 1.6.)
- The tied output (``token_embd``, divided by sqrt(m)) reads the output norm, whose weight is also
  multiplied by sqrt(m), a power of two, so the logits are the source's.
- head_dim stays (the q/k norms act per head); heads are added with zero attn_q rows and zero
  attn_output columns, KV heads in the source's grouping (``--kv-heads`` regroups as for llama).
- Extra layers go after the source's, so every source layer keeps its index, hence its
  sliding-window role and rope base; they copy a source layer with zero attn_output and ffn_down:
  attention and FFN write zeros, the post-norms of zero are zero, and they add exactly nothing.

So the stand-in is bit-exact when beta = 1 (W / d a power of 4: 1, 4, 16, ..). Otherwise (e.g.
Gemma 3 1B's width 1152 from 270M's 640) the q/k norms and the pre-norms see epsilon c^2 instead
of epsilon, the pre-norm weights carry one F32 rounding and the embedding scale rounds
differently: close (270M to 1152: logits within ~0.1 of the source's), not bit-exact.

Quantized sources (gemma3 only): an F16 stand-in dequantizes the source (it then equals the source
dequantized to F16, not the quantized source). A stand-in in the source's own ftype copies the
source's quant blocks byte for byte and pads with all-zero blocks (which decode to zeros), so it
holds exactly the source's weights in exactly the source's tensor types: no requantization, and
no layer-index rules of llama.cpp's quantizer to respect. Its wider rows must fill whole blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ...errors import InvalidParameterError, UnsupportedModelError
from .llama import place_source_layers
from .shape import LayerLayout, LlamaShape, StandinPlan

if TYPE_CHECKING:
    from gguf import GGUFReader

PRE_NORMS = ("attn_norm", "ffn_norm")
POST_NORMS = ("post_attention_norm", "post_ffw_norm")
# Byte offsets of the f16 scale fields of a quant block (all of them scale every value of the block).
_SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
                  "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}


def gemma3_residual_copies(d: int, width: int) -> int:
    """m: the largest power of 4 with m d <= width (dividing the embedding by sqrt(m) is exact)."""
    m = 1
    while 4 * m * d <= width:
        m *= 4
    return m


def attention_scale(shape: LlamaShape) -> float:
    """llama.cpp's gemma3 query scale: 1/sqrt(head_dim), but 1/sqrt(n_embd / n_head) for the
    62-layer (27B) type, which it recognises by the layer count alone."""
    if shape.n_layer == 62:
        return 1.0 / math.sqrt(float(shape.n_embd // shape.n_head))
    return 1.0 / math.sqrt(float(shape.head_dim))


def gemma3_heads(src: LlamaShape, heads: int | None, kv_heads: int | None) -> tuple[int, int]:
    """The stand-in's query and KV heads: the source's count unless ``heads`` (Gemma's n_head x
    head_dim need not equal its width); KV heads keep the source's grouping unless ``kv_heads``."""
    r = src.n_head // src.n_head_kv
    n_head = src.n_head if heads is None else heads
    if n_head < src.n_head:
        raise InvalidParameterError(f"--heads {n_head} is fewer than the source's {src.n_head}; a stand-in can only grow")
    if kv_heads is None:
        if n_head % r:
            raise InvalidParameterError(f"--heads {n_head} must be a multiple of the source's {r} query heads per KV head")
        return n_head, n_head // r
    if n_head % kv_heads or kv_heads < src.n_head_kv or n_head // kv_heads < r:
        raise InvalidParameterError(
            f"--kv-heads {kv_heads}: need a divisor of the {n_head} query heads, at least the source's "
            f"{src.n_head_kv} KV heads and at least {r} query heads per KV head")
    return n_head, kv_heads


def check_gemma3(src: LlamaShape, out: LlamaShape, ftype: str) -> None:
    """Refuse what a gemma3 stand-in cannot keep exact: a changed attention scale, quant blocks
    that the wider rows would not fill, an ftype a quantized source's blocks cannot give."""
    if attention_scale(out) != attention_scale(src):
        raise InvalidParameterError(
            f"--layers {out.n_layer}: llama.cpp gives a {out.n_layer}-layer gemma3 another query scale "
            f"({attention_scale(out):.4g} instead of the source's {attention_scale(src):.4g}); pick another layer count")
    if src.quantized is None:
        if ftype == "q4_k_m":
            raise InvalidParameterError(
                "gemma3 from a float source: --ftype f16 or q8_0 (q4_k_m: quantize the source with llama.cpp "
                "first; a stand-in of a Q4_K_M source then keeps its quant blocks)")
        return
    if ftype == "f16":
        return  # dequantized
    if ftype != src.quantized:
        raise InvalidParameterError(
            f"the source is quantized ({src.quantized}): a stand-in either keeps its quant blocks "
            f"(--ftype {src.quantized}) or dequantizes it (--ftype f16); requantizing would change its weights")
    b_embd, b_q, b_ff = src.row_blocks
    q_dim = out.n_head * out.head_dim
    regrouped = out.n_head // out.n_head_kv != src.n_head // src.n_head_kv  # source heads move
    for what, n, block in (("--width", out.n_embd, b_embd), ("n_head x head_dim", q_dim, b_q),
                           ("--ffn", out.n_ff, b_ff), ("head_dim (--kv-heads moves heads)", out.head_dim,
                                                       b_q if regrouped else 1)):
        if n % block:
            raise InvalidParameterError(
                f"{what} {n} must be a multiple of {block}: the stand-in copies the source's {src.quantized} quant "
                f"blocks, and its wider rows must hold whole blocks of {block} (the source's tensor types)")
    if src.n_embd % b_embd:
        raise UnsupportedModelError(f"the source's width {src.n_embd} does not fill whole blocks of {b_embd}")


def gemma3_layout(n_src: int, n_out: int) -> LayerLayout:
    """Source layers first, at their own indices (sliding-window role and rope base unchanged);
    filler i copies source layer i mod n_src."""
    source, live = place_source_layers([i % n_src for i in range(n_out)], list(range(n_src)))
    return LayerLayout(source, live, True)


# ----------------------------------------------------------------------------- tensors


def _zeros_like_rows(a: np.ndarray, rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
    return np.zeros((rows, cols, *a.shape[2:]), dtype=dtype)


def _scale_pow2(a: np.ndarray, qtype: str, k: int) -> tuple[np.ndarray, int]:
    """``a`` (floats, or quant blocks of type ``qtype``) divided by 2^k; the count of values that
    did not divide exactly (f16 subnormals)."""
    if k == 0:
        return a, 0
    if qtype in ("F32", "F16", "BF16"):
        out = (a.astype(np.float32) * np.float32(2.0 ** -k)).astype(a.dtype)
        return out, int(np.count_nonzero(out.astype(np.float32) * np.float32(2.0 ** k) != a.astype(np.float32)))
    offsets = _SCALE_OFFSETS.get(qtype)
    if offsets is None:
        raise UnsupportedModelError(f"cannot rescale {qtype} blocks (token_embd); choose a width below 4x the source's")
    out, bad = a.copy(), 0
    for off in offsets:
        f = np.ascontiguousarray(out[..., off:off + 2]).view(np.float16).astype(np.float32)
        g = (f * np.float32(2.0 ** -k)).astype(np.float16)
        bad += int(np.count_nonzero(g.astype(np.float32) * np.float32(2.0 ** k) != f))
        out[..., off:off + 2] = g.view(np.uint8)
    return out, bad


class Gemma3Tensors:
    """Builds each gemma3 stand-in tensor from the source's: floats (F16 matrices, F32 norms) or, with
    ``keep``, the source's quant blocks. ``jobs`` lists (name, (shape, dtype, raw type), make)."""

    def __init__(self, reader: GGUFReader, plan: StandinPlan, keep: bool, tokens: np.ndarray | None = None):
        self.by_name = {t.name: t for t in reader.tensors}
        self.plan, self.keep = plan, keep
        self.tokens = tokens  # the source rows of a cut vocabulary (``vocab.kept_tokens``), None: all
        self.inexact_scales = 0  # embedding values the power-of-two rescale could not keep

    def _load(self, name: str) -> tuple[np.ndarray, int, str]:
        """Source tensor ``name``: its array, the elements per column unit (1, or the quant block
        length with ``keep``), and its type name."""
        from .source import as_blocks, as_float

        t = self.by_name[name]
        qtype = t.tensor_type.name
        if self.keep and qtype not in ("F32", "F16", "BF16") and t.data.ndim == 2:
            a, unit = as_blocks(t)
            return a, unit, qtype
        return np.asarray(as_float(t, dequantize=True)), 1, qtype

    def info(self, name: str) -> tuple[tuple[int, ...], np.dtype, object]:
        """numpy shape, dtype and raw GGML type (None: plain F16/F32) of stand-in tensor ``name``."""
        from gguf.constants import GGML_QUANT_SIZES

        o = self.plan.out
        src_name = self._source_name(name)
        t = self.by_name[src_name]
        kind = src_name.rsplit(".", 2)[-2] if src_name.startswith("blk.") else src_name[: -len(".weight")]
        if t.data.ndim == 1 or kind in PRE_NORMS + POST_NORMS + ("attn_q_norm", "attn_k_norm", "output_norm"):
            n = o.head_dim if kind in ("attn_q_norm", "attn_k_norm") else o.n_embd
            return (n,), np.dtype(np.float32), None
        rows, cols = self._matrix_shape(kind)
        qtype = t.tensor_type.name
        if self.keep and qtype not in ("F32", "F16", "BF16"):
            block, nbytes = GGML_QUANT_SIZES[t.tensor_type]
            return (rows, cols // block * nbytes), np.dtype(np.uint8), t.tensor_type
        return (rows, cols), np.dtype(np.float16), None

    def _source_name(self, name: str) -> str:
        if not name.startswith("blk."):
            return name
        _, i, rest = name.split(".", 2)
        return f"blk.{self.plan.layer_source[int(i)]}.{rest}"

    def _matrix_shape(self, kind: str) -> tuple[int, int]:
        o = self.plan.out
        q_dim, kv_dim = o.n_head * o.head_dim, o.n_head_kv * o.head_dim
        return {"token_embd": (o.n_vocab, o.n_embd), "output": (o.n_vocab, o.n_embd),
                "attn_q": (q_dim, o.n_embd), "attn_k": (kv_dim, o.n_embd), "attn_v": (kv_dim, o.n_embd),
                "attn_output": (o.n_embd, q_dim), "ffn_gate": (o.n_ff, o.n_embd), "ffn_up": (o.n_ff, o.n_embd),
                "ffn_down": (o.n_embd, o.n_ff)}[kind]

    def jobs(self) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
        """(name, build its array) for every stand-in tensor, in llama.cpp's usual order."""
        o, s = self.plan.out, self.plan.src
        known = {"token_embd.weight", "output_norm.weight", "output.weight"}
        known |= {f"blk.{j}.{k}.weight" for j in range(s.n_layer) for k in s.layer_kinds(j)}
        unknown = sorted(set(self.by_name) - known)
        if unknown:
            raise UnsupportedModelError(f"source has tensors a gemma3 stand-in cannot pad: {', '.join(unknown[:5])}")
        missing = sorted(known - set(self.by_name) - {"output.weight"})
        if missing:
            raise UnsupportedModelError(f"source lacks tensors: {', '.join(missing[:5])}")
        yield "token_embd.weight", self._embedding
        for i in range(o.n_layer):
            for kind in o.layer_kinds(i):
                yield f"blk.{i}.{kind}.weight", (lambda kind=kind, i=i: self._layer(kind, i))
        yield "output_norm.weight", self._output_norm
        if not s.tied_output:
            yield "output.weight", self._output

    def _finish(self, name: str, out: np.ndarray) -> np.ndarray:
        """Quant blocks [rows, blocks, bytes] as the [rows, bytes] array the writer expects."""
        shape, dtype, _ = self.info(name)
        return out.reshape(shape).astype(dtype, copy=False)

    def _embedding(self) -> np.ndarray:
        p = self.plan
        a, unit, qtype = self._load("token_embd.weight")
        a = self._rows(a)
        a, bad = _scale_pow2(a, qtype if unit > 1 else "F32", int(math.log2(math.isqrt(p.copies))))
        self.inexact_scales += bad
        du = p.src.n_embd // unit
        out = _zeros_like_rows(a, p.out.n_vocab, p.out.n_embd // unit, a.dtype if unit > 1 else np.float16)
        for c in range(p.copies):
            out[:, c * du:(c + 1) * du] = a
        return self._finish("token_embd.weight", out)

    def _rows(self, a: np.ndarray) -> np.ndarray:
        """The vocabulary rows the stand-in keeps (a row of quant blocks moves whole)."""
        return a if self.tokens is None else a[self.tokens]

    def _norm(self, w: np.ndarray, scale: float, copies: int) -> np.ndarray:
        d = self.plan.src.n_embd
        out = np.zeros(self.plan.out.n_embd, dtype=np.float32)
        v = (w.astype(np.float64) * scale).astype(np.float32)
        for c in range(copies):
            out[c * d:(c + 1) * d] = v
        return out

    def _output_norm(self) -> np.ndarray:
        p = self.plan
        w = self._load("output_norm.weight")[0]
        # The tied output holds the embedding divided by sqrt(m): the norm gives that factor back.
        return self._norm(w, p.norm_scale * (math.isqrt(p.copies) if p.src.tied_output else 1), 1)

    def _output(self) -> np.ndarray:
        p = self.plan
        a, unit, _ = self._load("output.weight")
        a = self._rows(a)
        out = _zeros_like_rows(a, p.out.n_vocab, p.out.n_embd // unit, a.dtype if unit > 1 else np.float16)
        out[:, : p.src.n_embd // unit] = a
        return self._finish("output.weight", out)

    def _layer(self, kind: str, i: int) -> np.ndarray:
        from .pad import _head_slots

        p = self.plan
        o, s, m = p.out, p.src, p.copies
        j, live = p.layer_source[i], p.layer_live[i]
        name = f"blk.{i}.{kind}.weight"
        a, unit, _ = self._load(f"blk.{j}.{kind}.weight")
        if kind in PRE_NORMS:
            return self._norm(a, p.norm_scale, 1)
        if kind in POST_NORMS:
            return self._norm(a, 1.0, m)
        if kind in ("attn_q_norm", "attn_k_norm"):  # per head over head_dim: unchanged
            return np.array(a, dtype=np.float32)
        shape, _, _ = self.info(name)
        rows, cols = shape[0], self._matrix_shape(kind)[1] // unit
        out = _zeros_like_rows(a, rows, cols, a.dtype if unit > 1 else np.float16)
        if kind in ("attn_output", "ffn_down") and not live:
            return self._finish(name, out)
        d, hd, du, hu = s.n_embd, s.head_dim, s.n_embd // unit, s.head_dim // unit
        if kind == "attn_q":
            for h, t in enumerate(_head_slots(p, i, j)):
                out[t * hd:(t + 1) * hd, :du] = a[h * hd:(h + 1) * hd]
        elif kind == "attn_output" and p.out.n_head // p.out.n_head_kv == s.n_head // s.n_head_kv:
            for c in range(m):  # source heads stay in place, new heads follow
                out[c * d:(c + 1) * d, : a.shape[1]] = a
        elif kind == "attn_output":
            for c in range(m):
                for h, t in enumerate(_head_slots(p, i, j)):
                    out[c * d:(c + 1) * d, t * hu:(t + 1) * hu] = a[:, h * hu:(h + 1) * hu]
        elif kind == "ffn_down":
            for c in range(m):
                out[c * d:(c + 1) * d, : a.shape[1]] = a
        else:  # attn_k, attn_v (KV heads stay first), ffn_gate, ffn_up: read the first copy
            out[: a.shape[0], :du] = a
        return self._finish(name, out)
