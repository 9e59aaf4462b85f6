"""The drafter role: anything that proposes tokens for the target to verify.

Lifecycle per generation (as in llama.cpp's common_speculative and
ArcticInference's suffix cache): ``begin`` with the prompt, then per step
``propose`` a draft and ``advance`` past what was committed, then ``end``.  One
drafter instance serves every generation of an engine: per-generation
state is kept by sequence id (``seq``), and ``propose`` takes the requests
of all generations in a step at once, so a draft model can batch them.
Each request carries the policy's ``Budget``: drafters never decide draft
length themselves.  Drafters never see the target's logits.

What every drafter does is ``Drafter``.  What some drafters do beyond it is declared, each a small protocol
of its own, and read once per generation (``DrafterTraits.of``), never probed at every step:

- ``HiddenDrafter``: conditions on the target (an MTP head, an EAGLE-3 head), ``needs_hidden = True``: the
  engine hands it the target's hidden rows (``types.HiddenRows``) of the tokens the target kept, at
  ``begin`` (the prompt's) and at every ``advance`` (the verification's accepted rows; rows of rejected
  drafts never arrive).
- ``ContextDrafter``: drafts after any context extending its generation's (prompt lookup, suffix trees:
  ``DraftRequest.context`` may run past the committed tokens), ``reads_context = True``: the grammar source
  (``drafters.grammar``) then asks it again after the forced tokens it appended, so structure and copied
  text alternate in one draft.
- ``PrefixDrafter``: per-sequence state expensive to rebuild (an MTP head's KV), kept by
  ``save_prefix(seq, tokens) -> (state, bytes) | None`` and ``restore_prefix(seq, state)``: the engine's
  host prompt cache keeps that state beside the target's KV and hands it back when it restores the prefix.
- ``PlainDrafter``: ``drafts = False``, never proposes (``none``): plain decoding, so the engine drafts no
  grammar's forced tokens for it either.
"""

from __future__ import annotations

import time
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ..draft_length import Budget, Go
from ..errors import InvalidParameterError
from ..llama import Target
from ..types import Draft, HiddenRows

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One generation's ask in a step: draft what follows ``context`` within ``budget``."""

    seq: int
    context: Sequence[int]
    budget: Budget


@runtime_checkable
class Drafter(Protocol):
    """A draft source.  Generations are told apart by ``seq`` (0 when there is one).

    What a drafter may declare beyond these (hidden rows, drafting after any context, prefix state, not
    drafting at all) are the protocols ``HiddenDrafter``, ``ContextDrafter``, ``PrefixDrafter`` and
    ``PlainDrafter``, read once per generation into ``DrafterTraits``."""

    name: str

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        """Start generation ``seq`` whose context is ``prompt_ids``."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request (prompt + output so far), never longer than its budget."""

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        """``new_ids`` were committed after the last proposal, of which ``n_accepted`` came from it."""

    def end(self, seq: int = 0, complete: bool = True) -> None:
        """Generation ``seq`` is over; release its state.  ``complete`` is False for a cancelled one,
        whose partial output must not be learnt from as if it were a whole answer."""


@runtime_checkable
class HiddenDrafter(Drafter, Protocol):
    """A drafter that reads the target's hidden rows: ``needs_hidden`` is True, and ``begin``/``advance`` take them."""

    needs_hidden: bool

    def begin(self, prompt_ids: Sequence[int], seq: int = 0, hidden: HiddenRows | None = None) -> None:
        """As ``Drafter.begin``; ``hidden``: the target's rows of the prompt positions it computed (from where a
        reused prefix ends to the last but one token)."""

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0, hidden: HiddenRows | None = None) -> None:
        """As ``Drafter.advance``; ``hidden``: the verification's rows of the tokens kept (the pending token and the
        accepted draft; the last one is the row the step's own target token came from)."""


@runtime_checkable
class ContextDrafter(Protocol):
    """A drafter that drafts after a context longer than its generation's committed one (``reads_context``
    True); without it a drafter is not asked so: a model's draft needs its own state to match the context."""

    reads_context: bool


@runtime_checkable
class PrefixDrafter(Protocol):
    """A drafter whose state for a sequence's prefix the host prompt cache keeps beside the target's KV."""

    def save_prefix(self, seq: int, tokens: Sequence[int]) -> tuple[Any, int] | None:
        """(state, bytes) kept for ``seq``'s cached ``tokens``, or None where nothing is worth keeping."""

    def restore_prefix(self, seq: int, saved: Any) -> None:
        """The state ``save_prefix`` gave, for the prefix the engine restored into ``seq``."""


