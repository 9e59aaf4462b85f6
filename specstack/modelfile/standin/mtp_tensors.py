"""What an MTP stand-in's GGUF holds: every tensor llama.cpp's loader asks for, and the key/values it reads.

The names and shapes follow llama.cpp's loaders (``src/models/qwen35.cpp``, ``qwen35moe.cpp``,
``glm4-moe.cpp``, vendored in llama-cpp-python 0.3.36) and the converters that write real models
(``conversion/qwen.py``: norms hold 1 + w, ``ssm_a`` holds -exp(A_log)). Shapes here are numpy's
(ggml's ``ne`` reversed: a {n_embd, n_ff} matrix is (n_ff, n_embd) rows of inputs). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from .mtp_layouts import MtpShape

# How a tensor is filled (``mtp.fill``): "matrix" N(0, gain^2 / fan_in), so a product keeps its input's scale
# (times gain); "ones" for norms (real GGUFs store 1 + w); "zeros"; "bias" N(0, 0.02^2); "decay" -U(1, 16)
# (ssm_a: -exp(A_log) with Qwen3-Next's A ~ U(0, 16) init); "vector" N(0, 1/n).
Init = Literal["matrix", "ones", "zeros", "bias", "decay", "vector"]

# Matrices that write into the residual stream: scaled by 1/sqrt(2 n_layer) (as GPT-2's init does), so the
# writes of all layers add up to a fixed share of the stream whatever the depth (``_residual_gain``).
RESIDUAL_WRITERS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                    "ffn_down_shexp.weight")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its name, numpy shape, how it is filled, and whether it stays F32 (norms, biases,
    routers, the conv kernel: real GGUFs keep them F32 and llama.cpp's quantizer leaves them alone).
    ``same_as`` names a tensor whose values it repeats (the output layer repeats the embedding)."""

    name: str
    shape: tuple[int, ...]
    init: Init = "matrix"
    f32: bool = False
    gain: float = 1.0
    same_as: str | None = None

    @property
    def n(self) -> int:
        out = 1
        for d in self.shape:
            out *= d
        return out

    @property
    def nbytes(self) -> int:
        return self.n * (4 if self.f32 else 2)


def _vec(name: str, n: int, init: Init = "ones") -> TensorSpec:
    return TensorSpec(name, (n,), init, f32=True)


def _attention(p: str, sh: MtpShape) -> list[TensorSpec]:
    """Full attention. qwen35*: the query projection also yields the output gate (2 x rows) and q/k are
    RMS-normed per head; glm4moe: plain GQA with q/k/v biases."""
    lay, e = sh.layout, sh.n_embd
    q, kv = sh.n_head * lay.head_dim, sh.n_head_kv * lay.head_dim
    gated = lay.hybrid
    out = [TensorSpec(p + "attn_q.weight", (2 * q if gated else q, e)), TensorSpec(p + "attn_k.weight", (kv, e)),
           TensorSpec(p + "attn_v.weight", (kv, e)), TensorSpec(p + "attn_output.weight", (e, q))]
    if lay.attn_bias:
        out += [_vec(p + "attn_q.bias", q, "bias"), _vec(p + "attn_k.bias", kv, "bias"), _vec(p + "attn_v.bias", kv, "bias")]
    if gated:
        out += [_vec(p + "attn_q_norm.weight", lay.head_dim), _vec(p + "attn_k_norm.weight", lay.head_dim)]
    return out


def _delta_net(p: str, sh: MtpShape) -> list[TensorSpec]:
    """A gated delta net layer (linear attention: a conv state and a head_dim x head_dim state per value head)."""
    lay, e, hd = sh.layout, sh.n_embd, sh.layout.ssm_head_dim
    key, value = hd * sh.ssm_k_heads, hd * sh.ssm_v_heads
    conv = 2 * key + value
    return [TensorSpec(p + "attn_qkv.weight", (conv, e)), TensorSpec(p + "attn_gate.weight", (value, e)),
            TensorSpec(p + "ssm_conv1d.weight", (conv, lay.ssm_conv), f32=True),
            _vec(p + "ssm_dt.bias", sh.ssm_v_heads), _vec(p + "ssm_a", sh.ssm_v_heads, "decay"),
            TensorSpec(p + "ssm_beta.weight", (sh.ssm_v_heads, e)), TensorSpec(p + "ssm_alpha.weight", (sh.ssm_v_heads, e)),
            _vec(p + "ssm_norm.weight", hd), TensorSpec(p + "ssm_out.weight", (e, value))]


