"""Statistics of one generation: counts, acceptance by position and by source, time split.

Vocabulary follows vLLM's spec-decode metrics: drafted and accepted token
counts, acceptance rate = accepted / drafted, and mean accepted length =
committed tokens per verification step *including* the bonus/recovered token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .llama.recurrent import RewindStats


@dataclass
class SourceStats:
    """Counts for one draft source inside a generation."""

    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: steps whose token i was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


# k policies that choose every step's draft length themselves and never read the configured k.
K_CHOOSING_POLICIES = frozenset({"cost"})


@dataclass
class GenerationStats:
    """Filled in by the engine as it runs; read after the generation ends."""

    drafter: str = "none"
    k: int | None = 0  # the configured k (fixed k; window/heuristic start there); None if the policy chose k itself
    k_policy: str = "fixed"
    n_prompt: int = 0
    n_tokens: int = 0
    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_committed: int = 0  # tokens produced by steps, before any cut by a stop condition
    n_tree_steps: int = 0  # steps that verified a multi-branch tree
    n_tree_relayouts: int = 0  # of those, steps whose winning branch was re-decoded (extra batch)
    trees: str = ""  # why trees were verified as chains, when they were ("" = trees allowed)
    rewind: str = "truncate"  # how rejected tokens leave the target (``recurrent``): truncate, rollback, checkpoint
    rewound: RewindStats = field(default_factory=RewindStats)  # what this generation's cuts cost
    stop_reason: str = ""
    n_reused: int = 0  # prompt tokens whose KV was reused from an earlier request (not prefilled)
    queue_s: float = 0.0  # waiting for a free slot
    ttft_s: float = 0.0  # submission to first token
    itl_s: float = 0.0  # inter-token latency: mean time between output tokens after the first (vLLM's TPOT)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    drafted_at: list[int] = field(default_factory=list)  # drafted_at[i]: steps with a draft token at position i
    accepted_at: list[int] = field(default_factory=list)
    by_source: dict[str, SourceStats] = field(default_factory=dict)
    steps: list[tuple[str, int, int]] = field(default_factory=list)  # (source, drafted, accepted), for replay
    n_proposed: int = 0  # draft tokens the drafter proposed, before the k policy cut them (``n_drafted``: after)
    n_declined: int = 0  # drafts the k policy cut to nothing
    # Why a drafter the user named drafted nothing in this generation, in words ("" where it drafted): the k
    # policy's reading (``why_idle``), so that "drafted 0" never stands alone (issue 55: `--drafter suffix` on
    # Gemma 3 270M said only "max k used 0").
    idle_why: str = ""

    def __post_init__(self) -> None:
        if self.k_policy in K_CHOOSING_POLICIES:
            self.k = None  # record no k rather than one no step was drafted with (drafted_at has the lengths used)

    def record_step(self, source: str, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float,
                    origins: Sequence[str] | None = None) -> None:
        self.n_steps += 1
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        self.n_committed += n_accepted + 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        if len(self.drafted_at) < n_drafted:
            grow = n_drafted - len(self.drafted_at)
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1
        if n_drafted:
            self._by_source(source, n_drafted, n_accepted, origins)
        self.steps.append((source, n_drafted, n_accepted))

    def _by_source(self, source: str, n_drafted: int, n_accepted: int, origins: Sequence[str] | None) -> None:
        """A step's drafted and accepted tokens under each source that drafted them (a mixed chain's, such as the
        grammar's forced tokens after a suffix draft, split by ``origins``), and the step under ``source``."""
        mine = origins[:n_drafted] if origins is not None else (source,) * n_drafted
        for name in dict.fromkeys(mine):
            s = self.by_source.setdefault(name, SourceStats())
            s.n_steps += name == source or source not in mine
            s.n_drafted += sum(1 for o in mine if o == name)
            kept = [i for i, o in enumerate(mine[:n_accepted]) if o == name]
            s.n_accepted += len(kept)
            if len(s.accepted_at) < n_accepted:
                s.accepted_at.extend([0] * (n_accepted - len(s.accepted_at)))
            for i in kept:
                s.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification step, bonus/recovered token included."""
        return self.n_committed / self.n_steps if self.n_steps else 0.0

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.prefill_s, 0.0)

    @property
    def other_s(self) -> float:
        return max(self.decode_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: generated tokens over time after the prompt was processed.

        Prompt processing (``prefill_s``) is the target's prefill plus the drafter's
        ``begin`` (e.g. indexing the prompt), as llama.cpp's lookup counts its cache build.
        """
        return self.n_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "drafter": self.drafter,
            "k": self.k,
            "k_policy": self.k_policy,
            "n_prompt": self.n_prompt,
            "n_tokens": self.n_tokens,
            "n_steps": self.n_steps,
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "drafted_by_position": list(self.drafted_at),
            "by_source": {
                name: {
                    "steps": s.n_steps,
                    "drafted": s.n_drafted,
                    "accepted": s.n_accepted,
                    "acceptance_rate": round(s.acceptance_rate, 4),
                }
                for name, s in self.by_source.items()
            },
            "tree_steps": self.n_tree_steps,
            "tree_relayouts": self.n_tree_relayouts,
            **({"trees": self.trees} if self.trees else {}),
            "rewind": {"strategy": self.rewind, **self.rewound.to_dict()},
            "stop_reason": self.stop_reason,
            "reused_prompt_tokens": self.n_reused,
            "proposed": self.n_proposed,
            "declined": self.n_declined,
            **({"idle_why": self.idle_why} if self.idle_why else {}),
            "time_s": {
                "queue": round(self.queue_s, 6),
                "first_token": round(self.ttft_s, 6),
                "inter_token": round(self.itl_s, 6),
                "prefill": round(self.prefill_s, 6),
                "draft": round(self.draft_s, 6),
                "verify": round(self.verify_s, 6),
                "other": round(self.other_s, 6),
                "total": round(self.total_s, 6),
            },
            "tokens_per_second": round(self.tokens_per_second, 3),
        }
        if with_steps:
            out["steps"] = [list(s) for s in self.steps]
        return out
