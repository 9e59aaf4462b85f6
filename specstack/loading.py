"""One way to load a target and build what runs on it: its drafter, its k policy, its engine.

The CLI (``commands/``), the server's roles (``server.worker``), Ray replicas and the bench all load
through ``load_target(TargetSpec)`` (or ``load_calibrated``, which also hands back the cost model and a first
run's background measurement), so a model option exists once and every caller gets all of them: a
serve role runs with fewer MoE experts (lossy, and labelled so) or verifies trees exactly as ``generate``
does. Each load calibrates its target once, through ``calibration.calibrate_target``, and ``build_engine``
puts a loaded target, a drafter, a policy and that calibration together. The library builds here;
``commands/`` only turns flags into a ``TargetSpec``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .calibration import Calibration, calibrate, calibrate_target, exact_mode
from .draft_length import DEFAULT_K, DEFAULT_K_MAX, DraftLengthPolicy, make_policy
from .draft_length.costs import CostModel
from .drafters import DEFAULT_DRAFTER, BuildContext, create
from .drafters.base import Asked, Drafter, needs_of, reads_draft_model
from .engine import Engine
from .errors import InvalidParameterError
from .paths import DEFAULT_DRAFT, DEFAULT_TARGET
from .llama import LlamaModel, ModelConfig, flash_attention_is_exact
from .llama.target import EngineTarget
from .llama.kv import DEFAULT_KV_TYPE, check_kv_type, is_quantized
from .llama.recurrent import DEFAULT_DEPTH

if TYPE_CHECKING:
    from .modelfile.meta import GGUFInfo

DEFAULT_TREE_BRANCHES = 8


@dataclass(frozen=True)
class TargetSpec:
    """Every option of a target model, as ``generate``'s flags and a roles file's keys give them.

    ``experts`` below the model's own count is lossy: the output is no longer the model's
    (``experts_of`` labels it). ``tree_branches`` are the llama.cpp sequences a tree draft may use; only
    a one-slot target verifies trees (a multi-slot one asks drafters for chains).
    """

    model: Path = DEFAULT_TARGET
    ctx: int | None = None  # per slot; None: 4096 or the trained context if shorter; 0: the trained context
    threads: int = 0  # 0: one per physical core
    slots: int = 1
    exact: str = "auto"
    # llama-server's -kvu: the slots share one KV pool of ``ctx`` cells (``ModelConfig.kv_pool``), so their cells
    # interleave and no call shape keeps a slot's output that of a solo run: exactness is off (``on`` refused)
    kv_pool: bool = False
    experts: int | None = None
    rollback: str = "auto"
    rollback_depth: int = DEFAULT_DEPTH
    tree_branches: int = DEFAULT_TREE_BRANCHES
    kv_overrides: tuple[tuple[str, int | float | bool | str], ...] = ()  # --override-kv (``ModelConfig``'s)
    # llama.cpp's loading flags: -fa (None: auto, on exactly where exactness is off, since exact shapes are measured
    # without it), -ub/-b (the physical batch, n_ubatch: the most rows one call decodes), --no-mmap, --mlock,
    # -ctk/-ctv (the KV cache's types, ``llama.kv.KV_TYPES``; a quantized V cache needs flash attention, so -fa auto
    # turns it on there, as llama-server's does, and so it needs --exact off)
    flash_attn: bool | None = None
    batch: int = 512
    mmap: bool = True
    mlock: bool = False
    cache_type_k: str = DEFAULT_KV_TYPE
    cache_type_v: str = DEFAULT_KV_TYPE
    # and -tb, --load-mode dio, -nr, --special, RoPE/YaRN (context_params), --lazy-mode and --check-tensors
    # (model_params): ``ModelConfig``'s fields of those names
    threads_batch: int = 0
    direct_io: bool = False
    repack: bool = True
    special: bool = False
    context_params: tuple[tuple[str, float], ...] = ()
    model_params: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        exact_mode(self.exact)  # refuses an unknown mode by name
        check_kv_type(self.cache_type_k, "-ctk (the K cache type)")
        check_kv_type(self.cache_type_v, "-ctv (the V cache type)")
        if self.shares_pool and exact_mode(self.exact) == "on":
            raise InvalidParameterError(f"--exact on cannot go with -kvu and {self.slots} slots: their KV pool "
                                        "interleaves the slots' cells, which changes logits against a solo run "
                                        "(~1e-3), so no call shape keeps output identical to plain decoding; leave "
                                        "-kvu out (each slot its own cells: -c is shared out) or use --exact off")
        if is_quantized(self.cache_type_v):
            check_quantized_v(self.cache_type_v, self.flash_attn, self.exact_in_force)
        if self.flash_attn and self.exact_in_force != "off" and not flash_attention_is_exact():
            raise InvalidParameterError(f"flash attention (-fa on) needs --exact off (got --exact {self.exact}): exact "
                                        "call shapes are measured without it, and its one-row path depends on the KV "
                                        "length; use -fa auto, or --exact off")
        if self.batch < 1:
            raise InvalidParameterError(f"the batch size must be >= 1 (got {self.batch})")
        if self.tree_branches < 1:
            raise InvalidParameterError(f"tree branches must be >= 1 (got {self.tree_branches})")
        if self.experts is not None and self.experts < 1:
            raise InvalidParameterError(f"experts must be >= 1 (got {self.experts})")

    @property
    def shares_pool(self) -> bool:
        """Whether the slots share one KV pool (-kvu with several slots): exactness is then off."""
        return self.kv_pool and self.slots > 1

    @property
    def exact_in_force(self) -> str:
        """--exact as it can hold: off where the slots share a pool (``kv_pool``), else as given."""
        return "off" if self.shares_pool else exact_mode(self.exact)

    @property
    def verifies_trees(self) -> bool:
        """Whether a target loaded from this spec can verify tree drafts (one slot, several sequences)."""
        return self.slots == 1 and self.tree_branches > 1

    def model_config(self) -> ModelConfig:
        """The llama.cpp-level config. ``--exact off`` promises no exactness, so flash attention is on from the
        start (+4-5% plain decoding on Gemma 3 270M at -t 1); ``auto`` learns its verdict only from a context,
        so its flash attention is auto too (``open_for_mode`` reopens the target once it knows)."""
        return ModelConfig(path=Path(self.model), n_ctx=self.ctx, n_threads=self.threads,
                           n_seq_max=self.tree_branches, n_slots=self.slots, kv_overrides=self.kv_overrides,
                           experts=self.experts, rollback=self.rollback, rollback_depth=self.rollback_depth,
                           flash_attn=self._flash_attn(), n_batch=self.batch, use_mmap=self.mmap, use_mlock=self.mlock,
                           type_k=self.cache_type_k, type_v=self.cache_type_v,
                           n_threads_batch=self.threads_batch, direct_io=self.direct_io, repack=self.repack,
                           special=self.special, context_params=self.context_params, model_params=self.model_params,
                           kv_pool=self.kv_pool)

    def _flash_attn(self) -> bool | None:
        """-fa as given; -fa auto follows --exact: on under off, off under on, and under auto None, which
        ``open_for_mode`` settles once the verdict is known.  Where specstack's CPU backend makes flash attention
        exact (``llama.flash_attention_is_exact``) it is None under on too: the loaded file decides
        (``llama.resolved_flash_attn``: on for the weight types its kernels take)."""
        if self.flash_attn is not None:
            return self.flash_attn
        if flash_attention_is_exact() and self.exact_in_force != "off":
            return None  # the loaded file decides (``llama.resolved_flash_attn``)
        return {"off": True, "auto": None, "on": False}[self.exact_in_force]


def check_quantized_v(kind: str, flash_attn: bool | None, exact: str, exact_flag: str = "--exact") -> None:
    """A quantized V cache (-ctv ``kind``) needs flash attention, which llama.cpp requires for one
    (llama_init_from_model: -fa auto turns it on, -fa off is an error), and so exactness off, since exact call
    shapes are measured without flash attention.  Refused, naming what to pass, where either is not so."""
    if flash_attn is False:
        raise InvalidParameterError(f"-ctv {kind} needs flash attention (llama.cpp refuses a quantized V cache "
                                    "without it): use -fa on, or leave -fa out")
    if exact != "off":
        raise InvalidParameterError(f"-ctv {kind} cannot go with {exact_flag} {exact}: llama.cpp runs a quantized V "
                                    "cache with flash attention (-fa on) only, and exact call shapes are measured "
                                    f"without it; quantize only K (-ctk {kind}) to keep exactness, or pass {exact_flag} "
                                    "off")


@dataclass(frozen=True)
class SpeculationSpec:
    """How a generation speculates, as typed values: the drafter (plain, ``cascade:...`` or ``fusion:...``), its
    options by name (None: the config default), the k policy, k and k_max. One type for every caller: a command's
    flags (``RunSpec.speculation``), a server role's defaults (``Role.speculative``) and a request's ``speculative``
    object over them (``with_request``), which the worker builds from (``build_drafter``, ``build_policy``).

    A request's JSON keeps its shape: the four settings by their field names, every other key a drafter option
    (``with_request``, ``settings``). ``requested``: the keys a request set, which its errors name (empty for a
    role's or a command's own)."""

    drafter: str = DEFAULT_DRAFTER
    k_policy: str = "fixed"
    k: int = DEFAULT_K
    k_max: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    requested: frozenset[str] = field(default=frozenset(), compare=False)

    @staticmethod
    def setting_names() -> tuple[str, ...]:
        """The settings a ``speculative`` object names beside drafter options: drafter, k_policy, k, k_max."""
        return tuple(f.name for f in fields(SpeculationSpec) if f.name not in ("options", "requested"))

    def with_request(self, request: Mapping[str, Any]) -> "SpeculationSpec":
        """These settings with a request's ``speculative`` keys (``request``, checked by the caller) over them."""
        named = self.setting_names()
        return replace(self, **{k: v for k, v in request.items() if k in named},
                       options={**self.options, **{k: v for k, v in request.items() if k not in named}},
                       requested=frozenset(request))

    def settings(self) -> dict[str, Any]:
        """The settings as responses report them (``speculative`` in /props and ``generation_settings``)."""
        return {name: getattr(self, name) for name in self.setting_names()}


