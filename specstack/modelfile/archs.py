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
