"""Which architectures (``general.architecture``) carry recurrent state, and how speculation rewinds them.

From llm_arch_is_recurrent / llm_arch_is_hybrid / llm_arch_supports_rs_rollback in the llama.cpp
vendored by llama-cpp-python 0.3.36 (src/llama-arch.cpp).  The loaded model is asked too
(``target.LlamaModel.memory`` / ``.strategy``); these tables let `check`, `models scan` and
`doctor` answer from metadata alone, without loading weights.
"""

from __future__ import annotations

RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")
HYBRID_ARCHS = (
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
)
ROLLBACK_ARCHS = (
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
)


def _key(arch: str | None) -> str:
    return (arch or "").lower()


def is_recurrent(arch: str | None) -> bool:
    """Purely recurrent (state-space / RWKV): its state cannot be cut back by position."""
    return _key(arch) in RECURRENT_ARCHS


def is_hybrid(arch: str | None) -> bool:
    """Attention plus recurrent layers: the recurrent part needs rollback or checkpoints too."""
    return _key(arch) in HYBRID_ARCHS


def recurrence(arch: str | None) -> str:
    """``recurrent``, ``hybrid`` or ``none`` (attention only)."""
    return "recurrent" if is_recurrent(arch) else "hybrid" if is_hybrid(arch) else "none"


def rewind(arch: str | None) -> str:
    """How speculation takes rejected tokens back (``target.recurrent.Strategy``): truncate, rollback or checkpoint."""
    if recurrence(arch) == "none":
        return "truncate"
    return "rollback" if _key(arch) in ROLLBACK_ARCHS else "checkpoint"


# Multi-token prediction (MTP, "NextN" layers: ``<arch>.nextn_predict_layers``): the architectures for which this
# llama.cpp builds an MTP graph (``LLM_GRAPH_TYPE_DECODER_MTP`` in src/models/*.cpp), by how its draft-mtp drives
# them (common/speculative.cpp, common_speculative_impl_draft_mtp).
MTP_SINGLE_HEAD = (  # one head; k > 1 chains it on its own output
    "qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32", "deepseek4",
    "cohere2moe", "bailingmoe3", "nemotron_h_moe", "mimo2", "hy_v3",
)
# several heads, one per draft position (llama_set_nextn_layer_offset): drafts at most n_heads long
MTP_CHAINED_HEADS = ("step35",)
MTP_ASSISTANT = ("gemma4-assistant",)  # a separate GGUF of NextN layers that shares the target's KV (-md)
# the targets whose MTP head is such an assistant (given with -md): target architecture -> the assistant's
MTP_ASSISTANT_FOR = {"gemma4": "gemma4-assistant"}


def mtp_assistant_arch(target_arch: str | None) -> str | None:
    """The architecture of the separate MTP head ``target_arch`` drafts with (gemma4: ``gemma4-assistant``); None
    where its head, if any, is in its own GGUF."""
    return MTP_ASSISTANT_FOR.get(_key(target_arch))


def mtp_mode(arch: str | None) -> str | None:
    """How llama.cpp drafts from ``arch``'s NextN layers: ``single head``, ``chained heads``, ``assistant``; None
    where this build has no MTP graph for it (a GGUF may still declare NextN layers: dots3note does)."""
    key = _key(arch)
    if key in MTP_SINGLE_HEAD:
        return "single head"
    if key in MTP_CHAINED_HEADS:
        return "chained heads"
    if key in MTP_ASSISTANT:
        return "assistant"
    return None


# Trained draft heads: llama.cpp's own architectures for a separate GGUF that drafts from a target's hidden states
# (src/llama-arch.cpp: LLM_ARCH_EAGLE3, LLM_ARCH_DFLASH; DSpark is dflash plus Markov tensors, not an arch;
# docs/design-eagle3-dflash.md).
HEAD_ARCHS = ("eagle3", "dflash")
# The kinds of head (``HeadInfo.kind``) a specstack drafter of the same name reads: not dspark (a dflash GGUF with
# Markov tensors), whose anchor-first blocks need a driver of their own.
DRAFTED_HEADS = ("eagle3", "dflash")
# The targets whose graph exports a layer's input (``res->t_layer_inp[il]``), which is what such a head reads; any
# other target aborts the process at graph build once a layer input is asked for (``GGML_ASSERT(t_layer_inp[il] !=
# nullptr)``, src/llama-graph.cpp). Derived from ``grep -l 't_layer_inp\[' src/models/*.cpp``, each graph class
# mapped to the architectures that build it (``llama_model_mapping`` in src/llama-model.cpp, and the classes in
# src/models/models.h that reuse another's graph: llama-embed, lfm2moe, nemotron_h_moe, hunyuan-dense). Gemma 3 is
# not among them.
LAYER_INPUT_ARCHS = (
    "llama", "llama-embed", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "gemma4", "gpt-oss",
    "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "mimo2", "minimax-01", "minimax-m2", "muse-glimmer",
    "nanbeige", "hunyuan_vl", "hunyuan-dense", "bailingmoe3", "deepseek4",
)


def is_head(arch: str | None) -> bool:
    """A trained draft head's GGUF (eagle3, dflash): it drafts for a target, it is not a model to generate with."""
    return _key(arch) in HEAD_ARCHS


def exports_layer_inputs(arch: str | None) -> bool:
    """Whether this llama.cpp can hand out ``arch``'s layer inputs, so an EAGLE-3 or DFlash head can draft for it."""
    return _key(arch) in LAYER_INPUT_ARCHS