@dataclass(frozen=True)
class RunSpec:
    """A command's run as typed values, read from its flags once (``commands/common.run_spec``): the target, how it
    speculates (``SpeculationSpec``) and the grammar. ``load_run`` checks it against the model files and
    loads its target; ``build_run`` builds its engine there. Flag-level checks (names, ranges) are the
    caller's, in the words the user typed; what needs the files is here, once."""

    target: TargetSpec = TargetSpec()
    speculation: SpeculationSpec | None = None  # None: the command builds no drafter of its own (bench, tune)
    temperature: float = 0.0
    grammar: str | None = None
    note_mtp: bool = False  # say so when the model ships an MTP head and no drafter was chosen
    command: str = "specstack"

    @property
    def cost_rows(self) -> int | None:
        """Rows of the cost curve the k policy prices with (None: it needs none)."""
        spec = self.speculation
        if spec is None or spec.k_policy != "cost" or spec.drafter == "none":
            return None
        return (spec.k_max or DEFAULT_K_MAX) + 1


def load_run(run: RunSpec, *, background: bool = False, prefix: str = "specstack") -> tuple[RunSpec, Calibration]:
    """``run`` checked against its model files (``preflight``), then its target loaded and calibrated
    (``load_calibrated``, with a cost curve where the policy prices; ``background``: what the cache lacks measured
    beside the first generations). Returns the run with its draft settled, and the calibration."""
    run = preflight(run)
    return run, load_calibrated(run.target, n_max=run.cost_rows, background=background, prefix=prefix)


