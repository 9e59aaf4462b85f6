"""One engine thread per role: requests in, text and token origins out.

llama.cpp contexts are not thread-safe, so each role's target, drafters and
engine live on one thread that owns them.  HTTP handlers (asyncio) submit a
``Job`` and read its events from an ``asyncio.Queue``; the thread runs
``Engine.step()`` while anything is in flight, and between steps it admits
new jobs and carries out cancellations, so a disconnected client's
generation stops within one step and its slot, KV cells and drafter state
are freed.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import json
import queue
import re
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..constraints import dead_end_message
from ..drafters.base import reads_draft_model
from ..drafters.options import DRAFTER_FLAGS, inapplicable
from ..draft_length import DEFAULT_K_MAX, DraftLengthPolicy
from ..draft_length.costs import CostModel
from ..drafters.base import Drafter
from ..engine import Engine
from ..generation import Generation, GenerationConfig
from ..errors import InvalidParameterError, SpecstackError
from ..loading import (SpeculationSpec, build_drafter, build_engine, build_policy, experts_of, load_calibrated,
                       lossy_label, role_draft)
from ..llama import LlamaModel, VocabModel
from .chat import ChatTemplate, load_template
from .events import Delta, Done, Event, Failed, Progress
from .prometheus import ServerMetrics
from .roles import Role
from .sleep import AsleepTarget

IDLE_LEND_S = 0.05  # an idle worker lends a first run's measurement the cores in slices this long (its wake-up delay)
FINISH = {"length": "length", "context": "length", "eos": "stop", "stop": "stop", "cancelled": "cancelled",
          "timeout": "length", "kv_pool": "length"}
POOL_FULL = "Context size has been exceeded."  # llama-server's answer to a slot its full unified KV cache fails


class QueueFull(SpecstackError):
    """Every slot is busy and the wait queue is full: answer 429 with Retry-After."""


@dataclass
class Job:
    """One request on its way through a role's engine."""

    prompt_ids: list[int]
    config: GenerationConfig
    speculative: SpeculationSpec  # the role's settings with the request's over them (``jobs._speculative``)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    deadline: float | None = None
    gen: Generation | None = None
    sent: int = 0  # output tokens already reported (``released``): those the text shows, no further
    text_sent: int = 0  # characters of text already reported
    ends: list[int] = field(default_factory=list)  # per output token: the characters of text up to its end
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    submitted: float = field(default_factory=time.perf_counter)
    checked_at: float = field(default_factory=time.monotonic)  # when the server last looked for the client
    index: int = 0  # which choice of its request (``n > 1``: the choices share one events queue)
    progress: bool = False  # report the prompt's processing (llama-server's ``return_progress``)
    progressed: int = -1  # the prompt tokens processed at the last report (-1: none yet)

    def emit(self, event: Event) -> None:
        """Hand an event (made with this job's ``index``) to the request's loop, from the engine thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def released(self, token_bytes: Any) -> int:
        """How many output tokens may be reported: those whose text has been reported.

        A stop string cuts the text where it begins, but the tokens that spelt it were generated; they are
        no part of the answer, so neither its logprobs nor its usage count them (llama-server and vLLM
        leave them out too).  While generating, a token waits until all its text is out (text that may
        begin a stop string is held back); once a stop string has ended the generation, the tokens that
        show in the text at all are reported; any other end reports every token."""
        gen = self.gen
        for tok in gen.output_ids[len(self.ends):]:  # characters as the generation's own stop check decodes them
            self.ends.append((self.ends[-1] if self.ends else 0) + len(self.decoder.decode(token_bytes(tok))))
        if not gen.done:
            return bisect.bisect_right(self.ends, self.text_sent)
        if gen.stats.stop_reason != "stop":
            return len(gen.output_ids)
        starts = [0, *self.ends[:-1]]
        return bisect.bisect_left(starts, self.text_sent)


class RoleWorker:
    """Owns one role's models and engine on a dedicated thread."""

    def __init__(self, role: Role, metrics: ServerMetrics, max_queue: int = 16,
                 sleep_idle_s: float | None = None) -> None:
        self.role = role
        # --sleep-idle-seconds: the model is freed after that long without work (``sleep``); None: never
        self.sleep_idle_s = sleep_idle_s
        self.sleeping = False
        self.sleep_count = 0  # times the model was freed
        self._awake = threading.Event()  # loaded and not asleep: what a request held awake waits for
        self._holds = 0  # requests that need the model now (``hold``/``release``): no sleep while any does
        self._last_active = time.monotonic()
        self.metrics = metrics
        self.max_queue = max_queue
        self.ready = threading.Event()
        self._grammar_keeper: VocabModel | None = None  # a sleeping role's grammar engine's vocabulary (``_keep_grammars``)
        self.grammars_warm: Future | None = None  # the grammar engine's tokenizer, built before ready (``_load``)
        self.load_error: str | None = None
        self.target: LlamaModel | None = None
        self.lossy: str | None = None  # the LOSSY label of a role run with fewer MoE experts (``loading.lossy_label``)
        self._draft: tuple[Path | None] | None = None  # what draft-model drafts with, once a drafter needs it
        self.engine: Engine | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._active = 0  # submitted and not finished (running or waiting)
        self._drafters: dict[str, Drafter] = {}
        self._policies: dict[str, DraftLengthPolicy] = {}
        self._costs: CostModel | None = None
        self.template: ChatTemplate | None = None
        self._thread = threading.Thread(target=self._run, name=f"specstack-{role.name}", daemon=True)

    # -- called from the HTTP side ------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs (a request's choices) all or none, or raise ``QueueFull`` when slots and queue lack room."""
        with self._lock:
            if self._active + len(jobs) > self.role.parallel + self.max_queue:
                raise QueueFull(f"role {self.role.name!r} is at capacity ({self.role.parallel} slots, "
                                f"{self.max_queue} queue places, {self._active} taken; this request needs "
                                f"{len(jobs)}); retry later")
            self._active += len(jobs)
        for job in jobs:
            self._inbox.put(("submit", job))
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Stop a job between steps (the client went away)."""
        self._inbox.put(("cancel", job))
        self._wake.set()

    @property
    def active(self) -> int:
        return self._active

    def hold(self) -> bool:
        """Keep the model loaded for a request that needs it, waking it if it sleeps; whether it is loaded now
        (if not, ``wait_awake`` until it is).  Each hold ends with ``release``."""
        with self._lock:
            self._holds += 1
            # still loading at start (or failed to): the route answers 503 as without sleep, rather than wait here
            awake = self._awake.is_set() or not self.ready.is_set() or self.load_error is not None
        if not awake:
            self._wake.set()
        return awake

    def wait_awake(self) -> None:
        """Block until the model is loaded again (or failed to load: the request then gets the role's 503)."""
        self._awake.wait()

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            self._last_active = time.monotonic()

    # -- the engine thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # reported by /health and every request
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.ready.set()
            return
        self.ready.set()
        self._awake.set()
        while not self._stop.is_set() or self._jobs:
            if self._fall_asleep():
                self._sleep_until_needed()
                if self.engine is None and not self._stop.is_set():  # the reload failed: /health says why
                    self._refuse_inbox()
                    return
                continue
            self._drain_inbox()
            self._expire()
            if self.engine.busy:
                before = self.engine.running
                try:
                    self.engine.step()
                except Exception as exc:  # the engine cancelled its generations: fail their requests
                    for job in list(self._jobs):
                        self._fail(job, 500, f"generation failed: {exc}", "server_error")
                self.metrics.decoded(self.role.name, max(before, self.engine.running))  # a prefill admits some
                self._report()
                self._last_active = time.monotonic()
            elif not self.engine.idle(IDLE_LEND_S):  # idle time goes to a first run's measurement, if any
                self._wake.wait(0.2)
                self._wake.clear()
            if self.engine is not None:
                self.metrics.load(self.role.name, self.engine.running, self.engine.waiting)
        if self.engine is not None and self.engine.background is not None:
            self.engine.background.abandon()  # its context is freed before the weights it shares
        if self.target is not None:
            self.target.close()

    def _fall_asleep(self) -> bool:
        """Whether the role goes to sleep now: --sleep-idle-seconds without work, nothing queued or held.  Decided
        under the lock ``hold`` takes, so a request either holds the model first or waits for its reload."""
        if self.sleep_idle_s is None or self._jobs or not self._inbox.empty() or self._stop.is_set():
            return False
        with self._lock:
            if self._holds or self._active or time.monotonic() - self._last_active < self.sleep_idle_s:
                return False
            self._awake.clear()
            self.sleeping = True
            return True

    def _sleep_until_needed(self) -> None:
        """Free the model (its weights, KV, drafters and any first-run measurement), wait for a request or the
        stop, then load it again through the same loader as at the start."""
        if self.engine is not None and self.engine.background is not None:
            self.engine.background.abandon()
        asleep = AsleepTarget(self.target)
        self.sleep_count += 1
        self.engine, self._drafters, self._policies = None, {}, {}
        self.target.close()
        self.target = asleep
        print(f"specstack serve: role {self.role.name!r}: asleep after {self.sleep_idle_s:g} s idle (model freed; "
              "the next request loads it again)", file=sys.stderr, flush=True)
        while not self._stop.is_set() and not self._holds and self._inbox.empty():
            self._wake.wait(0.5)
            self._wake.clear()
        if self._stop.is_set() and not self._holds and self._inbox.empty():
            return
        try:
            self._load()
        except Exception as exc:  # reported by /health and every request, as a failed start is
            self.load_error = f"{type(exc).__name__}: {exc}"
        self.sleeping = False
        self._last_active = time.monotonic()
        self._awake.set()

    def _refuse_inbox(self) -> None:
        """Fail what was submitted for a model that could not be loaded again."""
        while not self._inbox.empty():
            kind, job = self._inbox.get_nowait()
            if kind == "submit":
                self._fail(job, 503, f"role {self.role.name!r} failed to load: {self.load_error}", "unavailable_error")

    def _load(self) -> None:
        role = self.role
        prefix = f"specstack serve: role {role.name!r}"
        # auto's verdict measured now if not cached: the slots' layout is fixed from here.  Shapes and costs are
        # settled before any request, from the cache, or else measured on a second context beside the engine (a
        # request may ask for the cost policy at any time, and measuring on the engine's own context would
        # reset sequences that generations hold).
        calibration = load_calibrated(role.spec(), role=f"target of role {role.name!r}", measure=True,
                                      n_max=(role.k_max or DEFAULT_K_MAX) + 1, background=True, prefix=prefix)
        self.target, self._costs = calibration.target, calibration.costs
        try:
            self._keep_grammars()
            self.lossy = lossy_label(experts_of(self.target.meta, role.experts))  # the metadata the load read
            self.template = load_template(role.model, role.chat_template)
            default_grammar = role.controls().grammar
            if default_grammar:  # built now: a grammar llama.cpp refuses stops the start, not every request
                try:
                    self.target.grammar_engine().prepare(default_grammar).result()
                except SpecstackError as exc:
                    raise InvalidParameterError(f"the role's grammar: {exc}") from None
            if self.template.warning and not self.sleep_count:  # said once, not again at each wake
                print(f"{prefix}: WARNING: {role.model.name} {self.template.warning}", file=sys.stderr, flush=True)
            default = role.speculative()
            self.engine = build_engine(calibration, self._drafter(default, 0.0), self._policy(default),
                                       prompt_cache_bytes=role.cache_mb << 20, batch_tokens=role.batch_tokens or None,
                                       prefill_cap=role.prefill_cap)
            # Any request may send a schema or a grammar. Waited for before the role is ready: llguidance builds
            # its tokenizer holding the GIL (1.4 s of Gemma 3's 3 s), and built behind a ready server it froze every
            # request, /health too, for that long (a request 1-1.5 s after ready took 1.75-2.0 s against 0.5 s).
            self.grammars_warm = self.target.grammar_engine().warm()
            self.grammars_warm.result()
        except BaseException:  # no engine will lend the measurement time: its context is freed now
            if calibration.background is not None:
                calibration.background.abandon()
            raise

    def _keep_grammars(self) -> None:
        """A role that sleeps keeps its grammar engine while its model is freed, on a tokenizer-only load of the same
        GGUF (on Gemma 3: 54 MiB, and llguidance's tokenizer 116 MiB), so a wake does not build it again: 2.8 s on
        Gemma 3, 1.4 s of it holding the GIL, once per role on the one builder thread. Grammars built and spellings
        learnt before the sleep are kept too."""
        if self.sleep_idle_s is None:
            return
        if self._grammar_keeper is None:
            self._grammar_keeper = VocabModel(self.role.model, f"tokenizer of role {self.role.name!r}")
        self.target.adopt_grammars(self._grammar_keeper)

    def _drafter(self, spec: SpeculationSpec, temperature: float) -> Drafter:
        """One drafter instance per distinct setting (it serves every generation that uses it)."""
        options = dict(spec.options)
        if self.role.tree and "tree" not in options and inapplicable(spec.drafter, {"tree"}) is None:
            options["tree"] = True  # the role verifies trees: its tree-capable drafters draft them
        # the role's draft is its -md: a draft model's (the bundled one where it fits), or the file another drafter
        # reads from it (eagle3's head, mtp's assistant), as generate's -md reaches every drafter
        draft = self._draft_model() if reads_draft_model(spec.drafter) else self.role.draft
        if draft is not None:
            options.setdefault("draft_model", draft)
        sampled = temperature > 0 and spec.drafter != "none"
        key = json.dumps([spec.drafter, sampled, sorted((k, str(v)) for k, v in options.items())])
        drafter = self._drafters.get(key)
        if drafter is None:
            drafter = self._drafters[key] = build_drafter(spec.drafter, self.target, options, 1.0 if sampled else 0.0)
        return drafter

    def _draft_model(self) -> Path:
        """The role's draft, or the bundled one where it fits the role's model (``loading.role_draft``), settled
        the first time a drafter needs it: a vocabulary check costs 0.3 s on Gemma, for no role that never drafts
        with a model."""
        if self._draft is None:
            self._draft = (role_draft(self.role.model, self.role.draft),)
        draft = self._draft[0]
        if draft is None:  # the bundled draft does not fit this model, and the role names none
            raise InvalidParameterError(
                f"role {self.role.name!r} has no draft model that drafts for {self.role.model.name} (its "
                "vocabulary differs from the bundled draft's); a roles file gives one with the key draft")
        return draft

    def _policy(self, spec: SpeculationSpec) -> DraftLengthPolicy:
        key = json.dumps([spec.k_policy, spec.k, spec.k_max])
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = build_policy(spec.k_policy, spec.k, k_max=spec.k_max,
                                                        costs=self._costs)  # one calibration per role, shared
        return policy

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._start(job)
            elif job in self._jobs:
                job.gen.cancel()
                self._finish(job)

    def _start(self, job: Job) -> None:
        role = self.role
        spec = job.speculative
        try:
            drafter = self._drafter(spec, job.config.sampling.temperature)
            policy = self._policy(spec).fork()
        except SpecstackError as exc:  # the request's drafter cannot run on this role: its field is named
            asked = spec.requested
            field = "speculative.drafter" if "drafter" in asked else "speculative" if asked else None
            self._fail(job, 400, f"drafter {spec.drafter!r} cannot run on role {role.name!r}: "
                                 f"{api_words(str(exc))}; choose another one", "invalid_request_error", param=field)
            return
        except Exception as exc:
            self._fail(job, 500, f"could not build drafter {spec.drafter!r}: {exc}", "server_error")
            return
        try:
            job.gen = self.engine.generate(job.prompt_ids, job.config, drafter=drafter, policy=policy)
        except SpecstackError as exc:
            self._fail(job, 400, api_words(str(exc)), "invalid_request_error")
            return
        except Exception as exc:
            self._fail(job, 500, f"could not start the generation: {exc}", "server_error")
            return
        self._jobs.append(job)
        self.metrics.requests_started(role.name, len(job.prompt_ids))

    def _expire(self) -> None:
        now = time.perf_counter()
        for job in list(self._jobs):
            if job.deadline is not None and now > job.deadline:
                job.gen.stats.stop_reason = "timeout"
                job.gen.cancel()
                self._fail(job, 504, "the request took longer than its timeout; raise the server's --timeout "
                                     "or ask for fewer tokens", "timeout")

    def _report(self) -> None:
        """Send each job what its generation produced in the last step."""
        for job in list(self._jobs):
            gen = job.gen
            if job.progress and job.progressed < len(job.prompt_ids):
                self._progress(job)
            text = gen.take_text()
            job.text_sent += len(text)
            new = range(job.sent, job.released(self.target.token_bytes))
            if text or len(new):
                tokens = [[self.target.token_bytes(gen.output_ids[i]).decode("utf-8", "replace"), gen.origins[i]] for i in new]
                logprobs = [gen.logprobs[i] for i in new] if job.config.logprobs is not None else None
                job.sent = new.stop
                job.emit(Delta(job.index, text, tokens, logprobs))
            if gen.done:
                self._finish(job)

    def _progress(self, job: Job) -> None:
        """llama-server's prompt progress: once the generation has its slot, the prompt tokens there already
        (``cache``: the reused prefix, processed as far as that), then after every step that processed more, up
        to all of them (the last one is processed by the first decoding step)."""
        gen = job.gen
        if gen.seq is None or gen.status == "waiting":
            return
        total, cache = len(job.prompt_ids), gen.stats.n_reused
        processed = self.target.seq_len[gen.seq] if gen.status == "prefilling" else total
        for n in ((cache,) if job.progressed < 0 else ()) + (processed,):
            if n > job.progressed:
                job.progressed = n
                job.emit(Progress(job.index, total, cache, n, (time.perf_counter() - job.submitted) * 1000,
                                  gen.stats.prefill_s * 1000 if n > cache else 0.0))  # the cache: no time

    def _finish(self, job: Job) -> None:
        gen = job.gen
        if gen.stats.stop_reason == "constraint":  # nothing allowed: an error the client must see, never a "stop"
            self._fail(job, 400, dead_end_message(len(gen.output_ids)), "invalid_request_error")
            return
        if gen.stats.stop_reason == "kv_pool":  # -kvu's shared pool ran out under it: llama-server's 500
            self._fail(job, 500, POOL_FULL, "server_error")
            return
        self._jobs.remove(job)
        self._release_capacity()
        stats = gen.stats
        self.metrics.requests_finished(self.role.name, stats, "ok" if stats.stop_reason != "cancelled" else "cancelled",
                                       job.sent)
        # usage counts the tokens of the answer (``Job.released``), not a stop string's that the text leaves out
        job.emit(Done(job.index, FINISH.get(stats.stop_reason, "stop"), {**stats.to_dict(), "lossy": self.lossy},
                      stats.n_prompt, job.sent))

    def _fail(self, job: Job, status: int, message: str, kind: str, param: str | None = None) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
            if not job.gen.done:
                job.gen.cancel()
        self._release_capacity()
        self.metrics.requests_failed(self.role.name, kind)  # counted here, so the answer it becomes is not again
        job.emit(Failed(job.index, status, message, kind, param, metered=True))

    def _release_capacity(self) -> None:
        with self._lock:
            self._active -= 1


# A drafter's error speaks of the command line (``--datastore STORE``); a request's error names request fields.
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: [A-Z][A-Z_.]*\b)?")
_REQUEST_WORDS = {"--drafter": "speculative.drafter", "--k-policy": "speculative.k_policy",
                  **{f.flag: f"speculative.{f.dest}" for f in DRAFTER_FLAGS if f.per_request},
                  **{f.flag: f"the server-side setting {f.dest!r}, which no request can give"
                     for f in DRAFTER_FLAGS if not f.per_request}}


def api_words(message: str) -> str:
    """``message`` with each command-line flag named as what a request sets instead: ``--ngram-min`` becomes
    ``speculative.n_min``, ``--datastore STORE`` a server-side setting; the advice after a server-side
    setting (how to build one, at the command line) is the operator's, not the client's, and is cut."""
    cut = next((m.end() for m in _FLAG.finditer(message)
                if m.group(1) in _REQUEST_WORDS and "server-side" in _REQUEST_WORDS[m.group(1)]), None)
    if cut is not None:
        close = message.find(")", cut)
        message = message[: (close + 1 if close >= 0 else cut)]
    return _FLAG.sub(lambda m: _REQUEST_WORDS.get(m.group(1), m.group(0)), message)
