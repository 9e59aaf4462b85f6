"""The drafter role: anything that proposes tokens for the target to verify.

Lifecycle per generation (as in llama.cpp's common_speculative and
ArcticInference's suffix cache): ``begin`` with the prompt, then per step
``propose`` a draft and ``advance`` past what was committed, then ``end``.  One
drafter instance serves every generation of an engine: per-generation
state is kept by sequence id (``seq``), and ``propose`` takes the requests
of all generations in a step at once, so a draft model can batch them.
Each request carries the policy's ``Budget``: drafters never decide draft
length themselves.  Drafters never see the target's logits.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from ..draft_length import Budget
from ..errors import InvalidParameterError
from ..target import Target
from ..types import Draft


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One generation's ask in a step: draft what follows ``context`` within ``budget``."""

    seq: int
    context: Sequence[int]
    budget: Budget


@runtime_checkable
class Drafter(Protocol):
    """A draft source.  Generations are told apart by ``seq`` (0 when there is one)."""

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


def propose_one(drafter: Drafter, context: Sequence[int], budget: Budget | int, seq: int = 0) -> Draft:
    """Propose for a single generation (tests, replay): ``budget`` may be a plain token cap."""
    if isinstance(budget, int):
        budget = Budget(budget)
    return drafter.propose([DraftRequest(seq, context, budget)])[0]


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


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Class/function decorator: make a drafter available by its kebab-case name."""

    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def check_name(name: str, where: str = "--drafter") -> list[str]:
    """The drafters ``name`` builds (a cascade's or fusion's parts too); an unknown one is an error naming ``where``.

    Called before any model loads, so a typo costs nothing (it used to surface after the target's load).
    """
    base, _, spec = name.partition(":")
    parts = [p for p in spec.replace("+", ",").split(",") if p] if base in ("cascade", "fusion") else []
    for n in [base, *parts]:
        if n.partition(":")[0] not in _REGISTRY:
            raise InvalidParameterError(f"unknown drafter {n!r} in {where}; choose one of: {', '.join(available())}")
    return [base, *parts]


def create(name: str, ctx: BuildContext) -> Drafter:
    """Build the drafter called ``name``; unknown names list the known ones.

    ``name:spec`` passes ``spec`` to the factory as ``options["spec"]``
    (e.g. ``cascade:prompt-lookup,suffix,draft-model``).
    """
    if ":" in name:
        name, spec = name.split(":", 1)
        ctx = BuildContext(target=ctx.target, options={**ctx.options, "spec": spec}, temperature=ctx.temperature)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise InvalidParameterError(
            f"unknown drafter {name!r}; choose one of: {', '.join(available())}"
        ) from None
    return factory(ctx)


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
