"""llama-server's own metrics (``llamacpp:*``) beside specstack's on ``/metrics``.

Dashboards and alerts written for llama-server read these names, so they are rendered as llama-server renders them
(``server_task_result_metrics::to_metrics``): a ``# HELP`` and ``# TYPE`` line per metric, counters without
prometheus_client's ``_created`` samples (which its readers take for metrics of their own).  The semantics are
llama-server's: prompt tokens counted apart from the cached ones, which cost no decode; the generation rate over
the decode steps, the first token excluded (it comes from the prompt's last batch); the two throughput gauges
averaged over the window since the previous scrape, which each scrape starts afresh.  A decode here is one engine
step (one batched target call for every running generation).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

from ..metrics import GenerationStats


@dataclass
class Bucket:
    """Tokens, decode steps and seconds; the rate is steps per second, so tokens that cost no step do not inflate it."""

    count: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, n: int, steps: int, seconds: float) -> None:
        self.count += n
        self.steps += steps
        self.seconds += seconds

    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


@dataclass
class LlamaCppFigures:
    """What llama-server's ``server_metrics`` holds, cumulative since the start but for the two windows."""

    prompt: Bucket = field(default_factory=Bucket)  # processed prompt tokens only: cached ones are counted apart
    predict: Bucket = field(default_factory=Bucket)
    prompt_window: Bucket = field(default_factory=Bucket)  # since the last scrape (the throughput gauges)
    predict_window: Bucket = field(default_factory=Bucket)
    n_prompt_cached: int = 0
    n_tokens_max: int = 0
    n_decode: int = 0
    n_busy_slots: int = 0
    n_draft_tokens: int = 0
    n_draft_accepted: int = 0
    n_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    processing: dict[str, int] = field(default_factory=dict)  # by role: running generations
    deferred: dict[str, int] = field(default_factory=dict)  # by role: generations waiting for a slot


def generation_seconds(s: GenerationStats) -> float:
    """A generation's time after its prompt: what /completion's ``predicted_ms`` reports (not its queueing)."""
    return max(0.0, s.total_s - s.prefill_s - s.queue_s)


class LlamaCppMetrics:
    """The ``llamacpp:*`` figures, fed by the role workers and read by ``/metrics`` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.figures = LlamaCppFigures()

    def finished(self, s: GenerationStats, n_predicted: int) -> None:
        """One generation's prompt, output and drafts (``n_predicted``: the tokens its answer counts)."""
        processed = max(0, s.n_prompt - s.n_reused)
        gen_s = generation_seconds(s)
        with self._lock:
            f = self.figures
            for bucket in (f.prompt, f.prompt_window):
                bucket.add(processed, processed, s.prefill_s)
            for bucket in (f.predict, f.predict_window):
                bucket.add(n_predicted, max(0, n_predicted - 1), gen_s)
            f.n_prompt_cached += s.n_reused
            f.n_tokens_max = max(f.n_tokens_max, s.n_prompt + n_predicted)
            f.n_draft_tokens += s.n_drafted
            f.n_draft_accepted += s.n_accepted
            f.n_drafts += sum(1 for _, drafted, _ in s.steps if drafted)
            if len(f.accepted_per_pos) < len(s.accepted_at):
                f.accepted_per_pos.extend([0] * (len(s.accepted_at) - len(f.accepted_per_pos)))
            for pos, n in enumerate(s.accepted_at):
                f.accepted_per_pos[pos] += n

    def decoded(self, n_busy: int) -> None:
        """One engine step, with the number of generations it ran."""
        with self._lock:
            self.figures.n_decode += 1
            self.figures.n_busy_slots += n_busy

    def load(self, role: str, running: int, waiting: int) -> None:
        with self._lock:
            self.figures.processing[role] = running
            self.figures.deferred[role] = waiting

    def snapshot(self) -> LlamaCppFigures:
        with self._lock:
            return copy.deepcopy(self.figures)

    def scrape(self) -> LlamaCppFigures:
        """The figures as a scrape reports them; the throughput window starts afresh after it."""
        with self._lock:
            out = copy.deepcopy(self.figures)
            self.figures.prompt_window, self.figures.predict_window = Bucket(), Bucket()
            return out

    def reset_window(self) -> None:
        with self._lock:
            self.figures.prompt_window, self.figures.predict_window = Bucket(), Bucket()


def render(f: LlamaCppFigures) -> str:
    """llama-server's Prometheus text of ``f``."""
    counters = (
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", f.prompt.count),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", f.n_prompt_cached),
        ("prompt_seconds_total", "Total time spent processing prompts", f.prompt.seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", f.predict.count),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", f.predict.seconds),
        ("n_decode_total", "Total number of engine steps (batched target calls), prefill included", f.n_decode),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", f.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", f.n_draft_tokens),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
         f.n_draft_accepted),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", f.n_drafts),
    )
    gauges = (
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", f.prompt_window.rate()),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", f.predict_window.rate()),
        ("requests_processing", "Number of requests processing", sum(f.processing.values())),
        ("requests_deferred", "Number of requests deferred", sum(f.deferred.values())),
        ("n_busy_slots_per_decode", "Average number of busy slots per engine step",
         f.n_busy_slots / max(f.n_decode, 1)),
    )
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {_number(value)}"]
    if f.accepted_per_pos:
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
        lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(f.accepted_per_pos)]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A sample's value as llama-server prints it: whole numbers without a fraction."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
