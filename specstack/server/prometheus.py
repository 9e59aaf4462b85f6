"""Prometheus metrics for the server, labelled by role and, for speculation, by draft source.

Names follow vLLM's spec-decode counters (``spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, and accepted tokens
per position), so the usual PromQL works: acceptance rate =
accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..metrics import GenerationStats


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "specstack_"
        self.requests = Counter(p + "requests", "Requests finished, by outcome", ["role", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", ["role"], registry=r)
        self.generated_tokens = Counter(p + "generation_tokens", "Tokens generated", ["role"], registry=r)
        self.reused_tokens = Counter(p + "prompt_tokens_reused", "Prompt tokens whose KV was reused (not prefilled)", ["role"], registry=r)
        self.queue = Gauge(p + "queue_depth", "Requests waiting for a slot", ["role"], registry=r)
        self.busy = Gauge(p + "busy_slots", "Slots decoding a generation", ["role"], registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verification steps that carried a draft", ["role", "source"], registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", ["role", "source"], registry=r)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", ["role", "source"], registry=r)
        self.accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
                                    ["role", "source", "position"], registry=r)
        self.step_seconds = Counter(p + "step_seconds", "Decode time, split into draft, verify and other", ["role", "phase"], registry=r)
        self.k = Histogram(p + "draft_k", "Draft tokens verified per step (the k chosen)", ["role"],
                           buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submission to first token", ["role"], registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Mean time between a request's tokens after the first",
                             ["role"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)

    def requests_started(self, role: str, n_prompt: int) -> None:
        self.prompt_tokens.labels(role).inc(n_prompt)

    def load(self, role: str, running: int, waiting: int) -> None:
        self.busy.labels(role).set(running)
        self.queue.labels(role).set(waiting)

    def requests_finished(self, role: str, s: GenerationStats, status: str) -> None:
        self.requests.labels(role, status).inc()
        self.generated_tokens.labels(role).inc(s.n_tokens)
        self.reused_tokens.labels(role).inc(s.n_reused)
        for source, st in s.by_source.items():
            self.drafts.labels(role, source).inc(st.n_steps)
            self.draft_tokens.labels(role, source).inc(st.n_drafted)
            self.accepted.labels(role, source).inc(st.n_accepted)
            for pos, n in enumerate(st.accepted_at):
                self.accepted_pos.labels(role, source, str(pos)).inc(n)
        self.step_seconds.labels(role, "draft").inc(s.draft_s)
        self.step_seconds.labels(role, "verify").inc(s.verify_s)
        self.step_seconds.labels(role, "other").inc(s.other_s)
        for _, drafted, _ in s.steps:
            self.k.labels(role).observe(drafted)
        if s.ttft_s > 0:
            self.ttft.labels(role).observe(s.ttft_s)
        if s.itl_s > 0:
            self.itl.labels(role).observe(s.itl_s)

    def requests_failed(self, role: str, kind: str) -> None:
        self.requests.labels(role, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
