"""Roles: the models a server offers, each with its own draft, drafter stack, k policy and resources.

A roles file is TOML, one ``[roles.NAME]`` table per model; the request's
``model`` field picks the role (the first one is the default)::

    [roles.frontdoor]               # fast answers
    model = "small.gguf"
    drafter = "prompt-lookup"
    parallel = 4

    [roles.coder]
    model = "coder-7b-q4_k_m.gguf"
    draft = "coder-0.5b-q8_0.gguf"
    drafter = "cascade:suffix,prompt-lookup,draft-model"
    k_policy = "cost"
    threads = 16
    ctx = 8192

    [roles.architect]               # slow and careful: a tuned profile
    model = "big-q4_k_m.gguf"
    draft = "big-draft.gguf"
    profile = "architect.toml"      # from `specstack tune`; its [default] sets drafter/k_policy/k

Relative paths are relative to the roles file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..draft_length import POLICIES
from ..drafters.base import DEFAULT_DRAFTER
from ..drafters.options import check_drafter_options, inapplicable
from ..sampling import SamplingParams
from ..calibration import exact_mode
from ..gbnf import check_gbnf
from ..errors import InvalidParameterError
from ..paths import DEFAULT_TARGET
from ..profiles import load_profile, read_toml
from ..loading import DEFAULT_TREE_BRANCHES, SpeculationSpec, TargetSpec
from ..llama.kv import DEFAULT_KV_TYPE, KV_TYPES, is_quantized
from ..llama.recurrent import DEFAULT_DEPTH, STRATEGIES
from .request_constraints import ConstraintDefaults
from .tools.reasoning import FORMATS as REASONING_FORMATS


@dataclass(frozen=True)
class Role:
    """One served model and its speculation defaults (a request's ``speculative`` may override them)."""

    name: str
    model: Path = DEFAULT_TARGET
    # None: not given.  The bundled draft then serves the bundled target, and another model only where `specstack
    # check` finds its vocabulary identical or compatible (``commands.common.resolve_draft``, before serving).
    draft: Path | None = None
    drafter: str = DEFAULT_DRAFTER
    k_policy: str = "cost"
    k: int = 4
    k_max: int | None = None
    threads: int = 0
    ctx: int | None = None  # per slot; None = 4096 (or the trained context if shorter), 0 = the trained context
    parallel: int = 4  # slots: generations decoded together
    # llama-server's -kvu: the slots share one KV pool of ctx cells (any one may fill it; a generation that finds
    # it full ends with finish_reason length), instead of ctx each; exactness is then off (``TargetSpec.kv_pool``)
    kv_unified: bool = False
    exact: str = "auto"  # auto, on or off (``calibration.exact_mode``; true/false read as on/off)
    rollback: str = "auto"  # recurrent/hybrid targets: auto, rollback or checkpoint (``recurrent``)
    cache_mb: int = 512  # host memory for finished prompts' KV (restored instead of prefilled)
    # Prompts are processed inside decode steps: per step at most batch_tokens rows (the running generations'
    # first), at most prefill_cap of one prompt (``Engine._prefill_some``); batch_tokens 0: whole at admission.
    batch_tokens: int = 512
    prefill_cap: int = 256
    profile: Path | None = None
    category: str | None = None
    chat_template: str | None = None  # a Jinja file or a llama.cpp built-in name (``chat.load_template``)
    replicas: int = 1  # engines of this role under `specstack serve --ray` (one engine without --ray)
    # LOSSY: an MoE target run with this many active experts (llama.cpp's expert_used_count override); faster,
    # but the output is no longer the model's, and /health and every response say so.
    experts: int | None = None
    tree: bool = False  # verify token trees (suffix, rest, fusion drafts): one-slot roles only (parallel = 1)
    rollback_depth: int = DEFAULT_DEPTH  # recurrent targets: state snapshots per slot (n_rs_seq)
    # llama.cpp's loading options (``loading.TargetSpec``): flash attention auto/on/off (on needs exact = off),
    # the physical batch (n_ubatch: rows per llama.cpp call), memory-mapped weights, weights locked in RAM, the
    # KV cache's types (-ctk/-ctv; a quantized V cache needs flash attention, so exact = "off")
    flash_attn: str = "auto"
    ubatch_size: int = 512
    mmap: bool = True
    mlock: bool = False
    cache_type_k: str = DEFAULT_KV_TYPE
    cache_type_v: str = DEFAULT_KV_TYPE
    # and llama.cpp's further loading options (``TargetSpec``'s fields of these names: -tb, --load-mode dio, -nr,
    # --special; --override-kv as a table of metadata keys and typed values, RoPE/YaRN as a table of
    # llama_context_params fields, --lazy-mode/--check-tensors as a table of llama_model_params fields)
    threads_batch: int = 0
    direct_io: bool = False
    repack: bool = True
    special: bool = False
    kv_overrides: Any = ()
    context_params: Any = ()
    model_params: Any = ()
    # Request defaults, used where a request gives none (``request_constraints.ConstraintDefaults``): the sampling seed, the
    # penalties, and one grammar (GBNF text, a GBNF file, or a JSON schema: an inline table or JSON text)
    seed: int | None = None
    # llama-server's -a A,B,C and --tags: more names requests may pick the role by, and labels /v1/models shows
    aliases: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: str | None = None
    grammar_file: Path | None = None
    json_schema: Any = None
    # Sampling defaults (serve's --temp, --top-k, --top-p, --min-p); None: the route's own default, llama-server's
    # (0.8, 40, 0.95, 0.05) on its /completion, OpenAI's (1, off, off, off) on /v1/* (``jobs.sampling_defaults``)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    # llama-server's --ignore-eos, -l/--logit-bias and --samplers/--sampler-seq: a request's ignore_eos, logit_bias
    # and samplers where it sends none (``request_constraints``, ``jobs.sampler_chain``).  logit_bias: a table of
    # token ids and biases, or a list of [id, bias] pairs (false or -inf bans), its ids checked against the model's
    # vocabulary at start-up (``commands.serve.check_roles``); samplers: llama.cpp's names or one-letter string, in
    # an order this server applies (``unimplemented.applied_chain``), kept as canonical names
    ignore_eos: bool = False
    logit_bias: Any = ()
    samplers: Any = None
    # The draft's confidence floor (draft-model, mtp; serve's --spec-draft-p-min); None: the drafter's default
    p_min: float | None = None
    # How the role's model writes tool calls (``server.tools``); None: detected from the chat template
    tool_call_format: str | None = None
    # llama-server's reasoning settings (serve --reasoning-format, --reasoning): how a thinking model's <think> block
    # is returned (none, auto, deepseek, deepseek-legacy; None: auto, a request's reasoning_format wins), and
    # whether the template is asked to think (on/off: enable_thinking true/false; auto or None: the template's own)
    reasoning_format: str | None = None
    reasoning: str | None = None

    def spec(self) -> TargetSpec:
        """The role's target as ``loading.load_target`` builds it: every model option ``generate`` has."""
        return TargetSpec(model=self.model, ctx=self.ctx, threads=self.threads, slots=self.parallel, exact=self.exact,
                          kv_pool=self.kv_unified,
                          experts=self.experts, rollback=self.rollback, rollback_depth=self.rollback_depth,
                          tree_branches=DEFAULT_TREE_BRANCHES if self.tree else 1,
                          flash_attn=FLASH_ATTN[self.flash_attn], batch=self.ubatch_size, mmap=self.mmap, mlock=self.mlock,
                          cache_type_k=self.cache_type_k, cache_type_v=self.cache_type_v,
                          threads_batch=self.threads_batch, direct_io=self.direct_io, repack=self.repack,
                          special=self.special, kv_overrides=self.kv_overrides, context_params=self.context_params,
                          model_params=self.model_params)

    def speculative(self, drafter: str | None = None) -> SpeculationSpec:
        """The role's speculation settings for a generation drafting with ``drafter`` (None: the role's own):
        its p_min only where that drafter reads one."""
        chosen = drafter or self.drafter
        reads_p_min = self.p_min is not None and inapplicable(chosen, {"p_min"}) is None
        return SpeculationSpec(drafter=chosen, k_policy=self.k_policy, k=self.k, k_max=self.k_max,
                               options={"p_min": self.p_min} if reads_p_min else {})

    def sampling(self) -> dict[str, Any]:
        """The sampling defaults this role sets (only those it sets: the route fills the rest)."""
        return {k: getattr(self, k) for k in SAMPLING_KEYS if getattr(self, k) is not None}

    def controls(self) -> ConstraintDefaults:
        """What a request of this role gets for each logit control it does not set (``request_constraints``)."""
        return ConstraintDefaults(repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                               frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                               grammar=self.__dict__.get("_gbnf"), ignore_eos=self.ignore_eos,
                               logit_bias=self.logit_bias)

    def __post_init__(self) -> None:
        self._check_types()
        if self.k_policy not in POLICIES:
            raise InvalidParameterError(f"role {self.name!r}: k_policy must be one of {', '.join(POLICIES)} (got {self.k_policy!r})")
        if self.replicas < 1:
            raise InvalidParameterError(f"role {self.name!r}: replicas must be >= 1 (got {self.replicas})")
        if self.parallel < 1:
            raise InvalidParameterError(f"role {self.name!r}: parallel must be >= 1 (got {self.parallel})")
        if self.k < 1 or (self.k_max is not None and self.k_max < 1):
            raise InvalidParameterError(f"role {self.name!r}: k and k_max must be >= 1")
        for key in ("model", "draft"):  # a str path from Python code works as a TOML one does
            if getattr(self, key) is not None:
                object.__setattr__(self, key, Path(getattr(self, key)))
        if self.category is not None and self.profile is None:  # it picks a profile's table; alone it does nothing
            raise InvalidParameterError(f"role {self.name!r}: category {self.category!r} picks a category of a profile, "
                                        "and the role has no profile; add profile = \"FILE.toml\" or remove category")
        try:
            object.__setattr__(self, "exact", exact_mode(self.exact))
        except InvalidParameterError:
            raise InvalidParameterError(f"role {self.name!r}: exact must be auto, on or off (got {self.exact!r})") from None
        if self.rollback not in STRATEGIES:
            raise InvalidParameterError(f"role {self.name!r}: rollback must be one of {', '.join(STRATEGIES)} (got {self.rollback!r})")
        if self.threads < 0 or self.threads_batch < 0 or (self.ctx is not None and self.ctx < 0):
            raise InvalidParameterError(f"role {self.name!r}: threads, threads_batch and ctx must be >= 0")
        for key in ("tree", "kv_unified"):
            if not isinstance(getattr(self, key), bool):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be true or false (got {getattr(self, key)!r})")
        if self.kv_unified and self.parallel > 1 and self.exact == "on":
            raise InvalidParameterError(f"role {self.name!r}: kv_unified = true cannot go with exact = \"on\": the "
                                        f"{self.parallel} slots' cells interleave in the shared pool, which no call "
                                        "shape keeps exact; set exact = \"off\" (or auto), or leave kv_unified out")
        if self.tree and self.parallel != 1:
            raise InvalidParameterError(f"role {self.name!r}: tree = true needs parallel = 1 (got {self.parallel}): "
                                        "token trees are verified on one-slot targets only")
        if self.experts is not None and self.experts < 1:
            raise InvalidParameterError(f"role {self.name!r}: experts must be >= 1 (got {self.experts})")
        if not 2 <= self.rollback_depth <= 256:
            raise InvalidParameterError(f"role {self.name!r}: rollback_depth must be in 2..256 (got {self.rollback_depth})")
        if self.batch_tokens < 0 or self.prefill_cap < 1:
            raise InvalidParameterError(f"role {self.name!r}: batch_tokens must be >= 0 (0: prompts prefilled whole) and "
                                        f"prefill_cap >= 1 (got {self.batch_tokens} and {self.prefill_cap})")
        self._check_requests()

    def _check_requests(self) -> None:
        """The loading options and request defaults: each checked as the CLI flag or request field is; the
        grammar read (from its file, or a JSON schema converted) once, here."""
        if isinstance(self.flash_attn, bool):  # TOML true/false read as on/off, as exact's
            object.__setattr__(self, "flash_attn", "on" if self.flash_attn else "off")
        if self.flash_attn not in FLASH_ATTN:
            raise InvalidParameterError(f"role {self.name!r}: flash_attn must be auto, on or off (got {self.flash_attn!r})")
        if self.flash_attn == "on" and self.exact != "off":
            raise InvalidParameterError(f"role {self.name!r}: flash_attn = \"on\" needs exact = \"off\" (exact call "
                                        "shapes are measured without flash attention); use flash_attn = \"auto\"")
        if self.ubatch_size < 1:
            raise InvalidParameterError(f"role {self.name!r}: ubatch_size must be >= 1 (got {self.ubatch_size})")
        self._check_cache_types()
        for key in ("mmap", "mlock", "direct_io", "repack", "special", "ignore_eos"):
            if not isinstance(getattr(self, key), bool):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be true or false (got {getattr(self, key)!r})")
        self._check_llama_tables()
        for key in ("repeat_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be a number (got {value!r})")
        try:
            ConstraintDefaults(**{k: getattr(self, k) for k in PENALTY_KEYS}).check()
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"role {self.name!r}: {exc}") from None
        given = [k for k in ("grammar", "grammar_file", "json_schema") if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidParameterError(f"role {self.name!r}: {' and '.join(given)} both give the role's grammar; keep one")
        self._check_sampling()
        self._check_bias_and_chain()
        gbnf = self._read_grammar()
        if gbnf is not None:
            try:
                check_gbnf(gbnf)  # before llama.cpp's parser, which a bad bound hangs or crashes
            except InvalidParameterError as exc:
                raise InvalidParameterError(f"role {self.name!r}: {given[0]}: {exc}") from None
        object.__setattr__(self, "_gbnf", gbnf)
        for key, allowed in (("reasoning_format", REASONING_FORMATS), ("reasoning", REASONING_MODES)):
            value = getattr(self, key)
            if value is not None and value not in allowed:
                raise InvalidParameterError(f"role {self.name!r}: {key} must be one of {', '.join(allowed)} "
                                            f"(got {value!r})")
        if self.tool_call_format is not None:
            from .tools import get_format

            try:
                get_format(self.tool_call_format)
            except InvalidParameterError as exc:
                raise InvalidParameterError(f"role {self.name!r}: {exc}") from None

    def _check_cache_types(self) -> None:
        """cache_type_k/cache_type_v: llama.cpp's KV types; a quantized V cache needs flash attention (llama.cpp
        refuses one without it), so exact = "off" (exact shapes are measured without flash attention), and flash_attn
        not "off"."""
        for key in ("cache_type_k", "cache_type_v"):
            if getattr(self, key) not in KV_TYPES:
                raise InvalidParameterError(f"role {self.name!r}: {key} must be one of {', '.join(KV_TYPES)} "
                                            f"(got {getattr(self, key)!r})")
        kind = self.cache_type_v
        if is_quantized(kind) and (self.exact != "off" or self.flash_attn == "off"):
            raise InvalidParameterError(f"role {self.name!r}: cache_type_v = \"{kind}\" needs flash attention (llama.cpp "
                                        "refuses a quantized V cache without it), and so exact = \"off\" (exact call "
                                        "shapes are measured without it): set exact = \"off\" and leave flash_attn "
                                        "auto, or quantize only cache_type_k")

    def _check_llama_tables(self) -> None:
        """kv_overrides, context_params and model_params: a roles file's tables (or the flags' pairs) as sorted
        pairs, so that a Role stays hashable; the parameter names checked as ``ModelConfig`` checks them."""
        from ..llama.target import CONTEXT_PARAMS, MODEL_PARAMS

        for key, known in (("kv_overrides", None), ("context_params", CONTEXT_PARAMS), ("model_params", MODEL_PARAMS)):
            value = getattr(self, key)
            pairs = tuple(sorted(value.items())) if isinstance(value, dict) else tuple(tuple(p) for p in value)
            if any(len(p) != 2 or not isinstance(p[1], (int, float, bool, str)) for p in pairs):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be a table of names and values")
            unknown = sorted({name for name, _ in pairs} - set(known)) if known else []
            if unknown:
                raise InvalidParameterError(f"role {self.name!r}: {key} has unknown names {', '.join(unknown)}; "
                                            f"known: {', '.join(known)}")
            object.__setattr__(self, key, pairs)

    def _check_sampling(self) -> None:
        """The sampling defaults in a request's ranges (``SamplingParams``), and p_min where the drafter reads it."""
        for key in ("temperature", "top_p", "min_p", "p_min"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be a number (got {value!r})")
        try:
            SamplingParams(**self.sampling())
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"role {self.name!r}: {exc}") from None
        if self.p_min is not None:
            if inapplicable(self.drafter, {"p_min"}) is not None:
                raise InvalidParameterError(f"role {self.name!r}: p_min applies to drafter draft-model or mtp, which "
                                            f"{self.drafter!r} does not use; leave it out or choose one of those")
            try:
                check_drafter_options({"p_min": self.p_min})
            except InvalidParameterError as exc:
                raise InvalidParameterError(f"role {self.name!r}: {exc}") from None

    def _check_bias_and_chain(self) -> None:
        """logit_bias as (token id, bias) pairs, read as a request's is (ids only: a role has no vocabulary before
        its model loads; -inf, as ``serve -l ID-inf`` gives it, bans like false), and samplers as canonical names
        where this server applies them in that order; both kept as tuples, so that a Role stays hashable."""
        from .request_constraints import parse_logit_bias
        from .unimplemented import applied_chain

        bias = self.logit_bias
        entries = list(bias.items()) if isinstance(bias, dict) else bias
        if not isinstance(entries, (list, tuple)):
            raise InvalidParameterError(f"role {self.name!r}: logit_bias must be a table of token ids and biases, or "
                                        f"a list of [token id, bias] pairs (got {bias!r})")
        try:
            object.__setattr__(self, "logit_bias", parse_logit_bias([_ban_as_false(p) for p in entries]))
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"role {self.name!r}: {exc}") from None
        if self.samplers is not None:
            if not isinstance(self.samplers, (str, list, tuple)) or not all(isinstance(n, str) for n in self.samplers):
                raise InvalidParameterError(f"role {self.name!r}: samplers must be a list of sampler names or a string "
                                            f"of their letters (got {self.samplers!r})")
            try:
                object.__setattr__(self, "samplers", applied_chain(self.samplers))
            except ValueError as exc:
                raise InvalidParameterError(f"role {self.name!r}: samplers: {exc}") from None

    def _read_grammar(self) -> str | None:
        if self.grammar is not None:
            if not self.grammar.strip():
                raise InvalidParameterError(f"role {self.name!r}: grammar is empty; leave it out for none")
            return self.grammar
        if self.grammar_file is not None:
            object.__setattr__(self, "grammar_file", Path(self.grammar_file))
            try:
                text = self.grammar_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidParameterError(f"role {self.name!r}: cannot read grammar_file {self.grammar_file}: "
                                            f"{exc}") from None
            if not text.strip():
                raise InvalidParameterError(f"role {self.name!r}: grammar_file {self.grammar_file} is empty")
            return text
        if self.json_schema is not None:
            from ..llama.schema_gbnf import schema_to_gbnf

            schema = self.json_schema
            if isinstance(schema, (dict, bool)):  # an inline table: kept as JSON text, so that a Role stays hashable
                object.__setattr__(self, "json_schema", json.dumps(schema))
            elif isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidParameterError(f"role {self.name!r}: json_schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidParameterError(f"role {self.name!r}: json_schema must be a table (or JSON text) holding "
                                            f"a JSON schema (got {schema!r})")
            try:
                return schema_to_gbnf(schema)
            except InvalidParameterError as exc:
                raise InvalidParameterError(f"role {self.name!r}: json_schema: {exc}") from None
        return None


    def _check_types(self) -> None:
        """Each key's type, named (a roles file's ``parallel = "two"`` said "'<' not supported between ...")."""
        for key in ROLE_INTS:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be an integer (got {value!r})")
        for key in ROLE_STRINGS:
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be a string (got {value!r})")
        for key in ("model", "draft", "profile", "grammar_file"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, (str, Path)):
                raise InvalidParameterError(f"role {self.name!r}: {key} must be a file path (got {value!r})")
        for key in ("aliases", "tags"):
            object.__setattr__(self, key, _names(self.name, key, getattr(self, key)))


