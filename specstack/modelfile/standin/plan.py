"""``plan_standin``: check a stand-in request and work out its shape and layer layout (pure).

Every refusal happens here, before any file is read or written, so the CLI can report a bad
``--width``/``--layers``/``--ffn``/``--kv-heads``/``--attn-layers`` at once.
"""

from __future__ import annotations

import math

from ...errors import InvalidParameterError
from .gemma3 import check_gemma3, gemma3_heads, gemma3_layout, gemma3_residual_copies
from .lfm2 import lfm2_residual_copies, lfm2_standin_layout
from .llama import llama_layer_layout, residual_copies
from .shape import FTYPES, LlamaShape, StandinPlan

# Quant block length (elements per row block) per ftype; rows of the source must fill whole blocks.
_BLOCK = {"f16": 1, "q8_0": 32, "q4_k_m": 256}


def _check_heads(src: LlamaShape, width: int, kv_heads: int | None) -> None:
    """The width must hold whole heads, grouped so that source query heads still reach their KV heads."""
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


def _check_layers(src: LlamaShape, layers: int) -> None:
    """A stand-in only adds layers, and llama.cpp loads at most 512."""
    if layers < src.n_layer:
        raise InvalidParameterError(
            f"--layers {layers} is fewer than the source's {src.n_layer} layers; a stand-in can only grow")
    if layers > 512:
        raise InvalidParameterError(f"--layers {layers} is more than llama.cpp's limit of 512")


def _ffn_width(src: LlamaShape, width: int, ffn: int | None) -> int:
    """The stand-in's FFN width: ``ffn``, or the source's FFN/hidden ratio times ``width``."""
    n_ff = ffn if ffn is not None else round(src.n_ff * width / src.n_embd)
    if n_ff < src.n_ff:
        raise InvalidParameterError(f"--ffn {n_ff} is smaller than the source's FFN width {src.n_ff}")
    return n_ff


def _check_blocks(src: LlamaShape, width: int, n_ff: int, ftype: str) -> None:
    """Source and stand-in rows must fill whole quant blocks, or the source's blocks would not
    reappear unchanged in the quantized stand-in."""
    block = _BLOCK[ftype]
    for what, n_src, n_new in (("hidden size", src.n_embd, width), ("FFN width", src.n_ff, n_ff)):
        if n_src % block or n_new % block:
            raise InvalidParameterError(
                f"{ftype} quantizes rows in blocks of {block}: the source {what} ({n_src}) and the stand-in's "
                f"({n_new}) must both be multiples of {block}, or the quantized stand-in would not match")


def _plan_gemma3(src: LlamaShape, width: int, layers: int, ffn: int | None, ftype: str,
                 heads: int | None, kv_heads: int | None, vocab: int | None = None) -> StandinPlan:
    """Gemma 3: head_dim and (by default) the head count stay the source's, as in Gemma 3 1B (see
    the gemma3 module for the padding and why it is exact)."""
    if width < src.n_embd:
        raise InvalidParameterError(
            f"--width {width} is smaller than the source's hidden size {src.n_embd}; a stand-in can only grow")
    _check_layers(src, layers)
    n_ff = _ffn_width(src, width, ffn)
    n_head, n_head_kv = gemma3_heads(src, heads, kv_heads)
    if vocab is not None and not 0 < vocab <= src.n_vocab:
        raise InvalidParameterError(f"--vocab {vocab} must be between 1 and the source's {src.n_vocab} tokens; a "
                                    "stand-in can only drop tokens")
    if src.quantized is None or ftype == "f16":
        _check_blocks(src, width, n_ff, ftype if ftype != "q4_k_m" else "f16")
    out = LlamaShape(n_embd=width, n_layer=layers, n_head=n_head, n_head_kv=n_head_kv, head_dim=src.head_dim,
                     n_ff=n_ff, n_vocab=vocab or src.n_vocab, tied_output=src.tied_output, arch="gemma3",
                     quantized=src.quantized if ftype != "f16" else None, row_blocks=src.row_blocks)
    check_gemma3(src, out, ftype)
    layout = gemma3_layout(src.n_layer, layers)
    m = gemma3_residual_copies(src.n_embd, width)
    return StandinPlan(src=src, out=out, layer_source=layout.source, layer_live=layout.live,
                       copies=m, norm_scale=math.sqrt(m * src.n_embd / width), q4_types_match=True)


def plan_standin(src: LlamaShape, width: int, layers: int, ffn: int | None = None,
                 ftype: str = "f16", *, kv_heads: int | None = None,
                 attn_layers: int | None = None, heads: int | None = None,
                 vocab: int | None = None) -> StandinPlan:
    """Check the request and work out the stand-in's shape and layer layout.

    ``kv_heads``: the stand-in's KV heads per attention layer (default: the source's query heads
    per KV head are kept). ``attn_layers`` (LFM2 only): how many layers are attention layers
    (default: the source's share of ``layers``). ``heads`` (gemma3 only): query heads (default:
    the source's; llama and lfm2 have width / head_dim). ``vocab`` (gemma3 only): keep that many of the
    source's tokens (``vocab`` module; which ones needs the file, so only the count is checked here).
    """
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown --ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    lfm2 = src.arch == "lfm2"
    if attn_layers is not None and not lfm2:
        raise InvalidParameterError("--attn-layers applies to hybrid (lfm2) sources only")
    if src.arch == "gemma3":
        return _plan_gemma3(src, width, layers, ffn, ftype, heads, kv_heads, vocab)
    if vocab is not None:
        raise InvalidParameterError(f"--vocab applies to gemma3 sources only (SentencePiece vocabularies; {src.arch} "
                                    "stand-ins keep the source's)")
    if heads is not None:
        raise InvalidParameterError(f"--heads applies to gemma3 sources only ({src.arch} has width / head_dim heads)")
    _check_heads(src, width, kv_heads)
    _check_layers(src, layers)
    n_ff = _ffn_width(src, width, ffn)
    _check_blocks(src, width, n_ff, ftype)
    n_head = width // src.head_dim

    def out_kv(j: int) -> int:  # KV heads of a stand-in attention layer holding source layer j
        return kv_heads if kv_heads is not None else n_head // (src.n_head // src.kv_heads(j))

    if lfm2:
        layout = lfm2_standin_layout(src, layers, ftype, attn_layers)
        layer_kv = tuple(out_kv(layout.source[i]) if layout.attention[i] else 0 for i in range(layers))
        first_kv = next((k for k in layer_kv if k), 0)
        m = lfm2_residual_copies(src.n_embd, width)
    else:
        layout = llama_layer_layout(src.n_layer, layers)
        layer_kv, first_kv = (), out_kv(0)
        m = residual_copies(src.n_embd, width)
    out = LlamaShape(n_embd=width, n_layer=layers, n_head=n_head, n_head_kv=first_kv, head_dim=src.head_dim,
                     n_ff=n_ff, n_vocab=src.n_vocab, tied_output=src.tied_output, n_expert=src.n_expert,
                     n_expert_used=src.n_expert_used, arch=src.arch, layer_kv=layer_kv, l_cache=src.l_cache)
    return StandinPlan(src=src, out=out, layer_source=layout.source, layer_live=layout.live,
                       copies=m, norm_scale=math.sqrt(m * src.n_embd / width), q4_types_match=layout.q4_types_match)
