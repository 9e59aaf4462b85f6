"""llama-server's native shapes: a /completion result with its ``timings`` and ``generation_settings``, the
defaults ``/props`` and ``/slots`` report, and token pieces as llama-server spells them; and a /completion body
read as /v1/completions reads its own (``native_body``).  Shaping only: the routes are ``routes/llama_server.py``,
their plans ``plan.native``, the events come from ``session``."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..draft_length import DEFAULT_K_MAX
from ..sampling import MAX_LOGPROBS
from .backends import Limits, RoleBackend
from .events import Delta, Done, Progress
from .jobs import LLAMA_SAMPLING
from .responses import ApiError, summary, total_usage
from .telemetry import final_timings, progress_timings
from .worker import Job

if TYPE_CHECKING:
    from ..llama.target import DescribedTarget

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # what llama-server reports for "random" (-1)
STOP_TYPE = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit", "kv_pool": "limit", "timeout": "limit",
             "cancelled": "none", "": "none"}

# OpenAI's fields that llama-server's native route does not have: their meaning here would be silently lost
OPENAI_ONLY = {"echo": "the prompt comes back as 'prompt'", "logprobs": "ask for n_probs",
               "best_of": "ask for n_cmpl", "suffix": "insertion is not implemented",
               "stream_options": "the last chunk always carries the timings",
               "max_completion_tokens": "ask for n_predict"}


def piece_bytes(target: DescribedTarget, token: int) -> bytes:
    """A token's text as llama-server's pieces show it: special tokens spelled out (``<start_of_turn>``)."""
    return target.token_bytes(token) or target.special_text(token).encode("utf-8")


def piece_text(target: DescribedTarget, token: int) -> str | list[int]:
    """A token's piece as text, or its bytes where they are not whole UTF-8 (llama-server's ``with_pieces``)."""
    raw = piece_bytes(target, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def native_text(target: DescribedTarget, ids: list[int]) -> str:
    """Token ids as text, special tokens spelled out (``/detokenize``, a result's ``prompt``)."""
    return b"".join(piece_bytes(target, t) for t in ids).decode("utf-8", errors="replace")




def default_params(role: Any, limits: Any, target: DescribedTarget | None = None) -> dict[str, Any]:
    """A role's generation defaults under llama-server's names (``/props``, ``/slots``): what a request to
    /completion that sets nothing gets here (the sampling: the role's, else llama-server's; the chain and the
    logit biases: serve --samplers, -l and --ignore-eos, the bans of ``target``'s end-of-generation tokens among
    the biases as llama-server lists them)."""
    controls = role.controls()
    chain = getattr(role, "samplers", None)
    return {"n_predict": limits.default_max_tokens, "seed": LLAMA_DEFAULT_SEED if role.seed is None else role.seed,
            **{**LLAMA_SAMPLING, **role.sampling()}, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            **controls.settings(), "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0,
            "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9, "stop": [],
            "max_tokens": limits.default_max_tokens, "n_keep": 0, "n_discard": 0, "stream": False, "n_probs": 0,
            "min_keep": 0, "logit_bias": logit_bias_settings(controls, target),
            "samplers": list(chain) if chain is not None else ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "speculative.n_max": role.k_max or DEFAULT_K_MAX, "speculative.n_min": 0,
            "speculative": role.speculative().settings(),
            "timings_per_token": False, "post_sampling_probs": False, "lora": []}


def request_params(job: Any, w: Any, limits: Any) -> dict[str, Any]:
    """``generation_settings``: role ``w``'s defaults with what this request set (``GenerationConfig``)."""
    config, role = job.config, w.role
    c, s = config.constraints, config.sampling
    return {**default_params(role, limits), "n_predict": config.max_tokens, "max_tokens": config.max_tokens,
            "seed": LLAMA_DEFAULT_SEED if s.seed is None or s.seed < 0 else s.seed, "temperature": s.temperature,
            "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": c.repeat_penalty,
            "repeat_last_n": c.repeat_last_n, "frequency_penalty": c.frequency_penalty,
            "presence_penalty": c.presence_penalty, "ignore_eos": c.ignore_eos, "grammar": c.grammar or "",
            "logit_bias": logit_bias_settings(c, w.target),
            "min_tokens": c.min_tokens, "stop": list(config.stop), "stop_token_ids": list(config.stop_token_ids),
            "n_probs": config.logprobs or 0, "post_sampling_probs": config.post_sampling_probs,
            "speculative": job.speculative.settings()}




def logit_bias_settings(c: Any, target: DescribedTarget | None) -> list[dict[str, Any]]:
    """``generation_settings.logit_bias`` as llama-server lists it: ``{"bias", "token"}`` entries, a ban's -inf as
    null, and ``ignore_eos``'s bans of the target's end-of-generation tokens among them (as llama-server adds them)."""
    bias = list(c.logit_bias)
    if c.ignore_eos:
        bias += [(t, float("-inf")) for t in sorted(target.eog_ids() if target is not None else ())]
    return [{"bias": None if b == float("-inf") else b, "token": t} for t, b in bias]


def _template(w: Any) -> str:
    t = w.template
    return "" if t is None else t.text


def _special(target: DescribedTarget, token: int) -> str:
    """BOS's or EOS's piece (""; none: -1)."""
    return piece_bytes(target, token).decode("utf-8", "replace") if token >= 0 else ""




def props_body(w: RoleBackend, limits: Limits) -> dict[str, Any]:
    """``GET /props``: the role's defaults, slots, model, template and special tokens, as llama-server has them."""
    from ..llama import kernel_status
    from ..llama.backend import llama_version

    params = default_params(w.role, limits, w.target)
    return {
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": w.target.n_ctx,
                                        "speculative": w.role.drafter != "none", "is_processing": False,
                                        "params": params, "prompt": "",
                                        "next_token": {"has_next_token": False, "has_new_line": False, "n_remain": -1,
                                                       "n_decoded": 0, "stopping_word": ""}},
        "total_slots": w.role.parallel, "model_path": str(w.role.model), "model_alias": w.role.name,
        "chat_template": _template(w), "chat_template_caps": {},
        "bos_token": _special(w.target, w.target.bos_id), "eos_token": _special(w.target, w.target.eos_id),
        "modalities": {"vision": False, "audio": False},
        "build_info": f"specstack {__version__} (llama-cpp-python {llama_version() or 'unknown'})",
        "is_sleeping": bool(getattr(w, "sleeping", False)),
        # specstack's own: which llama.cpp CPU backend serves (its verification kernels, or the stock one and why)
        "specstack_kernels": kernel_status().to_dict()}


