"""llama.cpp models through llama-cpp-python's low-level API: the only package that imports llama_cpp.

A ``LlamaModel`` owns one model and one context holding one or more
sequences.  It evaluates batches of tokens within the call shapes measured
exact, returns logits for the rows asked for, and truncates a sequence
after a rejected draft.  The same class serves as target and as draft model.

Modules, one job each:

- ``target``: the target contract (no llama_cpp): ``ModelConfig``, what every target does (``Target``,
  ``EngineTarget``), the optional capabilities (``HiddenRowsTarget``, ``GrammarTarget``, ``MtpTarget``,
  ``LayerInputsTarget``) and what the server reads of a target (``ServedTarget``, ``DescribedTarget``)
- ``batching``: exact call shapes (``BatchShapes``) and the call plan (``plan_calls``), pure
- ``recurrent``: the rollback/checkpoint plan for recurrent and hybrid models, pure
- ``backend``: importing llama_cpp (and its staging API, ``ext_module``; ``head_api``, the part of it that
  trained draft heads need and llama-cpp-python does not bind), its backend and log, GGUF file
  checks, quantizing, system info
- ``kernels``: which CPU backend runs (``KernelStatus``, ``kernel_status``): specstack's build of llama.cpp's
  ggml-cpu with its verification kernels, loaded before llama_cpp (``kernel_edits``: the edits to llama.cpp's tree;
  ``kernel_key``: what it is built for and its cache key; ``kernel_build``: the cmake build, cached once per key;
  ``kernel_tree``: a whole edited llama.cpp tree, for llama.cpp's own binaries on specstack's kernels)
- ``kv``: the KV cache's size before llama.cpp allocates it
- ``model``: ``LlamaModel`` loading, context, batches and calls
- ``memory``: sequences: reset, truncate, recurrent rollback and checkpoints, saved copies
- ``tree``: token trees in one batch
- ``vocab``: tokenizer (``Vocabulary``, and ``VocabModel`` for a vocabulary-only load)
- ``hidden``: the target's hidden rows kept for a drafter that reads them (``HiddenRowsTarget``)
- ``mtp``: a target's multi-token-prediction head on a context of its own (``MtpTarget``)
- ``heads``: a trained EAGLE-3 head GGUF on a context beside the target's (``LayerInputsTarget``)
- ``grammar_engine``: the constraint engine's interface (no llama_cpp): ``GrammarState``, ``GrammarTraits``,
  ``GrammarEngine``
- ``grammar``: llama.cpp's grammar engine, the one engine choice (``choose_engine``) and a vocabulary's engine
  (``GrammarCache``)
- ``schema_gbnf``: JSON schemas as GBNF grammars (llama.cpp's converter)
- ``guidance``: llguidance, the grammar engine that runs what it can read
"""

from .target import EngineTarget, GrammarTarget, HiddenRowsTarget, LayerInputsTarget, ModelConfig, MtpTarget, Target
from .backend import apply_builtin_chat_template, builtin_chat_templates, check_gguf_file, default_threads, llama_system_info, llama_version, quantize, set_numa, set_verbose, system_info
from .kernels import KernelStatus, flash_attention_is_exact, kernel_status, resolved_flash_attn
from .batching import INEXACT, PLAIN_ROWS, BatchShapes, Piece, Segment, plan_calls
from .model import LlamaModel
from .vocab import VocabModel

__all__ = [
    "EngineTarget", "GrammarTarget", "HiddenRowsTarget", "LayerInputsTarget", "ModelConfig", "MtpTarget", "Target",
    "apply_builtin_chat_template", "builtin_chat_templates", "check_gguf_file", "default_threads", "llama_system_info",
    "llama_version", "quantize", "set_numa", "set_verbose", "system_info", "INEXACT", "PLAIN_ROWS", "BatchShapes", "Piece", "Segment",
    "plan_calls", "LlamaModel", "VocabModel", "KernelStatus", "flash_attention_is_exact", "kernel_status", "resolved_flash_attn",
]