def preflight(run: RunSpec) -> RunSpec:
    """Every check that needs the model files but no load, once, before the target loads (a big model's load and
    first shape probe take minutes): the grammar on the model's vocabulary, then, from the target's GGUF metadata
    read here once, what the drafters need of it (``settle_drafts``). Returns the run with its draft settled.
    (--experts is checked by the load, against the metadata it reads before the weights.)"""
    from .llama.vocab import check_grammar
    from .modelfile.meta import read_gguf

    meta = read_gguf(run.target.model, tensors=False, role="target")
    check_grammar(meta.path, run.grammar)
    if run.speculation is None:
        return run
    return replace(run, speculation=replace(run.speculation, options=settle_drafts(run, meta)))


def settle_drafts(run: RunSpec, meta: "GGUFInfo") -> dict[str, Any]:
    """The drafter options of ``run`` with its draft model settled from the target's metadata ``meta``: what each
    drafter needs of the target checked (its ``Needs.check``: mtp's head, or its assistant; moe-self's experts),
    or a note that the model has an MTP head where no drafter was chosen; the draft model where a drafter
    reads one (``resolve_draft``: the bundled draft only where it fits the target, and a given file read, so a
    broken -md fails in milliseconds), and -md refused where nothing reads it."""
    from .drafters.mtp import NAME as MTP, note_mtp
    from .modelfile.meta import read_gguf

    spec = run.speculation
    options = dict(spec.options)
    draft = options.get("draft_model")
    built = needs_of(spec.drafter)  # what the name builds (checked with the flags), a cascade's parts too
    assistant = None
    for part, needs in built.items():  # each checked in the words a user types for it alone: "--drafter mtp"
        if needs.check is not None:
            assistant = needs.check(meta, Asked(f"--drafter {part}", options)) or assistant
    if run.note_mtp and MTP not in built:
        note_mtp(meta, run.command)  # the model ships a draft head: say so, once
    if reads_draft_model(spec.drafter):
        options["draft_model"] = resolve_draft(meta, draft)
        read_gguf(options["draft_model"], tensors=False)
    elif draft is not None and assistant is None:
        raise InvalidParameterError(f"-md {draft} is used by --drafter draft-model (alone or in a cascade or fusion), "
                                    f"by mtp on a gemma4 target (its assistant) and by eagle3 and dflash (their heads), which "
                                    f"{spec.drafter!r} does not use; leave -md out or add draft-model")
    return options