def busy_slots(w: RoleBackend) -> dict[int, Job]:
    """The role's running jobs by the slot (sequence) each holds: read, never changed, from here."""
    busy: dict[int, Any] = {}
    for job in list(getattr(w, "_jobs", ())):
        seq = getattr(job.gen, "seq", None)
        if seq is not None:
            busy[seq] = job
    return busy


def slot_entries(w: RoleBackend, limits: Limits, busy: dict[int, Job]) -> list[dict[str, Any]]:
    """``GET /slots``: one entry per slot of the role, busy or not, and how far its generation is (no prompt text)."""
    out = []
    for i in range(w.role.parallel):
        job = busy.get(i)
        decoded = len(job.gen.output_ids) if job is not None else 0
        entry = {"id": i, "id_task": job.index if job is not None else -1, "n_ctx": w.target.n_ctx,
                 "speculative": w.role.drafter != "none", "is_processing": job is not None,
                 # a list of one, as llama-server's slots show it; an idle slot's budget is -1 and nothing decoded
                 "next_token": [{"has_next_token": job is not None, "has_new_line": False,
                                 "n_remain": job.config.max_tokens - decoded if job is not None else -1,
                                 "n_decoded": decoded, "stopping_word": ""}]}
        if job is not None:  # llama-server shows a slot's params only for its task (an idle slot: none)
            entry["params"] = request_params(job, w, limits)
        out.append(entry)
    return out