def _dense_ffn(p: str, sh: MtpShape) -> list[TensorSpec]:
    e, f = sh.n_embd, sh.n_ff
    return [TensorSpec(p + "ffn_gate.weight", (f, e)), TensorSpec(p + "ffn_up.weight", (f, e)),
            TensorSpec(p + "ffn_down.weight", (e, f))]


def _moe_ffn(p: str, sh: MtpShape) -> list[TensorSpec]:
    """Routed experts (router F32) plus the shared expert: qwen35moe gates it with a sigmoid of one dot product
    (``ffn_gate_inp_shexp``, a vector); glm4moe routes with a sigmoid and a per-expert bias (``exp_probs_b``)."""
    e, n, fe, fs = sh.n_embd, sh.n_expert, sh.n_ff_exp, sh.n_ff_shexp
    out = [TensorSpec(p + "ffn_gate_inp.weight", (n, e), f32=True)]
    if sh.arch == "glm4moe":
        out.append(_vec(p + "exp_probs_b.bias", n, "zeros"))
    out += [TensorSpec(p + "ffn_gate_exps.weight", (n, fe, e)), TensorSpec(p + "ffn_up_exps.weight", (n, fe, e)),
            TensorSpec(p + "ffn_down_exps.weight", (n, e, fe))]
    if sh.arch == "qwen35moe":
        out.append(_vec(p + "ffn_gate_inp_shexp.weight", e, "vector"))
    out += [TensorSpec(p + "ffn_gate_shexp.weight", (fs, e)), TensorSpec(p + "ffn_up_shexp.weight", (fs, e)),
            TensorSpec(p + "ffn_down_shexp.weight", (e, fs))]
    return out


def _step35_block(il: int, sh: MtpShape) -> list[TensorSpec]:
    """A step35 block (``src/models/step35.cpp``): attention with per-head q/k norms and a head-wise sigmoid gate
    (``attn_gate``: one weight row per query head), ``ffn_norm`` then a dense FFN or routed experts with a selection
    bias plus the shared expert; NextN blocks (il >= n_layer) add the [embedding, hidden] projection and norms."""
    p, e, hd, h = f"blk.{il}.", sh.n_embd, sh.layout.head_dim, sh.heads(il)
    kv = sh.n_head_kv * hd
    out = [_vec(p + "attn_norm.weight", e), _vec(p + "attn_q_norm.weight", hd), _vec(p + "attn_k_norm.weight", hd),
           TensorSpec(p + "attn_q.weight", (h * hd, e)), TensorSpec(p + "attn_k.weight", (kv, e)),
           TensorSpec(p + "attn_v.weight", (kv, e)), TensorSpec(p + "attn_output.weight", (e, h * hd)),
           TensorSpec(p + "attn_gate.weight", (h, e)), _vec(p + "ffn_norm.weight", e)]
    if sh.is_moe(il):
        n, fe, fs = sh.n_expert, sh.n_ff_exp, sh.n_ff_shexp
        out += [TensorSpec(p + "ffn_gate_inp.weight", (n, e), f32=True), _vec(p + "exp_probs_b.bias", n, "zeros"),
                TensorSpec(p + "ffn_gate_exps.weight", (n, fe, e)), TensorSpec(p + "ffn_up_exps.weight", (n, fe, e)),
                TensorSpec(p + "ffn_down_exps.weight", (n, e, fe)), TensorSpec(p + "ffn_gate_shexp.weight", (fs, e)),
                TensorSpec(p + "ffn_up_shexp.weight", (fs, e)), TensorSpec(p + "ffn_down_shexp.weight", (e, fs))]
    else:
        out += _dense_ffn(p, sh)
    if il >= sh.n_layer:
        out += [TensorSpec(p + "nextn.eh_proj.weight", (e, 2 * e)), _vec(p + "nextn.enorm.weight", e),
                _vec(p + "nextn.hnorm.weight", e), _vec(p + "nextn.shared_head_norm.weight", e)]
    return out


