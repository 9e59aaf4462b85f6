"""The KV cache's size, known before llama.cpp allocates it: said at load, refused when it cannot fit.

llama.cpp allocates the whole cache when the context is created, at f16 by default: per layer and
cell, ``n_head_kv x key_length`` K elements and ``n_head_kv x value_length`` V elements, each row stored
in its cache type's blocks (``-ctk``/``-ctv``: ggml's ``ggml_row_size``, so a q8_0 row takes 34 bytes per
32 elements).  Sliding-window layers (Gemma 2/3, Cohere 2) hold as many cells as the others, because
llama-cpp-python's context defaults keep the full-size window cache (``swa_full``), which is what lets
speculation roll a sequence back and reuse a prefix anywhere.  Their share is reported apart, since that is
the memory a windowed cache would save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidParameterError, ModelLoadError
from ..modelfile import archs

# llama.cpp's KV cache types (common/arg.cpp's kv_cache_types, as -ctk/-ctv name them) -> (elements per block,
# bytes per block), from ggml-common.h's block structs: a quantized block holds 32 elements and its f16 scale
# (q4_1, q5_1: a scale and a minimum; q5_*: 4 bytes of fifth bits besides).
KV_TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
            "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24)}
DEFAULT_KV_TYPE = "f16"


def check_kv_type(name: str, flag: str = "the KV cache type") -> str:
    """``name`` if it is one of llama.cpp's KV cache types (``KV_TYPES``), else the error naming ``flag``."""
    if name not in KV_TYPES:
        raise InvalidParameterError(f"{flag} must be one of {', '.join(KV_TYPES)} (got {name!r})")
    return name


def is_quantized(name: str) -> bool:
    """Whether a KV type stores blocks (ggml_is_quantized): a quantized V cache needs flash attention."""
    return KV_TYPES[name][0] > 1


def row_bytes(name: str, elements: int) -> int:
    """Bytes of one row of ``elements`` in KV type ``name`` (ggml_row_size; a partial block counts whole)."""
    block, size = KV_TYPES[name]
    return -(-elements // block) * size
# Sliding-window layers by architecture where the GGUF has no ``<arch>.attention.sliding_window_pattern``, as
# llama.cpp's src/models/*.cpp default them (load_swa_pattern(ml, n): every n-th layer is global, the others windowed).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma-embedding": 6, "cohere2": 4, "llama4": 4,
               "openai-moe": 2, "exaone4": 4, "olmo2": 4}


@dataclass(frozen=True)
class KVEstimate:
    """Bytes of the KV cache for ``cells`` cells (all sequences together), and the windowed layers' share."""

    cells: int
    per_seq: int
    total_bytes: int
    swa_bytes: int
    swa_window: int  # 0: no sliding window
    swa_layers: int
    n_layers: int
    type_k: str = DEFAULT_KV_TYPE
    type_v: str = DEFAULT_KV_TYPE
    shared_by: int = 1  # sequences sharing one pool of ``cells`` (-kvu), each up to ``per_seq``; 1: no pool

    @property
    def types(self) -> str:
        """The cache's types as said at load: one name where K and V share it (``f16``), else both."""
        return self.type_k if self.type_k == self.type_v else f"K {self.type_k}, V {self.type_v}"

    def describe(self) -> str:
        from ..ui import fmt_bytes

        seqs = self.cells // max(self.per_seq, 1)
        layout = (f"one pool of {self.cells} cells shared by {self.shared_by} slots, any one up to {self.per_seq}"
                  if self.shared_by > 1 else
                  f"{self.per_seq} positions x {seqs} sequence{'s' if seqs != 1 else ''}")
        text = f"KV cache {fmt_bytes(self.total_bytes)} ({self.types}, {layout}, {self.n_layers} layers)"
        if self.swa_layers:
            text += (f"; {self.swa_layers} sliding-window layers ({self.swa_window} tokens) hold "
                     f"{fmt_bytes(self.swa_bytes)} of it at full size, so drafts can be rolled back")
        return text


def _per_layer(value: Any, n_layers: int, default: int) -> list[int]:
    """A hyperparameter llama.cpp accepts as one number or one per layer."""
    if value is None:
        return [default] * n_layers
    try:
        values = [int(v) for v in value]
    except TypeError:
        return [int(value)] * n_layers
    return (values + [values[-1] if values else default] * n_layers)[:n_layers]


