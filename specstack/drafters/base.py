"""The drafter role: anything that proposes tokens for the target to verify.

Lifecycle per generation (as in llama.cpp's common_speculative and
ArcticInference's suffix cache): ``begin`` with the prompt, then per step
``propose`` a draft and ``observe`` what was committed, then ``end``.
Drafters never see the target's logits; policies for k never see drafters'
internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from ..errors import InvalidParameterError
from ..types import Draft


@runtime_checkable
class Drafter(Protocol):
    """A draft source.  One instance serves one generation at a time."""

    name: str

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a generation whose context is ``prompt_ids``."""

    def propose(self, context_ids: Sequence[int], max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` tokens to follow ``context_ids`` (prompt + output so far)."""

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        """``new_ids`` were committed after the last proposal, of which ``num_accepted`` came from it."""

    def end(self) -> None:
        """The generation is over (finished or aborted); release per-request state."""


@dataclass
class BuildContext:
    """What a drafter factory may use: the target (tokenizer, vocab, threads) and options.

    ``options`` holds flag values by config field name (``n_min``,
    ``draft_model`` ...); each factory picks the fields of its own config.
    """

    target: Any
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


def config_from_options(cls: type, options: Mapping[str, Any]) -> Any:
    """Instantiate dataclass ``cls`` from the subset of ``options`` naming its fields.

    None means "not given" so CLI defaults stay in one place: the dataclass.
    """
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in names and v is not None})