@runtime_checkable
class PlainDrafter(Protocol):
    """A drafter that declares whether it drafts at all (``drafts`` False: ``none``, plain decoding)."""

    drafts: bool


@dataclass(frozen=True)
class DrafterTraits:
    """What a drafter declares beyond ``Drafter``, read once (``of``) where a generation takes it."""

    needs_hidden: bool = False
    reads_context: bool = False
    drafts: bool = True
    prefix: PrefixDrafter | None = None  # the drafter itself where it keeps prefix state
    scored: frozenset[str] = frozenset()  # the sources whose drafts score their tokens (``scored_sources``)

    @classmethod
    def of(cls, drafter: Drafter) -> "DrafterTraits":
        return cls(needs_hidden=isinstance(drafter, HiddenDrafter) and bool(drafter.needs_hidden),
                   reads_context=isinstance(drafter, ContextDrafter) and bool(drafter.reads_context),
                   drafts=not isinstance(drafter, PlainDrafter) or bool(drafter.drafts),
                   prefix=drafter if isinstance(drafter, PrefixDrafter) else None,
                   scored=scored_sources(drafter))


def scored_sources(drafter: Drafter) -> frozenset[str]:
    """The names of the sources whose drafts score their tokens (``Draft.scores``): the drafter's own where it
    declares ``scores_drafts`` (retrieval), a cascade's parts' where it lists them (``scored_sources``). The cost
    policy is told before their first draft (``DraftLengthPolicy.expect_scores``): a cascade whose retrieval
    source had nothing at the first look, and whose model source then drafted badly, was never asked again."""
    parts = getattr(drafter, "scored_sources", None)
    if parts is not None:
        return frozenset(parts)
    return frozenset((drafter.name,)) if getattr(drafter, "scores_drafts", False) else frozenset()


def needs_hidden(drafter: Drafter) -> bool:
    """Whether ``drafter`` reads the target's hidden rows (``HiddenDrafter``; a cascade or fusion passes them on)."""
    return isinstance(drafter, HiddenDrafter) and bool(drafter.needs_hidden)


def propose_one(drafter: Drafter, context: Sequence[int], budget: Budget | int, seq: int = 0) -> Draft:
    """Propose for a single generation (tests, replay): ``budget`` may be a plain token cap."""
    if isinstance(budget, int):
        budget = Budget(budget)
    return drafter.propose([DraftRequest(seq, context, budget)])[0]


@dataclass(frozen=True)
class ModelDraftConfig:
    """What a drafter that runs a model (draft-model, mtp) takes: ``draft_temp`` (None: the target's
    temperature), ``p_min`` (stop drafting below this confidence, --draft-p-min) and the sampling ``seed``."""

    draft_temp: float | None = None
    p_min: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_min < 1.0:
            raise InvalidParameterError(f"p_min must be in [0, 1) (got {self.p_min})")
        if self.draft_temp is not None and self.draft_temp < 0:
            raise InvalidParameterError(f"draft_temp must be >= 0 (got {self.draft_temp})")


@dataclass
class DraftChain:
    """A model's draft grown one token a call (draft-model, mtp): its tokens, their confidences and q rows."""

    tokens: list[int] = field(default_factory=list)
    confs: list[float] = field(default_factory=list)
    qs: list[np.ndarray] = field(default_factory=list)

    def take(self, tok: int, conf: float, q: np.ndarray | None, budget: Budget, p_min: float, source: str,
             t0: float) -> bool:
        """Add ``tok`` unless ``--draft-p-min`` or the budget's ``keep_going`` ends the draft before it; whether
        to draft one more (the budget has room left, and ``keep_going`` says it pays)."""
        if conf < p_min:
            return False
        self.confs.append(conf)
        keep = budget.keep_going
        go = Go.MORE if keep is None else keep(source, self.confs, time.perf_counter() - t0)
        if go == Go.DROP:
            return False
        self.tokens.append(tok)
        if q is not None:
            self.qs.append(q)
        return go == Go.MORE and len(self.tokens) < budget.max_tokens

    def draft(self, source: str) -> Draft:
        return (Draft(tuple(self.tokens), source, np.stack(self.qs) if self.qs else None) if self.tokens
                else Draft.empty(source))