def _block(il: int, sh: MtpShape) -> list[TensorSpec]:
    """Block ``il``: the trunk's, or (il == n_layer) the NextN block, a full-attention block of the same kind
    plus the projection of [embedding, hidden] into the residual and its two norms."""
    if sh.arch == "step35":
        return _step35_block(il, sh)
    p, e = f"blk.{il}.", sh.n_embd
    out = [_vec(p + "attn_norm.weight", e)]
    out += _delta_net(p, sh) if sh.is_recurrent(il) else _attention(p, sh)
    out.append(_vec(p + "post_attention_norm.weight", e))
    out += _moe_ffn(p, sh) if sh.is_moe(il) else _dense_ffn(p, sh)
    if il == sh.n_layer:
        out += [TensorSpec(p + "nextn.eh_proj.weight", (e, 2 * e)), _vec(p + "nextn.enorm.weight", e),
                _vec(p + "nextn.hnorm.weight", e), _vec(p + "nextn.shared_head_norm.weight", e)]
    return out


def _residual_gain(specs: list[TensorSpec], n_layer: int) -> list[TensorSpec]:
    """The residual writers of ``specs`` at gain 1/sqrt(2 n_layer) (``RESIDUAL_WRITERS``)."""
    g = (2 * n_layer) ** -0.5
    return [replace(s, gain=g) if s.name.endswith(RESIDUAL_WRITERS) else s for s in specs]


def tensor_specs(sh: MtpShape, n_vocab: int) -> list[TensorSpec]:
    """Every tensor of the stand-in, in llama.cpp's usual order.

    Embedding rows have unit norm, and the output layer is stored apart from it (untied, as in the real
    models, so it is quantized and costs what theirs does) but holds the same values. Then each token's own
    logit leads by about 1 / (the residual writes' share), the same at every width and depth, and the other
    logits are N(0, 1): greedy output runs in repeats that its context breaks now and then. So retrieval drafts
    (suffix, prompt-lookup) are accepted at times and rejected at others: both paths run.
    """
    e = sh.n_embd
    out = [TensorSpec("token_embd.weight", (n_vocab, e)), _vec("output_norm.weight", e),
           TensorSpec("output.weight", (n_vocab, e), same_as="token_embd.weight")]
    for il in range(sh.n_block):
        out += _block(il, sh)
    return _residual_gain(out, sh.n_layer)


# (key, value, GGUF value type name): written by ``mtp.write_mtp_f16`` through ``GGUFWriter.add_key_value``
KeyValue = tuple[str, Any, str]