def build_run(calibration: Calibration, run: RunSpec) -> Engine:
    """The engine of ``run`` on its loaded target: its k policy priced with the calibration's cost model, and its
    drafter with its options (none where the command builds none)."""
    spec = run.speculation or SpeculationSpec(drafter="none")
    return build_engine(calibration, spec.drafter, spec.k_policy, k=spec.k, k_max=spec.k_max,
                        drafter_options=spec.options, temperature=run.temperature)


def load_target(spec: TargetSpec, role: str = "target", measure: bool = False, prefix: str = "specstack") -> LlamaModel:
    """The target of ``spec``, opened for its ``--exact`` mode, announced on stderr, its exact call shapes
    measured now (once per model, cached): ``load_calibrated``'s target, without a cost model.

    ``measure``: where auto's verdict is not cached, measure it now, since it fixes how a multi-slot target's
    slots share the KV cache (a server; ``calibration.open_for_mode``).
    """
    return load_calibrated(spec, role, measure=measure, prefix=prefix).target


def load_calibrated(spec: TargetSpec, role: str = "target", *, n_max: int | None = None, background: bool = False,
                    measure: bool = False, prefix: str = "specstack") -> Calibration:
    """The target of ``spec`` and its calibration (``calibration.calibrate_target``, called once here): the
    target opened for its ``--exact`` mode and announced on stderr, its shapes, the cost model of ``n_max``
    rows (None: none), and, with ``background``, what the cache lacks measured beside the first generations
    (hand the result to ``build_engine``, which wires it into the engine)."""
    target = LlamaModel(spec.model_config(), role=role)
    return calibrate_target(target, spec.exact, n_max=n_max, background=background, measure=measure,
                            opened=lambda opened: announce_load(opened, prefix))


def announce_load(model: LlamaModel, prefix: str = "specstack") -> None:
    """One line on stderr, terminal or not: what was loaded, its context and its KV cache's size."""
    kv = f"; {model.kv.describe()}" if model.kv is not None else ""
    print(f"{prefix}: loaded {model.path.name} ({model.n_ctx_train} trained positions): context {model.n_ctx} per "
          f"sequence{kv}", file=sys.stderr, flush=True)


def experts_of(meta: "GGUFInfo", experts: int | None) -> dict[str, Any] | None:
    """An MoE target's experts, from its GGUF metadata (``meta``: a loaded target's ``LlamaModel.meta``, read once
    at load): how many it has, uses by default, and runs with; ``lossy`` if fewer.

    None for a dense target. Every output of a reduced-expert run carries this label (``lossy_label``).
    """
    if not meta.expert_count:
        return None
    used = meta.expert_used_count
    running = experts or used
    return {"count": meta.expert_count, "model_used": used, "used": running, "lossy": running != used}


def lossy_label(info: Mapping[str, Any] | None) -> str | None:
    """The words every output of a lossy run carries (None when the run is the model's own)."""
    if not info or not info["lossy"]:
        return None
    return (f"LOSSY: the target runs {info['used']} of {info['count']} experts (the model uses {info['model_used']}); "
            "output is not the model's own")


def build_drafter(name: str, target: LlamaModel, options: Mapping[str, Any] | None = None,
                  temperature: float = 0.0) -> Drafter:
    """The drafter ``name`` (plain, ``cascade:...`` or ``fusion:...``) for ``target``, with its options by name."""
    return create(name, BuildContext(target=target, options=dict(options or {}), temperature=temperature))


def build_policy(name: str, k: int, k_max: int | None = None, costs: CostModel | None = None,
                 target: LlamaModel | None = None) -> DraftLengthPolicy:
    """The k policy ``name``; ``cost`` prices with ``costs``, or calibrates ``target``'s t(n) first (cached)."""
    if name == "cost" and costs is None and target is not None:
        costs = calibrate(target, n_max=(k_max or DEFAULT_K_MAX) + 1)  # its shapes are settled already (load)
    return make_policy(name, k, costs=costs, k_max=k_max)


