"""What a request's jobs report, one small record per kind: ``Delta`` (new text and tokens), ``Progress`` (the
prompt's processing), ``Done`` (a choice finished) and ``Failed`` (a choice refused or broken).

The engine thread makes them (``worker.RoleWorker``), a scale-out replica sends them over Ray (they pickle), and
every route and shaper reads their fields: one definition of what each event carries, instead of dict keys
spelt again in every reader.  Each is tagged with its choice's ``index`` (a request's choices share one queue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Delta:
    """What a choice's last step produced: its text, each new token as ``[piece, origin]`` (the origin says which
    drafter, or the target, proposed it), and their logprobs where the request asked for them."""

    index: int
    text: str
    tokens: list[list[Any]]
    logprobs: list[Any] | None = None


@dataclass(frozen=True)
class Progress:
    """llama-server's prompt progress (``return_progress``): of the prompt's ``total`` tokens, ``cache`` were
    reused and ``processed`` are in the slot, ``time_ms`` since the job arrived, ``prompt_ms`` of it processing."""

    index: int
    total: int
    cache: int
    processed: int
    time_ms: float
    prompt_ms: float = 0.0

    def fields(self) -> dict[str, Any]:
        """The ``prompt_progress`` object llama-server sends."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass(frozen=True)
class Done:
    """A choice's end: its finish reason (OpenAI's word), the generation's stats (``GenerationStats.to_dict``,
    with the role's ``lossy`` label and, under scale-out, the ``replica``), and the tokens counted."""

    index: int
    finish_reason: str
    stats: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object of this choice."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(frozen=True)
class Failed:
    """A choice that cannot go on: the HTTP status and error object it becomes (``responses.ApiError``);
    ``metered``: the worker counted the failure already, so its answer is not counted again."""

    index: int
    status: int
    message: str
    kind: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None
    metered: bool = False


Event = Union[Delta, Progress, Done, Failed]