def key_values(sh: MtpShape) -> list[KeyValue]:
    """The architecture's hyper-parameters as llama.cpp's loader reads them (``load_hparams`` and the arch's
    ``load_arch_hparams``). key_length is explicit: n_embd / n_head is not the head size in any of these."""
    lay, a = sh.layout, sh.arch
    if a == "step35":
        return _step35_key_values(sh)
    kv: list[KeyValue] = [
        (f"{a}.block_count", sh.n_block, "UINT32"), (f"{a}.nextn_predict_layers", 1, "UINT32"),
        (f"{a}.context_length", lay.n_ctx, "UINT32"), (f"{a}.embedding_length", sh.n_embd, "UINT32"),
        (f"{a}.attention.head_count", sh.n_head, "UINT32"), (f"{a}.attention.head_count_kv", sh.n_head_kv, "UINT32"),
        (f"{a}.attention.key_length", lay.head_dim, "UINT32"), (f"{a}.attention.value_length", lay.head_dim, "UINT32"),
        (f"{a}.attention.layer_norm_rms_epsilon", lay.eps, "FLOAT32"),
        (f"{a}.rope.freq_base", lay.rope_base, "FLOAT32"), (f"{a}.rope.dimension_count", lay.rope_dims, "UINT32"),
    ]
    if sh.n_ff:
        kv.append((f"{a}.feed_forward_length", sh.n_ff, "UINT32"))
    if sh.n_expert:
        kv += [(f"{a}.expert_count", sh.n_expert, "UINT32"), (f"{a}.expert_used_count", sh.n_expert_used, "UINT32"),
               (f"{a}.expert_feed_forward_length", sh.n_ff_exp, "UINT32")]
    if a == "qwen35moe":
        kv.append((f"{a}.expert_shared_feed_forward_length", sh.n_ff_shexp, "UINT32"))
    if lay.hybrid:
        half = lay.rope_dims // 2  # interleaved M-RoPE: Qwen3.5's [11, 11, 10] of 32, scaled to the rotary half
        sections = [round(half * 11 / 32), round(half * 11 / 32)]
        kv += [(f"{a}.rope.dimension_sections", sections + [half - sum(sections), 0], "INT32"),
               (f"{a}.full_attention_interval", lay.full_attn_interval, "UINT32"),
               (f"{a}.ssm.conv_kernel", lay.ssm_conv, "UINT32"), (f"{a}.ssm.state_size", lay.ssm_head_dim, "UINT32"),
               (f"{a}.ssm.group_count", sh.ssm_k_heads, "UINT32"), (f"{a}.ssm.time_step_rank", sh.ssm_v_heads, "UINT32"),
               (f"{a}.ssm.inner_size", lay.ssm_head_dim * sh.ssm_v_heads, "UINT32")]
    if a == "glm4moe":
        kv += [(f"{a}.expert_shared_count", lay.n_expert_shared, "UINT32"),
               (f"{a}.leading_dense_block_count", min(lay.n_dense_lead, sh.n_layer), "UINT32"),
               (f"{a}.expert_weights_scale", 1.0, "FLOAT32"), (f"{a}.expert_weights_norm", True, "BOOL"),
               (f"{a}.expert_gating_func", 2, "UINT32")]  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    return kv


def _step35_key_values(sh: MtpShape) -> list[KeyValue]:
    """step35's hyper-parameters as ``conversion/step3.py`` writes them: per-layer head counts and the sliding-window
    pattern as arrays over every block (NextN included), rope.dimension_count the whole head (full-attention
    layers rotate half of it: the loader halves n_rot_full), the leading dense blocks, the experts' routing."""
    lay, a, n = sh.layout, sh.arch, sh.n_block
    return [
        (f"{a}.block_count", n, "UINT32"), (f"{a}.nextn_predict_layers", sh.n_nextn, "UINT32"),
        (f"{a}.context_length", lay.n_ctx, "UINT32"), (f"{a}.embedding_length", sh.n_embd, "UINT32"),
        (f"{a}.feed_forward_length", sh.n_ff, "UINT32"),
        (f"{a}.attention.head_count", [sh.heads(il) for il in range(n)], "UINT32"),
        (f"{a}.attention.head_count_kv", [sh.n_head_kv] * n, "UINT32"),
        (f"{a}.attention.key_length", lay.head_dim, "UINT32"), (f"{a}.attention.value_length", lay.head_dim, "UINT32"),
        (f"{a}.attention.layer_norm_rms_epsilon", lay.eps, "FLOAT32"),
        (f"{a}.attention.sliding_window", lay.n_swa, "UINT32"),
        (f"{a}.attention.sliding_window_pattern", [sh.is_swa(il) for il in range(n)], "BOOL"),
        (f"{a}.rope.freq_base", lay.rope_base, "FLOAT32"), (f"{a}.rope.freq_base_swa", lay.rope_base_swa, "FLOAT32"),
        (f"{a}.rope.dimension_count", lay.rope_dims, "UINT32"),
        (f"{a}.expert_count", sh.n_expert, "UINT32"), (f"{a}.expert_used_count", sh.n_expert_used, "UINT32"),
        (f"{a}.expert_feed_forward_length", sh.n_ff_exp, "UINT32"),
        (f"{a}.expert_shared_feed_forward_length", sh.n_ff_shexp, "UINT32"),
        (f"{a}.leading_dense_block_count", min(lay.n_dense_lead, sh.n_layer), "UINT32"),
        (f"{a}.expert_weights_scale", 3.0, "FLOAT32"), (f"{a}.expert_weights_norm", True, "BOOL"),
        (f"{a}.expert_gating_func", 2, "UINT32"),  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (the loader's default)
    ]
