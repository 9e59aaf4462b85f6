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