@dataclass
class BuildContext:
    """What a drafter factory may use: the target (tokenizer, vocab, threads) and options.

    ``options`` holds flag values by config field name (``n_min``,
    ``draft_model`` ...); each factory picks the fields of its own config.
    """

    target: Target
    options: Mapping[str, Any] = field(default_factory=dict)
    temperature: float = 0.0


DrafterFactory = Callable[[BuildContext], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}

# The drafter a user who names none gets (``generate``, ``serve``, a role without ``drafter``): suffix trees over the
# request and over earlier requests' prompts and outputs.  Measured against prompt lookup, both under the cost
# policy, 2026-12-05 (docs/drafters.md, "The default drafter"): equal on 55 third-party completions (1.59x plain
# each, none below 0.97x) and within noise on the served edit, tool-loop and agentic workloads; ahead on the mixes
# (1B stand-in 1.75x plain against 1.61x) and where requests repeat one another (a module's methods in order: 1.56x
# against 1.43x), which is what the earlier requests' tree is for.
DEFAULT_DRAFTER = "suffix"


@dataclass(frozen=True)
class Sources:
    """What a compound drafter (``cascade:A,B``, ``fusion:A,B``) takes after its colon.

    Declared where the drafter registers, read by ``parse_name``: the one place that decides whether
    a name is valid, for the CLI, roles files and a request's ``speculative.drafter`` alike.
    """

    min: int
    max: int | None = None
    first: tuple[str, ...] = ()  # the first source must be one of these (empty: any)
    example: str = ""


_SOURCES: dict[str, Sources] = {}


@dataclass(frozen=True)
class Asked:
    """Where a drafter is asked for, in the words its ``Needs.check`` refuses a target with: ``where`` names it (the
    flag or field and the name given: ``--drafter mtp``, ``speculative.drafter 'mtp' on role 'coder'``),
    ``options`` are the drafter options given (by name: mtp's assistant is ``draft_model``, moe-self's experts
    ``draft_experts``), ``alternatives`` the drafters that work there instead (None: the drafter's own list)."""

    where: str
    options: Mapping[str, Any] = field(default_factory=dict)
    alternatives: str | None = None


# Refuses, from a target's GGUF metadata, a target a drafter cannot draft for; returns a draft file it reads (mtp's
# assistant on gemma4), else None.
TargetCheck = Callable[["GGUFInfo", Asked], "Path | None"]


@dataclass(frozen=True)
class Needs:
    """What a drafter needs beyond a loaded target, declared beside its ``@register`` and read through the registry
    (``needs_of``, ``reads_draft_model``, ``needs_datastore``, ``check_target``) by the CLI's checks, a server's
    roles, its worker and its requests alike: none of them matches drafter names, and a new drafter that needs one of
    these is checked everywhere by declaring it.

    ``draft_model``: it drafts with a second GGUF (-md, a role's ``draft``), settled before any load (the bundled
    draft only where it fits the target). ``head``: it reads -md as a head trained for the target (eagle3's EAGLE-3
    head, mtp's assistant), which its ``check`` validates and nothing replaces with the bundled draft. ``datastore``: it reads a datastore built beforehand (--datastore), which
    no server is given. ``check``: what it needs of the target, checked from the target's GGUF metadata before a load
    (mtp: NextN layers this llama.cpp drafts from; moe-self: experts), so a model that cannot have it fails in one
    line, in milliseconds, instead of after minutes of loading. ``offered``: the target itself offers it (a draft
    head shipped in the model), so ``tune`` weighs it unasked. (What a drafter does beyond ``Drafter`` once built,
    hidden rows among it, is ``DrafterTraits``, read from the instance.)"""

    draft_model: bool = False
    head: bool = False
    datastore: bool = False
    check: TargetCheck | None = None
    offered: Callable[["GGUFInfo"], bool] | None = None

    @property
    def servable(self) -> bool:
        """Whether a server role can build it: everything a server may be given (a draft model, not a datastore)."""
        return not self.datastore


_NEEDS: dict[str, Needs] = {}


