"""A random-weight gemma4 target and its ``gemma4-assistant`` MTP head: llama.cpp's third draft-mtp mode, at toy size.

Gemma 4's MTP head is a separate GGUF (the "assistant") that has no K/V projections of its own: its attention
reads the *target's* KV cache (its sliding-window layers the target's layer n_layer - 2, its full-attention layers
the target's last layer: ``llama_model::create_memory`` in src/llama-model.cpp), and it embeds tokens with the
target's ``token_embd``. So the pair must agree on the vocabulary, the head size and the KV heads, and the
target's last two layers must be one sliding-window and one full-attention layer (gemma4's real pattern ends so).
The assistant is narrower than the target (``embedding_length_out`` carries the target's width; llama.cpp refuses
an assistant whose two widths are equal).

As ``mtp.py``'s stand-ins: random weights (``mtp.fill``), good for losslessness and cost, never for acceptance;
the tokenizer is copied from a source GGUF (the bundled target by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .mtp import copy_tokenizer, fill
from .mtp_tensors import TensorSpec
from .source import open_source
from .writer import gguf_file


@dataclass(frozen=True)
class Gemma4Pair:
    """The pair's shape: the target's ``n_layer`` layers (sliding-window but the last), width ``n_embd``; the
    assistant's ``n_assist`` layers (pattern: sliding-window but the last) at width ``n_embd_assist``."""

    n_layer: int = 2
    n_embd: int = 64
    n_embd_assist: int = 32
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    n_ff_assist: int = 64
    n_assist: int = 2
    n_swa: int = 512
    n_ctx: int = 4096
    eps: float = 1e-6

    def swa_pattern(self, n: int) -> list[bool]:
        """Sliding-window on every layer but the last (which is full attention, as the KV sharing needs)."""
        return [i < n - 1 for i in range(n)]


def _vec(name: str, n: int, init: str = "ones") -> TensorSpec:
    return TensorSpec(name, (n,), init, f32=True)  # type: ignore[arg-type]


def target_specs(p: Gemma4Pair, n_vocab: int) -> list[TensorSpec]:
    """The gemma4 target's tensors (src/models/gemma4.cpp ``load_arch_tensors``; numpy shapes: ggml's reversed)."""
    e, hd, q, kv = p.n_embd, p.head_dim, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    out = [TensorSpec("token_embd.weight", (n_vocab, e)), _vec("output_norm.weight", e),
           _vec("rope_freqs.weight", hd // 2)]
    for i in range(p.n_layer):
        b = f"blk.{i}."
        out += [_vec(b + "attn_norm.weight", e), TensorSpec(b + "attn_q.weight", (q, e)),
                TensorSpec(b + "attn_k.weight", (kv, e)), TensorSpec(b + "attn_v.weight", (kv, e)),
                TensorSpec(b + "attn_output.weight", (e, q)), _vec(b + "attn_q_norm.weight", hd),
                _vec(b + "attn_k_norm.weight", hd), _vec(b + "post_attention_norm.weight", e),
                _vec(b + "layer_output_scale.weight", 1), _vec(b + "ffn_norm.weight", e),
                TensorSpec(b + "ffn_gate.weight", (p.n_ff, e)), TensorSpec(b + "ffn_up.weight", (p.n_ff, e)),
                TensorSpec(b + "ffn_down.weight", (e, p.n_ff)), _vec(b + "post_ffw_norm.weight", e)]
    return out


def assistant_specs(p: Gemma4Pair, n_vocab: int) -> list[TensorSpec]:
    """The gemma4-assistant's tensors (src/models/gemma4-assistant.cpp): Q-only attention over the target's KV,
    the pre-projection of [target embedding, target row] and the post-projection back to the target's width."""
    a, e, hd, q = p.n_embd_assist, p.n_embd, p.head_dim, p.n_head * p.head_dim
    out = [TensorSpec("token_embd.weight", (n_vocab, a)), _vec("output_norm.weight", a),
           _vec("rope_freqs.weight", hd // 2), TensorSpec("nextn.pre_projection.weight", (a, 2 * e)),
           TensorSpec("nextn.post_projection.weight", (e, a))]
    for i in range(p.n_assist):
        b = f"blk.{i}."
        out += [_vec(b + "attn_norm.weight", a), TensorSpec(b + "attn_q.weight", (q, a)),
                TensorSpec(b + "attn_output.weight", (a, q)), _vec(b + "attn_q_norm.weight", hd),
                _vec(b + "post_attention_norm.weight", a), _vec(b + "layer_output_scale.weight", 1),
                _vec(b + "ffn_norm.weight", a), TensorSpec(b + "ffn_gate.weight", (p.n_ff_assist, a)),
                TensorSpec(b + "ffn_up.weight", (p.n_ff_assist, a)),
                TensorSpec(b + "ffn_down.weight", (a, p.n_ff_assist)), _vec(b + "post_ffw_norm.weight", a)]
    return out


def _header(w, p: Gemma4Pair, n_layer: int, n_embd: int, n_ff: int) -> None:
    """The hyper-parameters both architectures read (gemma4.cpp / gemma4-assistant.cpp ``load_arch_hparams``)."""
    w.add_context_length(p.n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_key_length_swa(p.head_dim)
    w.add_value_length_swa(p.head_dim)
    w.add_rope_dimension_count(p.head_dim)
    w.add_rope_dimension_count_swa(p.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_sliding_window(p.n_swa)
    w.add_sliding_window_pattern(p.swa_pattern(n_layer))
    w.add_layer_norm_rms_eps(p.eps)
    w.add_embedding_length_per_layer_input(0)
    w.add_shared_kv_layers(0)


def _write(out: Path, arch: str, specs: list[TensorSpec], tokenizer: Path, header, seed: int) -> None:
    """One GGUF of ``specs`` (via ``out.partial``), header keys from ``header(writer)`` and the copied tokenizer."""
    reader = open_source(tokenizer)
    with gguf_file(out, arch) as w:
        w.add_name(f"{arch} MTP stand-in (random)")
        w.add_file_type(1)
        header(w)
        copy_tokenizer(reader, w)
        w.add_bool("specstack.standin.random_weights", True)
        for spec in specs:
            w.add_tensor(spec.name, fill(spec, seed))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


def assistant_path(target: Path) -> Path:
    """Where ``make_gemma4_pair`` writes the assistant: beside the target, ``NAME-assistant.gguf``."""
    return target.with_name(target.stem + "-assistant.gguf")


def make_gemma4_pair(out: Path, pair: Gemma4Pair = Gemma4Pair(), *, tokenizer: Path | None = None,
                     seed: int = 0) -> tuple[Path, Path]:
    """Write the random gemma4 target to ``out`` and its assistant beside it (``assistant_path``); return both."""
    from ...paths import DEFAULT_TARGET

    src = Path(tokenizer) if tokenizer is not None else DEFAULT_TARGET
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_vocab = len(open_source(src).fields["tokenizer.ggml.tokens"].data)
    p = pair

    def target_header(w) -> None:
        _header(w, p, p.n_layer, p.n_embd, p.n_ff)

    def assistant_header(w) -> None:
        _header(w, p, p.n_assist, p.n_embd_assist, p.n_ff_assist)
        w.add_uint32("gemma4-assistant.embedding_length_out", p.n_embd)
        w.add_uint32("gemma4-assistant.nextn_predict_layers", p.n_assist)

    _write(out, "gemma4", target_specs(p, n_vocab), src, target_header, seed)
    helper = assistant_path(out)
    _write(helper, "gemma4-assistant", assistant_specs(p, n_vocab), src, assistant_header, seed + 1)
    return out, helper