def _windowed_layers(pattern: Any, default: int, n_layers: int) -> list[bool]:
    """Which layers use the sliding window: a per-layer flag array, or every n-th layer global."""
    if pattern is not None and not isinstance(pattern, (int, float)):
        flags = [bool(v) for v in pattern]
        return (flags + [False] * n_layers)[:n_layers]
    n = int(pattern) if pattern is not None else default
    return [n > 0 and (layer + 1) % n != 0 for layer in range(n_layers)]


def _attention(meta: Any) -> tuple[int, list[int], int, int] | None:
    """The layer count, KV heads per layer and K and V head sizes from GGUF metadata (``GGUFInfo``), as llama.cpp
    reads them; None for purely recurrent models or metadata too incomplete to say."""
    arch = meta.architecture
    if not arch or archs.is_recurrent(arch):
        return None
    n_layers = meta.get(f"{arch}.block_count")
    n_embd = meta.get(f"{arch}.embedding_length")
    n_head = meta.get(f"{arch}.attention.head_count")
    if not n_layers or not n_embd or n_head is None:
        return None
    n_layers = int(n_layers)
    heads = _per_layer(n_head, n_layers, 1)
    kv_key = meta.get(f"{arch}.attention.head_count_kv")
    heads_kv = heads if kv_key is None else _per_layer(kv_key, n_layers, 0)  # llama.cpp: n_head_kv defaults to n_head
    head_dim = int(n_embd) // max(max(heads), 1)
    k_len = int(meta.get(f"{arch}.attention.key_length") or head_dim)
    v_len = int(meta.get(f"{arch}.attention.value_length") or head_dim)
    return n_layers, heads_kv, k_len, v_len


def estimate_kv(meta: Any, per_seq: int, cells: int, type_k: str = DEFAULT_KV_TYPE,
                type_v: str = DEFAULT_KV_TYPE, shared_by: int = 1) -> KVEstimate | None:
    """The KV cache of ``cells`` cells in types ``type_k``/``type_v`` from GGUF metadata (``GGUFInfo``); None for
    purely recurrent models (their state does not grow with the context) or metadata too incomplete to say.
    ``shared_by``: the sequences sharing those cells as one pool (-kvu)."""
    shape = _attention(meta)
    if shape is None:
        return None
    n_layers, heads_kv, k_len, v_len = shape
    arch = meta.architecture
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    windowed = _windowed_layers(meta.get(f"{arch}.attention.sliding_window_pattern"), SWA_PATTERN.get(arch, 0),
                                n_layers) if window else [False] * n_layers
    total = swa = n_swa = 0
    for layer, kv in enumerate(heads_kv):
        size = cells * (row_bytes(type_k, kv * k_len) + row_bytes(type_v, kv * v_len))
        total += size
        if windowed[layer]:
            swa += size
            n_swa += 1
    return KVEstimate(cells, per_seq, total, swa, window if n_swa else 0, n_swa, n_layers, type_k, type_v, shared_by)


def check_kv_blocks(meta: Any, type_k: str, type_v: str, name: str) -> None:
    """Refuse, before llama.cpp sees them, quantized KV types whose blocks do not divide a head: llama.cpp refuses
    them with flash attention (llama_init_from_model) and, without it, asserts in the K product, ending the process."""
    shape = _attention(meta)
    if shape is None:
        return
    for flag, kind, head in (("-ctk", type_k, shape[2]), ("-ctv", type_v, shape[3])):
        elements = KV_TYPES[kind][0]
        if head % elements:
            raise InvalidParameterError(f"{flag} {kind}: its blocks of {elements} do not divide {name}'s heads of "
                                        f"{head}; use f16, bf16 or f32 for this model")


def check_kv_fits(kv: KVEstimate | None, role: str, name: str, per_seq: int, release: Callable[[], None]) -> None:
    """Refuse, before llama.cpp allocates it, a KV cache larger than the memory this process can use.

    ``release`` frees what was loaded so far (the model's weights) before the error is raised.
    """
    from ..host.sysinfo import available_memory
    from ..ui import fmt_bytes

    room = available_memory() if kv is not None else None
    if kv is None or room is None or kv.total_bytes <= 0.9 * room:
        return
    release()
    fit = max(256, int(per_seq * 0.9 * room / kv.total_bytes) // 256 * 256)
    raise ModelLoadError(
        f"{role} {name}: a context of {per_seq} positions needs a {fmt_bytes(kv.total_bytes)} KV cache, but only "
        f"{fmt_bytes(room)} of memory is available; use a smaller --ctx-size (-c {fit} would fit), or fewer "
        "--parallel slots")