def build_engine(loaded: Calibration | EngineTarget, drafter: Drafter | str = "none",
                 policy: DraftLengthPolicy | str | None = None, *, k: int = DEFAULT_K, k_max: int | None = None,
                 drafter_options: Mapping[str, Any] | None = None, temperature: float = 0.0,
                 prompt_cache_bytes: int = 0, batch_tokens: int | None = None,
                 prefill_cap: int | None = None, clock: Callable[[], float] | None = None) -> Engine:
    """An engine over a loaded target (``load_calibrated``'s ``Calibration``, or a target ``load_target`` gave; the
    bench's replay hands a recorded one), with its drafter (an instance, or a name built by ``build_drafter`` with
    ``drafter_options``) and its k policy (an instance, or a name built by ``build_policy`` with ``k``, ``k_max``
    and the calibration's cost model; None: ``fixed``, k tokens a step). A first run's background measurement goes
    to the engine, which lends it time between steps and applies its result. ``clock``: what the engine times steps
    by (None: the wall clock; a replay's, its target calls as priced)."""
    calibration = loaded if isinstance(loaded, Calibration) else Calibration(loaded)
    target = calibration.target
    if isinstance(drafter, str):
        drafter = build_drafter(drafter, target, drafter_options, temperature)
    if policy is None or isinstance(policy, str):
        policy = build_policy(policy or "fixed", k, k_max=k_max, costs=calibration.costs, target=target)
    timing = {} if clock is None else {"clock": clock}
    return Engine(target, drafter, policy, prompt_cache_bytes=prompt_cache_bytes, background=calibration.background,
                  batch_tokens=batch_tokens, prefill_cap=prefill_cap, **timing)


def resolve_draft(meta: "GGUFInfo", draft: Path | None, where: str = "--drafter draft-model",
                  fix: str = "-md {path}") -> Path:
    """The draft GGUF that draft-model uses for the target of ``meta`` (its GGUF metadata): ``draft`` if given,
    else the bundled one, but only where it can draft by id for the target: the bundled target, or a model
    ``check`` finds identical or compatible (then said, on stderr).

    The bundled draft used to be a silent default for any -m: on Gemma 3 270M it spells 1.5% of the target's
    tokens alike, so it drafted almost nothing while the user believed draft-model was being measured."""
    if draft is not None:
        return draft
    report = bundled_draft_check(meta)
    model = Path(meta.path)
    if report is None:
        return DEFAULT_DRAFT
    if bundled_draft_fits(report):
        print(f"specstack: note: {where} drafts with the bundled {DEFAULT_DRAFT.name}, whose vocabulary is "
              f"{report.verdict} with {model.name}'s ({fix.format(path='DRAFT.gguf')} chooses another)",
              file=sys.stderr, flush=True)
        return DEFAULT_DRAFT
    overlap = report.scores.get("text_overlap")
    share = f" ({overlap:.1%} of the target's tokens spelled alike)" if overlap is not None else ""
    raise InvalidParameterError(
        f"{where} needs a draft model for {model.name}: give one with {fix.format(path='DRAFT.gguf')}, a "
        f"smaller model with the same vocabulary (`specstack models scan DIR` lists them). The bundled "
        f"{DEFAULT_DRAFT.name} is the default only where `specstack check` finds its vocabulary identical or "
        f"compatible; with {model.name} it is "
        f"{report.verdict}{share}. To draft with it anyway, give it with {fix.format(path=DEFAULT_DRAFT)}")


def bundled_draft_check(meta: "GGUFInfo") -> Any:
    """``check``'s report on the bundled draft drafting for the target of ``meta`` (its GGUF metadata, read once by
    the caller); None for the bundled target: the pair."""
    if Path(meta.path).resolve() == DEFAULT_TARGET.resolve():
        return None
    from .modelfile.compat import compare
    from .modelfile.meta import read_gguf

    return compare(meta, read_gguf(DEFAULT_DRAFT, tensors=False))


def bundled_draft_fits(report: Any) -> bool:
    """Whether a ``bundled_draft_check`` report lets the bundled draft be a default: ids shared, not translated."""
    from .modelfile.compat import COMPATIBLE, IDENTICAL

    return report is None or report.verdict in (IDENTICAL, COMPATIBLE)


def role_draft(model: Path, draft: Path | None) -> Path | None:
    """The draft a server role's draft-model uses: its own, else the bundled one where it fits ``model`` (the
    bundled target, or a vocabulary ``check`` finds identical or compatible), else None: no draft."""
    if draft is not None:
        return draft
    from .modelfile.meta import read_gguf

    return DEFAULT_DRAFT if bundled_draft_fits(bundled_draft_check(read_gguf(model, tensors=False))) else None