@dataclass(frozen=True)
class LlamaCpp:
    """What llama.cpp calls the job a drafter does, declared beside its ``@register`` and read through the registry
    (``llama_spec_types``, ``llama_peers``), so neither ``serve``'s llama-server flags nor the bench's peers keep a
    table of drafter names that a new drafter would have to be added to.

    ``spec_types``: llama-server's ``--spec-type`` values this drafter serves (common/speculative.cpp's names: the
    suffix drafter's tree does ``ngram-mod``'s and ``ngram-cache``'s job). ``peers``: the llama.cpp binaries
    (``bench.peers.PEER_METHODS``) that ``bench run --peers auto`` runs beside it, doing the same job."""

    spec_types: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()


_LLAMA_CPP: dict[str, LlamaCpp] = {}


def register(name: str, sources: Sources | None = None, needs: Needs | None = None,
             llama: LlamaCpp | None = None) -> Callable[[DrafterFactory], DrafterFactory]:
    """Class/function decorator: make a drafter available by its kebab-case name; ``sources``: it is
    compound and takes a list of other drafters after a colon (``cascade:suffix,prompt-lookup``); ``needs``: what
    it needs beyond a loaded target (``Needs``; None: nothing); ``llama``: what llama.cpp calls its job
    (``LlamaCpp``; None: llama.cpp has no such drafter)."""

    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        if sources is not None:
            _SOURCES[name] = sources
        _NEEDS[name] = needs or Needs()
        _LLAMA_CPP[name] = llama or LlamaCpp()
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def parse_name(name: str, where: str = "--drafter") -> tuple[str, tuple[str, ...]]:
    """``name`` as (drafter, its sources): ``"cascade:suffix+prompt-lookup"`` -> ``("cascade", ("suffix",
    "prompt-lookup"))``, ``"suffix"`` -> ``("suffix", ())``.  Anything else is an error naming ``where``.

    One rule for every name: a plain drafter takes nothing after it (``none:foo`` used to run ``none``), and
    a compound one takes the sources it declares (``fusion:`` used to become ``fusion:suffix,draft-model``
    while ``cascade:`` was an error); sources are plain drafters, each once, separated by ',' or '+'.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidParameterError(f"{where} is empty; choose one of: {', '.join(available())}")
    base, colon, spec = name.strip().partition(":")
    _known(base, where)
    rule = _SOURCES.get(base)
    if rule is None:
        if colon:
            raise InvalidParameterError(f"drafter {name!r} in {where}: {base} takes nothing after it; write {base!r}")
        return base, ()
    parts = tuple(p.strip() for p in spec.replace("+", ",").split(",")) if spec.strip() else ()
    _check_sources(base, rule, parts, name, where)
    return base, parts


def _known(base: str, where: str) -> None:
    if base not in _REGISTRY:
        raise InvalidParameterError(f"unknown drafter {base!r} in {where}; choose one of: {', '.join(available())}")


def _check_sources(base: str, rule: Sources, parts: tuple[str, ...], name: str, where: str) -> None:
    """A compound drafter's sources against its ``Sources`` rule."""
    words = {1: "one", 2: "two", 3: "three"}
    count = words.get(rule.min, str(rule.min))
    count = count if rule.max == rule.min else f"{count} or more" if rule.max is None else f"{count} to {rule.max}"
    usage = f"{base} takes {count} sources after a colon, separated by ',' or '+', e.g. {rule.example}"
    if "" in parts:
        raise InvalidParameterError(f"drafter {name!r} in {where}: a source is empty; {usage}")
    if not parts or len(parts) < rule.min or (rule.max is not None and len(parts) > rule.max):
        raise InvalidParameterError(f"drafter {name!r} in {where}: {usage}")
    for part in parts:
        _known(part.partition(":")[0], where)
        if ":" in part or part in _SOURCES:
            raise InvalidParameterError(f"drafter {name!r} in {where}: {part!r} cannot be a source of {base}; "
                                        f"sources are plain drafters ({', '.join(plain_drafters())})")
    if len(set(parts)) != len(parts):
        twice = next(p for p in parts if parts.count(p) > 1)
        raise InvalidParameterError(f"drafter {name!r} in {where}: {twice} is listed twice; list each source once")
    if rule.first and parts[0] not in rule.first:
        raise InvalidParameterError(f"drafter {name!r} in {where}: {base}'s first source must be "
                                    f"{' or '.join(rule.first)} (got {parts[0]!r}), e.g. {rule.example}")


def plain_drafters() -> list[str]:
    """The drafters that take no sources (every one but cascade and fusion)."""
    return [n for n in available() if n not in _SOURCES]


