"""The target contract, without llama_cpp: how to load a target (``ModelConfig``), what every target must do
(``Target`` for drafter factories, ``EngineTarget`` for the engine), and the optional capabilities as small
protocols of their own (``HiddenRowsTarget``, ``GrammarTarget``, ``MtpTarget``, ``LayerInputsTarget``), and what the server reads of a
role's target (``ServedTarget``).

``llama.LlamaModel`` implements all of them; ``bench.recorded.RecordedTarget`` (a run's recorded outputs, its
calls priced by the run's cost curve: replay) implements ``EngineTarget`` alone.  Whoever uses a capability
checks it once, where it sets up (``isinstance`` against the protocol: the engine in ``__init__``, the mtp
drafter when it is built), never by probing attributes at every step; a target the server reads declares what it
lacks in the protocol's own terms (``ServedTarget.grammar_engine`` returns None), not by leaving it out.  Reading
these needs no model and no llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .batching import BatchShapes, Segment
from ..errors import InvalidParameterError
from .kv import DEFAULT_KV_TYPE, check_kv_type, is_quantized
from .recurrent import DEFAULT_DEPTH, STRATEGIES, RewindStats
from ..types import HiddenRows

if TYPE_CHECKING:
    from .grammar_engine import GrammarEngine, GrammarState
    from ..modelfile.meta import GGUFInfo


DEFAULT_CTX = 4096  # positions per sequence when none is given: llama.cpp's default (-c 4096)


@dataclass(frozen=True)
class ModelConfig:
    """How to load a model.  n_ctx is per sequence: None means ``DEFAULT_CTX`` (or the trained context if
    shorter), 0 the model's trained context length, as llama.cpp's ``-c 0``.

    Why not the trained context by default: real models are trained for 32k-256k positions; a KV cache
    that size takes gigabytes and the one-time shape probe prefills it, which took minutes on 2 cores.
    """

    path: Path
    n_ctx: int | None = None
    n_threads: int = 0  # 0 = physical cores
    n_batch: int = 512
    # Shapes assumed until measured (``calibration.shapes.measure_shapes``): 2 pads a
    # one-token call, which was needed for exactness on every F16/F32 model
    # here.  Draft models use 1: their logits need not be exact.
    min_batch: int = 2
    # Generations held at once.  Above 1 each gets its own KV stream
    # (llama.cpp's non-unified cache): its cells then lie exactly as in a
    # solo run, which a shared cache cannot promise (cells of different
    # sequences interleave, which changed logits by ~3e-3 here).
    n_slots: int = 1
    # Branches a tree draft may have (llama.cpp sequences sharing one
    # unified cache); used only with one slot.
    n_seq_max: int = 1
    # None: unified iff n_slots == 1 (draft models share one cache); under --exact off a multi-slot
    # target is reopened unified, with flash attention (``calibration.open_for_mode``).
    unified: bool | None = None
    # llama-server's -kvu: the n_ctx cells are one pool in one unified cache that all n_slots sequences share;
    # any one may grow to n_ctx, all together to n_ctx (``LlamaModel.pool``), so the cache is -c, not -np x -c.
    # The engine keeps the pool from running over (``Engine._pool_left``).  Attention-only, several slots: a
    # recurrent state is per slot, and one slot has its n_ctx anyway.
    kv_pool: bool = False
    # Off: batches of 2..512 rows then agree bit for bit on F16 and Q8_0 here.
    # With flash attention a one-row call matched 2-3 row calls at the KV length
    # measured, yet greedy output broke at a longer one (its single-row path
    # depends on the KV length), so exactness could not be measured reliably.
    # On only without exactness, where it is worth +4-5% plain decoding on Gemma 3 270M at -t 1 and +1-2% at
    # -t 2, more deeper in. None (auto): off until ``calibration.open_for_mode`` knows exactness is off (a
    # cached ``--exact auto`` verdict), then the context is reopened with it; --exact off turns it on at load.
    flash_attn: bool | None = None
    # The KV cache's types (llama.cpp's -ctk/-ctv: ``kv.KV_TYPES``).  Exact shapes are measured per pair (the cache
    # key holds them): a q8_0 K cache rounds K, so its logits differ from f16's, but batches agree with each other
    # as on f16.  A quantized V cache needs flash attention in llama.cpp (llama_init_from_model), so it is
    # refused without ``flash_attn`` True, and therefore runs without exactness (see ``flash_attn``).
    type_k: str = DEFAULT_KV_TYPE
    type_v: str = DEFAULT_KV_TYPE
    # llama.cpp's model kv_overrides (--override-kv): (key, value) pairs, the value's Python type its type (int, float,
    # bool or str), which llama.cpp reads in place of the GGUF's own metadata
    kv_overrides: tuple[tuple[str, int | float | bool | str], ...] = ()
    # An MoE model run with this many active experts (lossy for a target): checked against the metadata the load
    # reads, and loaded as the ``{arch}.expert_used_count`` entry of ``kv_overrides`` (which the load's config holds)
    experts: int | None = None
    prefill_chunk: int = 128  # prompt tokens per call; chunk edges sit at multiples of it
    repack: bool = True  # llama.cpp's CPU weight repacking (faster; measured shapes account for it)
    # Targets: every call asks for logits of all its rows, as the shape measurement
    # does (the output count selects kernels of the last layer).  Draft models ask
    # only for the rows they read.
    exact: bool = True
    # Recurrent/hybrid models (see ``recurrent``): "auto" rolls back where the
    # architecture can, else checkpoints; ``rollback_depth`` is n_rs_seq.
    rollback: str = "auto"
    rollback_depth: int = DEFAULT_DEPTH
    # Multi-token prediction: load the GGUF's NextN layers (llama.cpp's load_mtp), which ``--drafter mtp`` drafts
    # from. None: load them where the file has NextN layers this llama.cpp has an MTP graph for, so any request
    # may draft with them; the trunk is the same either way (tested), the cost is the NextN block's memory.
    load_mtp: bool | None = None
    use_mmap: bool = True  # llama.cpp's --no-mmap: False reads the weights into memory
    use_mlock: bool = False  # llama.cpp's --mlock: keep the weights in RAM
    direct_io: bool = False  # llama.cpp's --load-mode dio: read the weights with direct I/O (where the OS has it)
    # Threads of calls of more than one row (prompt chunks, verification), llama.cpp's n_threads_batch; 0: n_threads
    n_threads_batch: int = 0
    # llama_context_params fields set as given (``CONTEXT_PARAMS``: RoPE scaling, YaRN), and llama_model_params ones
    # (``MODEL_PARAMS``: lazy_mode, check_tensors), in place of llama.cpp's defaults
    context_params: tuple[tuple[str, float], ...] = ()
    model_params: tuple[tuple[str, int], ...] = ()
    special: bool = False  # llama.cpp's --special: a token's text spells special tokens out (``Vocabulary.token_bytes``)
    # Where n_ctx came from, in the user's words, for the warning when it passes the trained context ("": -c as
    # given).  A draft model takes the target's context, which the user may never have set.
    ctx_origin: str = ""

    def __post_init__(self) -> None:
        if self.rollback not in STRATEGIES:
            raise InvalidParameterError(f"rollback must be one of {', '.join(STRATEGIES)} (got {self.rollback!r})")
        if not 2 <= self.rollback_depth <= 256:
            raise InvalidParameterError(f"rollback depth (n_rs_seq) must be in 2..256 (got {self.rollback_depth})")
        if self.n_threads < 0:
            raise InvalidParameterError(f"threads must be >= 0 (got {self.n_threads}); 0 means one per physical core")
        if self.n_ctx is not None and self.n_ctx < 0:
            raise InvalidParameterError(f"the context size must be >= 0 (got {self.n_ctx}); 0 means the model's own")
        if self.n_slots < 1 or self.n_batch < 1:
            raise InvalidParameterError(f"slots and batch size must be >= 1 (got {self.n_slots}, {self.n_batch})")
        check_kv_type(self.type_k, "the K cache type")
        check_kv_type(self.type_v, "the V cache type")
        if is_quantized(self.type_v) and self.flash_attn is not True:
            raise InvalidParameterError(f"a {self.type_v} V cache needs flash attention (llama.cpp refuses a quantized "
                                        "V cache without it): load with flash_attn True")
        if self.n_threads_batch < 0:
            raise InvalidParameterError(f"batch threads must be >= 0 (got {self.n_threads_batch}); 0 means as n_threads")
        for given, known in ((self.context_params, CONTEXT_PARAMS), (self.model_params, MODEL_PARAMS)):
            unknown = sorted({name for name, _ in given} - set(known))
            if unknown:
                raise InvalidParameterError(f"unknown llama.cpp parameters {', '.join(unknown)}; known: "
                                            f"{', '.join(known)}")

    def load_mode(self) -> int:
        """llama.cpp's ``llama_model_params.load_mode`` (``enum llama_load_mode``) for the mmap, mlock and direct I/O
        options: this llama.cpp has no use_mmap/use_mlock fields, and setting those on its ctypes struct changed
        nothing (--no-mmap and --mlock were silently ignored)."""
        if self.direct_io:
            return 4  # LLAMA_LOAD_MODE_DIRECT_IO
        return {(True, False): 1, (False, False): 0, (False, True): 2, (True, True): 3}[(self.use_mmap, self.use_mlock)]


# The llama_context_params and llama_model_params fields ``ModelConfig`` may set (llama.cpp's flags of those names)
CONTEXT_PARAMS = ("rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
                  "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx")
MODEL_PARAMS = ("lazy_mode", "check_tensors")


class Target(Protocol):
    """What drafter factories may read from a target (``BuildContext.target``).

    ``LlamaModel`` implements it, and so does ``bench.recorded.RecordedTarget``
    (a results file's recorded outputs, no model loaded).
    """

    path: Path | None
    n_vocab: int
    n_ctx: int  # positions per sequence
    n_threads: int
    n_slots: int  # generations held at once (one KV stream each when > 1)
    capacity: int  # positions usable by real tokens (padding needs spare ones)


@runtime_checkable
class PooledTarget(Protocol):
    """A target whose sequences may share one pool of KV cells (``ModelConfig.kv_pool``): ``pool`` cells in all,
    None where each sequence has its own ``n_ctx``.  The engine checks it once and then keeps every step, prompt
    and draft within the pool's free cells."""

    pool: int | None


class EngineTarget(Target, Protocol):
    """A target the engine can run: tokenizer, sequences, exact batch shapes, tree batches."""

    config: ModelConfig
    unified: bool
    n_seq_max: int
    shapes: BatchShapes
    seq_len: list[int]
    writes: list[int]
    tree_relayouts: int
    gate: AbstractContextManager  # entered around every llama.cpp call (``calibration.background.Gate``)
    # recurrent/hybrid models (``recurrent``): how rejected tokens leave the state
    is_recurrent: bool
    memory: str
    strategy: str
    max_draft: int
    rewind: RewindStats

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def eog_ids(self) -> frozenset[int]: ...
    def decode(self, segments: Sequence[Segment]) -> list[np.ndarray | None]: ...
    def prefill(self, tokens: Sequence[int], seq: int = 0) -> None: ...
    def truncate(self, n_keep: int, seq: int = 0) -> None: ...
    def can_truncate(self, n_keep: int, seq: int = 0) -> bool: ...
    def checkpoint(self, seq: int = 0) -> None: ...
    def protect(self, seq: int, n: int, one_call: bool = True) -> None: ...
    def reset(self, seq: int | None = None) -> None: ...
    # a sequence's state as bytes: the host prompt cache and copies between sequences (``engine._swap``)
    def save_seq(self, seq: int) -> bytes: ...
    def load_seq(self, seq: int, data: bytes, n_tokens: int) -> bool: ...
    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray: ...
    def commit_tree(self, path: Sequence[int]) -> None: ...
    # shape measurement and cost calibration
    batch_cap: int
    min_batch: int
    bos_id: int

    def raw_call(self, tokens: Sequence[int], outputs: bool = True, seq: int = 0, pad: int = 0,
                 pad_logits: bool | None = None) -> np.ndarray: ...
    def set_shapes(self, shapes: BatchShapes) -> None: ...


@runtime_checkable
class HiddenRowsTarget(Protocol):
    """A target that keeps its hidden rows for a drafter that reads them (``llama.hidden``; ``Drafter.needs_hidden``)."""

    def take_hidden(self, seq: int) -> HiddenRows | None:
        """The rows kept for ``seq`` since the last take (None where none are kept)."""


@runtime_checkable
class GrammarTarget(Protocol):
    """A target that can enforce a GBNF grammar over its vocabulary (``constraints.Constraints.grammar``), through
    its vocabulary's grammar engine (``llama.grammar_engine``: which engine runs a grammar is the engine's choice)."""

    def grammar(self, gbnf: str) -> "GrammarState":
        """A fresh parse state of ``gbnf`` at its start."""

    def grammar_engine(self) -> "GrammarEngine":
        """The vocabulary's grammar engine: grammars prepared ahead, off the caller's thread, and its warm-up."""

    def adopt_grammars(self, keeper: "GrammarTarget") -> None:
        """Take ``keeper``'s grammar engine as this target's (the same vocabulary, loaded apart: a sleeping role's
        grammars outlive its freed model)."""


@runtime_checkable
class MtpTarget(HiddenRowsTarget, Protocol):
    """A loaded target whose NextN (multi-token-prediction) head ``--drafter mtp`` drafts from, with the GGUF
    metadata it was loaded from (read once, at load: the drafter checks the head against it).  The head reads
    the target's hidden rows, so such a target keeps them once asked (``want_hidden``)."""

    meta: "GGUFInfo"

    def open_mtp(self, assistant: Path | None = None) -> Any:
        """The head's context over this target (``llama.mtp.MtpContext``)."""

    def want_hidden(self) -> None:
        """From now on keep every call's hidden rows for ``take_hidden``."""


@runtime_checkable
class LayerInputsTarget(HiddenRowsTarget, Protocol):
    """A loaded target a trained EAGLE-3 or DFlash head drafts for: the head on a context beside it (``open_eagle3``,
    ``open_dflash``), and the inputs of the target layers the head names kept per token (``want_hidden(layers)``,
    ``llama.hidden``), with the GGUF metadata it was loaded from (the drafter checks the head's fit against it)."""

    meta: "GGUFInfo"

    def open_eagle3(self, head: Path) -> Any:
        """The head's context beside this target (``llama.heads.Eagle3Context``)."""

    def open_dflash(self, head: Path) -> Any:
        """The head's context beside this target (``llama.heads.DFlashContext``)."""

    def want_hidden(self, layers: tuple[int, ...] | None = None) -> None:
        """From now on keep every call's inputs of target ``layers``, side by side, for ``take_hidden``."""


class DescribedTarget(Protocol):
    """What the server's read-only endpoints (``/props``, ``/slots``, ``/health``) read of a role's target: sizes,
    exactness and the special tokens, which a sleeping role keeps (``server.sleep.AsleepTarget``)."""

    n_vocab: int
    n_ctx: int
    capacity: int
    shapes: Any  # exactness as measured: ``settled``, ``exact``, ``why`` (``BatchShapes``, or a replica's report)
    bos_id: int  # -1: none (llama.cpp's LLAMA_TOKEN_NULL)
    eos_id: int

    def token_bytes(self, token: int) -> bytes: ...
    def special_text(self, token: int) -> str: ...
    def eog_ids(self) -> frozenset[int]: ...


class ServedTarget(DescribedTarget, Protocol):
    """What the server reads of an awake role's target: ``llama.LlamaModel`` (a role's worker) and
    ``server.scaleout.remote.RemoteTarget`` (a Ray ingress: the vocabulary alone, the engines in the replicas)."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def split_special(self, text: str) -> list[str | int]: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def grammar_engine(self) -> "GrammarEngine | None":
        """The grammar engine that prepares a request's grammar before it is queued; None where there is none here
        (a Ray ingress: the replica that runs the request builds it)."""