def _names(role: str, key: str, value: Any) -> tuple[str, ...]:
    """A role's ``aliases`` or ``tags`` as a tuple of names.  A roles file's ``aliases = "coder"`` was kept as the
    string, and a request's model was looked up in it as a substring: "od", "c" or "" picked that role where any
    other unknown name is a 404 (and /v1/models listed the letters as its aliases)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(n, str) and n.strip() for n in value):
        shown = f'["{value}"]' if isinstance(value, str) and value.strip() else '["name", ...]'
        raise InvalidParameterError(f"role {role!r}: {key} must be a list of non-empty names (got {value!r}); write "
                                    f"{key} = {shown}")
    return tuple(value)


def _ban_as_false(entry: Any) -> Any:
    """A logit_bias pair with a -inf bias (``serve -l ID-inf``, TOML's -inf) as a request writes a ban: false."""
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], float) and entry[1] == -math.inf:
        return [entry[0], False]
    return entry


ROLE_INTS = ("k", "k_max", "threads", "ctx", "parallel", "cache_mb", "batch_tokens", "prefill_cap", "replicas", "experts",
             "rollback_depth", "ubatch_size", "seed", "repeat_last_n", "top_k", "threads_batch")
ROLE_STRINGS = ("drafter", "k_policy", "rollback", "category", "chat_template", "grammar", "tool_call_format",
                "reasoning_format", "reasoning")