def llama_spec_types() -> dict[str, str]:
    """llama-server's ``--spec-type`` values, each to the drafter that does its job (``LlamaCpp.spec_types``), in the
    order the drafters registered (``drafters/__init__``'s imports), each drafter's types in the order it gives."""
    return {t: name for name, llama in _LLAMA_CPP.items() for t in llama.spec_types}


def llama_peers() -> dict[str, tuple[str, ...]]:
    """The llama.cpp binaries that do each drafter's job (``LlamaCpp.peers``), by drafter; only drafters with some."""
    return {name: llama.peers for name, llama in _LLAMA_CPP.items() if llama.peers}


def check_name(name: str, where: str = "--drafter") -> list[str]:
    """The drafters ``name`` builds (a cascade's or fusion's parts too); an invalid name is an error naming ``where``.

    Called before any model loads, so a typo costs nothing (it used to surface after the target's load).
    """
    base, parts = parse_name(name, where)
    return [base, *parts]


def needs_of(name: str, where: str = "--drafter") -> dict[str, Needs]:
    """What each drafter ``name`` builds needs, by drafter (a cascade's or fusion's parts too; the compound itself
    needs nothing of its own); an invalid name is an error naming ``where`` (``check_name``)."""
    return {part: _NEEDS[part] for part in check_name(name, where)}


def reads_draft_model(name: str, where: str = "--drafter") -> bool:
    """Whether a drafter ``name`` builds drafts with a second GGUF (``Needs.draft_model``: -md, a role's draft)."""
    return any(n.draft_model for n in needs_of(name, where).values())


def reads_head(name: str, where: str = "--drafter") -> bool:
    """Whether a drafter ``name`` builds reads -md as a head of its own (``Needs.head``)."""
    return any(n.head for n in needs_of(name, where).values())


def needs_datastore(name: str, where: str = "--drafter") -> str | None:
    """The first drafter ``name`` builds that reads a datastore (``Needs.datastore``), which no server is given;
    None where none does."""
    return next((part for part, n in needs_of(name, where).items() if n.datastore), None)


def offered_by(meta: "GGUFInfo") -> list[str]:
    """The drafters the target of ``meta`` (its GGUF metadata) offers itself (``Needs.offered``: a draft head it
    ships), in the registry's order."""
    return [name for name in available() if _NEEDS[name].offered is not None and _NEEDS[name].offered(meta)]


def check_target(name: str, target: "GGUFInfo | Path", asked: Asked) -> Path | None:
    """Each drafter ``name`` builds checked against its target (``Needs.check``), from the target's GGUF metadata
    (``target``: the metadata, read once by the caller, or the GGUF's path: read here only where a drafter checks
    it), before any load; refused in the words of ``asked``. Returns the draft file one of them reads (mtp's
    assistant), else None."""
    checks = [n.check for n in needs_of(name, asked.where).values() if n.check is not None]
    if checks and isinstance(target, (str, Path)):
        from ..modelfile.meta import read_gguf

        target = read_gguf(target, tensors=False)
    found = None
    for check in checks:
        found = check(target, asked) or found
    return found


def create(name: str, ctx: BuildContext) -> Drafter:
    """Build the drafter called ``name`` (checked by ``parse_name``).

    A compound drafter gets its sources as ``options["spec"]`` (e.g. ``"prompt-lookup,suffix,draft-model"``).
    """
    base, parts = parse_name(name, "the drafter name")
    if parts:
        ctx = BuildContext(target=ctx.target, options={**ctx.options, "spec": ",".join(parts)},
                           temperature=ctx.temperature)
    return _REGISTRY[base](ctx)


def option_name(config_field: Field) -> str:
    """The key that sets a drafter config field in ``BuildContext.options`` (and the dest of its flag).

    It is the field's name unless the field declares ``metadata={"option": ...}``: every drafter
    shares one namespace of options, in which a bare name like cascade's ``min_len`` would be unclear.
    """
    return config_field.metadata.get("option", config_field.name)


def config_from_options(cls: type, options: Mapping[str, Any], **given: Any) -> Any:
    """Instantiate dataclass ``cls`` from ``given`` plus the ``options`` that name its fields.

    None means "not given" so CLI defaults stay in one place: the dataclass.
    """
    picked = {f.name: options.get(option_name(f)) for f in fields(cls)}
    return cls(**{**{name: v for name, v in picked.items() if v is not None}, **given})