def nested_values(paths: list[str], body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``response_fields`` (``json_get_nested_values``): only the fields named, each under its path as
    given (``generation_settings/n_predict`` at the top level), a path that leads nowhere left out without error."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


class Native:
    """A native request's choices as they arrive: text, token ids and probabilities per choice."""

    def __init__(self, limits: Limits, w: RoleBackend, jobs: list[Job], per_prompt: int,
                 fields: list[str] | None = None) -> None:
        self.limits, self.w, self.jobs, self.per_prompt = limits, w, jobs, per_prompt
        self.fields = fields or []  # response_fields: the final result cut to these (``nested_values``)
        self.texts = [""] * len(jobs)
        self.ids: list[list[int]] = [[] for _ in jobs]
        self.probs: list[list[dict[str, Any]]] = [[] for _ in jobs]
        self.slot = [-1] * len(jobs)
        self.started = time.perf_counter()

    def _note_slot(self, i: int) -> Any:
        """Choice ``i``'s generation, its slot noted once it has one (``id_slot``)."""
        gen = getattr(self.jobs[i], "gen", None)
        if gen is not None and self.slot[i] < 0 and gen.seq is not None:
            self.slot[i] = gen.seq
        return gen

    def add(self, event: Delta | Done) -> dict[str, Any]:
        """Take one event; a delta's part of the stream chunk (its text, ids and probabilities)."""
        i = event.index
        job = self.jobs[i]
        gen = self._note_slot(i)
        if not isinstance(event, Delta):
            if gen is not None:  # the ids the text shows (a stop string's tokens left out), as usage counts them
                self.ids[i] = list(gen.output_ids[: event.completion_tokens])
            return {}
        n = len(event.tokens)
        new = list(gen.output_ids[len(self.ids[i]): len(self.ids[i]) + n]) if gen is not None else []
        self.ids[i] += new
        self.texts[i] += event.text
        post = job.config.post_sampling_probs
        probs = [self._prob(lp, post) for lp in event.logprobs or ()]
        self.probs[i] += probs
        return {"content": event.text, "tokens": new, **({"completion_probabilities": probs} if probs else {})}

    def _prob(self, lp: Any, post_sampling: bool) -> dict[str, Any]:
        """One token's entry of ``completion_probabilities``: its logprob and ``top_logprobs``, or with
        ``post_sampling_probs`` its probability and ``top_probs`` (llama-server's two shapes)."""
        target = self.w.target
        key = "prob" if post_sampling else "logprob"

        def entry(token: int, logprob: float) -> dict[str, Any]:
            raw = piece_bytes(target, token)
            value = math.exp(logprob) if post_sampling else logprob
            return {"id": token, key: value, "token": raw.decode("utf-8", "replace"), "bytes": list(raw)}

        top = "top_probs" if post_sampling else "top_logprobs"
        return {**entry(lp.token, lp.logprob), top: [entry(t, v) for t, v in lp.top]}

    def usage(self, finals: list[Done]) -> dict[str, int]:
        return total_usage(finals, self.per_prompt)

    def progress(self, i: int, event: Progress, with_timings: bool) -> dict[str, Any]:
        """llama-server's prompt progress chunk of choice ``i`` (a partial result with no content, its
        ``prompt_progress`` beside it, and its ``timings`` where ``timings_per_token`` asks)."""
        self._note_slot(i)
        out = {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": self.slot[i],
               "tokens_predicted": 0, "tokens_evaluated": event.total, "prompt_progress": event.fields()}
        if with_timings:
            out["timings"] = progress_timings(event)
        return out

    def result(self, i: int, final: Done, streamed: bool) -> dict[str, Any]:
        """llama-server's final result of choice ``i`` (``to_json_non_oaicompat``); a stream's last chunk carries
        no content (it came in the chunks before)."""
        job, stats = self.jobs[i], final.stats
        text = self.texts[i]
        reason = stats.get("stop_reason", "")
        out = {"index": i, "content": "" if streamed else text, "tokens": [] if streamed else self.ids[i],
               "id_slot": self.slot[i], "stop": True, "model": self.w.role.name,
               "tokens_predicted": final.completion_tokens, "tokens_evaluated": final.prompt_tokens,
               "generation_settings": request_params(job, self.w, self.limits),
               "prompt": native_text(self.w.target, job.prompt_ids), "has_new_line": "\n" in text,
               "truncated": reason == "context",  # llama-server's: stopped at the slot's context capacity
               "stop_type": STOP_TYPE.get(reason, "none"), "stopping_word": self._stopping_word(i, reason),
               "tokens_cached": stats.get("reused_prompt_tokens", 0), "timings": final_timings(final),
               "speculative": summary(stats)}
        if job.config.logprobs is not None and not streamed:
            out["completion_probabilities"] = self.probs[i]
        return nested_values(self.fields, out) if self.fields else out

    def _stopping_word(self, i: int, reason: str) -> str:
        """The stop string that ended choice ``i``: the text stops where it begins."""
        gen = getattr(self.jobs[i], "gen", None)
        if reason != "stop" or gen is None:
            return ""
        whole = self.w.target.detokenize(gen.output_ids)
        at = len(self.texts[i])
        return next((s for s in self.jobs[i].config.stop if whole.startswith(s, at)), "")


def native_body(body: Any) -> Any:
    """A /completion body read as /v1/completions reads its own: OpenAI-only fields refused, ``n_probs`` as
    logprobs, ``return_tokens`` honoured (``tokens`` always holds ids), ``response_fields`` taken out (the route cuts
    its results to them: ``plan.native`` keeps them for ``Native``); the sampling defaults are every route's
    (``jobs.sampling_for``: llama-server's)."""
    for name, instead in OPENAI_ONLY.items():
        if name in body.model_fields_set and getattr(body, name) is not None:
            raise ApiError(400, f"{name} is a field of /v1/completions, not of llama-server's /completion ({instead})",
                           param=name)
    update: dict[str, Any] = {"return_tokens": None, "response_fields": None}  # the route applies response_fields
    # n_probs is checked by its own name: from here on it is read as logprobs, which its errors would name
    if body.n_probs is not None and not 0 <= body.n_probs <= MAX_LOGPROBS:
        raise ApiError(400, f"n_probs must be in 0..{MAX_LOGPROBS} (got {body.n_probs})", param="n_probs")
    if body.n_probs:  # the native route's logprobs
        update.update(n_probs=None, logprobs=body.n_probs)
    return body.model_copy(update=update)