REASONING_MODES = ("on", "off", "auto")
FLASH_ATTN = {"auto": None, "on": True, "off": False}
PENALTY_KEYS = ("repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


# What a server can draft with on any model, where a role or a request asks for a drafter the model cannot have (mtp
# on one without NextN layers) or one that needs a datastore, which no server is given (``commands.serve``, ``jobs``).
SERVE_ALTERNATIVES = "prompt-lookup, suffix or draft-model"


def default_roles(parallel: int = 4, **overrides: Any) -> list[Role]:
    """No roles file: one role (the bundled pair unless overridden), named after its target's file."""
    return [Role(name=Path(overrides.get("model", DEFAULT_TARGET)).stem, parallel=parallel, **overrides)]


def load_roles(path: Path) -> list[Role]:
    """Roles from a TOML file; errors name the role, the key and the fix."""
    data = read_toml(path, "roles file", "see `specstack serve --help` for the format")
    tables = data.get("roles")
    if not isinstance(tables, dict) or not tables:
        raise InvalidParameterError(f"roles file {path} has no [roles.NAME] tables; see `specstack serve --help`")
    base = Path(path).resolve().parent
    known = {f.name for f in fields(Role)} - {"name"}
    roles = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise InvalidParameterError(f"roles file {path}: roles.{name} must be a table")
        unknown = set(table) - known
        if unknown:
            raise InvalidParameterError(f"roles file {path}: role {name!r} has unknown keys {', '.join(sorted(unknown))}; "
                                        f"known: {', '.join(sorted(known))}")
        values = dict(table)
        if isinstance(values.get("chat_template"), str) and not values["chat_template"].strip():
            raise InvalidParameterError(f"roles file {path}: role {name!r}: chat_template is empty")
        template = values.get("chat_template")
        if isinstance(template, str) and (base / Path(template).expanduser()).is_file():
            values["chat_template"] = str(base / Path(template).expanduser())  # a file beside the roles file
        for key in ("model", "draft", "profile", "grammar_file"):
            if key in values:
                p = Path(values[key]).expanduser()
                values[key] = p if p.is_absolute() else base / p
        if values.get("profile") is not None:  # a `specstack tune` profile; the role's own keys win
            for key, value in load_profile(values["profile"], values.get("category")).items():
                values.setdefault(key, value)
        try:
            roles.append(Role(name=name, **values))
        except TypeError as exc:
            raise InvalidParameterError(f"roles file {path}: role {name!r}: {exc}") from None
    return roles
