"""Load test for OpenAI-compatible servers: specstack serve against llama-server on the same GGUFs.

N concurrent clients (the official async ``openai`` client) stream greedy generations for a fixed
time. Each request reports time to first token (TTFT), inter-token latency (ITL: the mean gap
between its tokens after the first, as specstack's /metrics and vLLM's TPOT define it) and its
longest gap between two chunks (a stall). A 429 is counted and retried after its Retry-After;
anything else is a failure. Outputs are checked against the same server's answer alone (not the
burst's long prompts, each new). Aggregate tok/s is completion tokens over wall time; requests
started before the deadline run to their end.

Workloads (``--workload``, comma-separated):

- ``code``: held-out code prompts on /v1/completions, cycled.
- ``chat``: each client holds multi-turn conversations on /v1/chat/completions; every turn appends
  the reply and a new user message and resends the whole conversation, as chat clients do. Each
  conversation opens with its own session line, so no two are alike and no prompt cache answers a
  turn it has not seen; ``--chat-check`` conversations are replayed alone afterwards, turn by turn.
- ``agentic``: multi-turn JSON extraction over a fixed set of documents (held-out code files): each client
  holds conversations on /v1/chat/completions, one document each; every turn asks for another record about
  the document, constrained by that record's grammar (``AGENT_TASKS``' JSON schemas, as one GBNF text that
  both servers get in their ``grammar`` field), and resends the whole conversation. Reported beside tok/s:
  drafted and accepted tokens (specstack's ``speculative`` object, llama-server's ``timings``) and
  specstack's acceptance by turn, which shows what its suffix trees learn across turns.
- ``tools``: an agent's tool loop, as agent frameworks run it: each client holds conversations over one document
  (a held-out code file) on /v1/chat/completions; every assistant turn is one tool call constrained by the same
  GBNF text on both servers (``TOOL_SCHEMA``: read a file, grep it, edit it, finish, with arguments), the call's
  result comes back as the next message (``tool_result``: the document, its matching lines, the edited lines),
  and the whole conversation is resent each turn. The calls repeat the path and names they saw, which suffix and
  prompt lookup can draft beside the grammar's forced structure. Reported as ``agentic`` is: drafted and accepted
  tokens, and acceptance by turn.
- ``edit``: the bench's grounded edits (``grounded-edit``: a third-party function in the message, an edit asked of
  it, the whole function asked back) as single chat turns, client i cycling through them from edit i; the answer
  copies most of the message, which n-gram and suffix drafting can verify whole.
- ``burst``: the code streams run, and every ``--burst-every`` seconds (the first at half of it;
  default: one burst, mid-run) ``--burst-size`` long prompts (``--long-chars`` characters, each
  unique from its first line, so no prompt cache holds them; ``--burst-n`` tokens) arrive at once,
  whether or not the last burst is done. Reported apart: the streams (their ITL and stalls), and
  the long prompts' TTFT. Size bursts to the machine: two 1,600-token prompts are about 22 s of
  prefill for the Gemma 3 1B-shaped Q4_K_M stand-in at 2 threads (llama-server: ~148 tok/s).

Modes:

- ``--peer llama-server``: specstack and llama-server on the same -m/-md, both started once with
  as many slots as the largest client count (plus a burst's prompts), both left running; for each
  client count and workload each server runs in turn, the order swapped every other point, and no
  point starts before both are idle (no CPU use for a second; specstack's first-run measurement of
  a model done). ``--llama-sweep`` first tries llama-server's draft settings (draft model at
  ``--spec-draft-n-max`` 2/4/8, the target's NextN head likewise where it has one, every n-gram
  ``--spec-type`` this build has, none) on the code workload and keeps the fastest. Under the table: how
  many tokens llama-server drafted and accepted (its replies' ``timings``; a WARNING where its
  speculation never ran) and whether the two servers' solo answers agree.
- A target with a NextN (MTP) head: llama-server runs ``--spec-type draft-mtp --spec-draft-n-max K``, as it
  drafts from such a model (unless ``--llama-draft`` or a ``--spec-type`` in ``--llama-args``), and specstack
  ``--drafter mtp`` (unless ``--drafter`` names another) with ``-k K --k-max K``; K is ``-k``, default 4.
  Every table has both servers' accepted/drafted tokens.
- ``--spawn specstack|llama-server``: one server, started anew for each client count (slots = clients).
- ``--url URL``: a server already running.

    python benchmarks/serve_load.py --peer llama-server --llama-sweep -m STANDIN -md DRAFT \\
        --chat-template gemma --drafter draft-model --seconds 15 --llama-sweep-seconds 10 --json results.json
    python benchmarks/serve_load.py --spawn specstack --clients 16 --seconds 120
    python benchmarks/serve_load.py --spawn llama-server --sweep 1,2,4,8 --seconds 60 -m STANDIN -md DRAFT --llama-draft
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --clients 4
    python benchmarks/serve_load.py --peer llama-server -m specstack/models/pycoder-6m-mtp.gguf -t 1 --sweep 1 \
        --workload code --seconds 15 --prompts 4 -n 64       # --drafter mtp against draft-mtp, k = 4
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import openai

from specstack.bench.serving import (Column, Reply, Server, ServerFailed, Stats, closed_loop, cpu_seconds, llama_server,
                                     llama_server_binary, percentile, rss_mb, specstack_serve, stream, table,
                                     with_client, write_json)
from specstack.drafters.base import DEFAULT_DRAFTER
from specstack.modelfile.meta import read_gguf
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.ui import markdown_table

SPECSTACK = "specstack"
LLAMA = "llama-server"
WORKLOADS = ("code", "chat", "agentic", "tools", "edit", "burst")
CHAT_TURNS = (
    "Session {tag}. Explain what this code does:\n\n```python\n{code}\n```",
    "Now write a unit test for the last function in it.",
    "Here is another part of the same project:\n\n```python\n{other}\n```\n\nHow do the two parts fit together?",
    "Suggest one improvement to the first part and show the changed code.",
)
# The agentic workload's turns: what each asks about the conversation's document, and the record's schema.
AGENT_TASKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("List the functions this file defines.",
     {"type": "object", "properties": {"functions": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                     "maxItems": 8}}, "required": ["functions"]}),
    ("Which modules does it import?",
     {"type": "object", "properties": {"imports": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                   "maxItems": 8}}, "required": ["imports"]}),
    ("Describe its first function as a record.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                       "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                     "maxItems": 6},
                                       "returns": {"type": "string", "maxLength": 40}},
      "required": ["name", "arguments", "returns"]}),
    ("Summarise the file as a record.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "has_tests": {"type": "boolean"},
                                       "functions": {"type": "integer"}}, "required": ["title", "has_tests", "functions"]}),
)
# The tools workload's calls: one JSON object a turn, {"tool": NAME, "args": {...}}, a tool's arguments by name.
_PATH = {"type": "string", "maxLength": 48}
TOOL_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "object", "properties": {"tool": {"const": "read_file"},
                                      "args": {"type": "object", "properties": {"path": _PATH}, "required": ["path"]}},
     "required": ["tool", "args"]},
    {"type": "object", "properties": {"tool": {"const": "grep"},
                                      "args": {"type": "object", "properties": {
                                          "pattern": {"type": "string", "maxLength": 32}, "path": _PATH},
                                          "required": ["pattern", "path"]}},
     "required": ["tool", "args"]},
    {"type": "object", "properties": {"tool": {"const": "edit_file"},
                                      "args": {"type": "object", "properties": {
                                          "path": _PATH, "old": {"type": "string", "maxLength": 80},
                                          "new": {"type": "string", "maxLength": 80}},
                                          "required": ["path", "old", "new"]}},
     "required": ["tool", "args"]},
    {"type": "object", "properties": {"tool": {"const": "finish"},
                                      "args": {"type": "object", "properties": {
                                          "summary": {"type": "string", "maxLength": 80}}, "required": ["summary"]}},
     "required": ["tool", "args"]},
]}
TOOLS_PROMPT = ("You are a coding agent working in a repository. Answer every turn with exactly one tool call as "
                'JSON, {{"tool": NAME, "args": {{...}}}}. Tools: read_file(path), grep(pattern, path), '
                "edit_file(path, old, new), finish(summary).\n\nTask {number}: in {path}, find the function "
                "{name} and add a one-line docstring to it; then finish.")
START = time.perf_counter()
QUIET_CPU = 0.05  # CPU-seconds per second under which a server counts as idle
MTP_K = 4  # both servers' draft max on a target with a NextN head when -k is not given: specstack's default k
READY_S = 600  # a first start may measure a model before it serves


# -- servers -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaSetting:
    """A llama-server speculation setting: its name in reports and its flags."""

    label: str
    flags: tuple[str, ...]


def slot_context(args: argparse.Namespace) -> int:
    """Context per slot for both servers: ``--ctx``, else specstack's default (4096, or the trained context if
    shorter). Both servers' ``-c`` is the total, divided among the slots (specstack's as llama-server's), so each
    gets this times the slots."""
    if args.ctx:
        return args.ctx
    trained = read_gguf(args.model, tensors=False).context_length
    return min(4096, trained) if trained else 4096


def has_mtp(model: str) -> bool:
    """Whether the target ships a NextN head that llama.cpp drafts from (``--spec-type draft-mtp``) and specstack's
    ``--drafter mtp`` runs: one head of an architecture this llama.cpp has an MTP graph for."""
    return read_gguf(model, tensors=False).mtp_mode == "single head"


def draft_max_flags(args: argparse.Namespace) -> list[str]:
    """specstack's side of ``-k``: its k and the cost policy's bound, so that it drafts at most as many tokens a
    step as llama-server's ``--spec-draft-n-max`` lets it."""
    return ["-k", str(args.k), "--k-max", str(args.k)] if args.k else []


def specstack_flags(args: argparse.Namespace, parallel: int) -> list[str]:
    flags = ["-np", str(parallel), "-m", args.model, "-md", args.model_draft, "-t", str(args.threads), "--drafter",
             args.drafter, "--max-queue", "64", "-c", str(slot_context(args) * parallel), "--cache-ram",
             str(args.cache_ram),
             *draft_max_flags(args)]
    if args.chat_template:
        flags += ["--chat-template", args.chat_template]
    return flags + args.specstack_args.split()


def chat_template_flags(template: str | None) -> list[str]:
    """llama-server's flags for a chat template. A built-in name needs ``--no-jinja``: with Jinja on (this
    build's default) ``--chat-template gemma`` is taken as a Jinja template whose whole text is 'gemma'."""
    if not template:
        return []
    if Path(template).is_file():
        return ["--chat-template-file", template]
    return ["--no-jinja", "--chat-template", template]


def llama_flags(args: argparse.Namespace, parallel: int, spec: list[str]) -> list[str]:
    return ["-m", args.model, "-np", str(parallel), "-t", str(args.threads), "-c", str(slot_context(args) * parallel),
            "--cache-ram", str(args.cache_ram), "--temp", "0", *chat_template_flags(args.chat_template), *spec,
            *args.llama_args.split()]


def spawn_specstack(args: argparse.Namespace, parallel: int) -> Server:
    label = " ".join(["--drafter", args.drafter, *draft_max_flags(args), args.specstack_args]).strip()
    return specstack_serve(specstack_flags(args, parallel), name=SPECSTACK, timeout=READY_S, label=label).start()


def spawn_llama(args: argparse.Namespace, parallel: int, setting: LlamaSetting) -> Server:
    return llama_server(llama_flags(args, parallel, list(setting.flags)), name=LLAMA, timeout=READY_S,
                        label=setting.label).start()


def measuring(server: Server) -> bool:
    """Whether specstack is still measuring a model it has not seen (``calibration.background``): it then uses
    idle time, and would take the cores from the other server's run."""
    text = server.log_text()
    return "first run of" in text and "specstack: measured" not in text and "WARNING: measuring" not in text


def wait_quiet(servers: list[Server], timeout: float = 900) -> None:
    """Wait until no server is doing background work: specstack's measurement done, and no CPU use for a second."""
    live = [s for s in servers if s.pid is not None and s.proc.poll() is None]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(s.name == SPECSTACK and measuring(s) for s in live):
            time.sleep(1)
            continue
        before = [cpu_seconds(s.pid) for s in live]
        time.sleep(1.0)
        if all(cpu_seconds(s.pid) - b < QUIET_CPU for s, b in zip(live, before)):
            return
    say(f"WARNING: servers still busy after {timeout:.0f} s; measuring anyway")


def say(message: str) -> None:
    """A progress line, stamped with the minutes and seconds since the start (for planning a run's length)."""
    elapsed = int(time.perf_counter() - START)
    print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {message}", flush=True)


# -- llama-server's speculation settings -------------------------------------------------------------


def ngram_types() -> list[str]:
    """The n-gram ``--spec-type`` values this llama-server build lists in its --help."""
    text = subprocess.run([str(llama_server_binary()), "--help"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"^--spec-type (\S+)", text, re.MULTILINE)
    return [t for t in match.group(1).split(",") if t.startswith("ngram-")] if match else []


def mtp_setting(n_max: int) -> LlamaSetting:
    """llama-server drafting from the target's own NextN head, at most ``n_max`` tokens a step."""
    return LlamaSetting(f"draft-mtp n_max {n_max}", ("--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)))


def draft_fits(args: argparse.Namespace) -> bool:
    """Whether llama-server can draft for ``-m`` with ``-md``: ``specstack check`` finds their vocabularies identical
    or compatible (llama.cpp does not translate between tokenizers; given another, llama-server ran without drafting,
    and the sweep's row was plain decoding under another name)."""
    from specstack.modelfile.compat import COMPATIBLE, IDENTICAL, check_pair

    fits = check_pair(args.model, args.model_draft).verdict in (IDENTICAL, COMPATIBLE)
    if not fits:
        say(f"the sweep leaves draft-simple out: {Path(args.model_draft).name} cannot draft for {Path(args.model).name}")
    return fits


def llama_settings(args: argparse.Namespace) -> list[LlamaSetting]:
    """What ``--llama-sweep`` tries: no speculation, the draft model at each n_max, the target's NextN head at
    each n_max (a target that has one), each n-gram type alone."""
    settings = [LlamaSetting("none", ())]
    for n_max in args.llama_n_max if draft_fits(args) else ():
        settings.append(LlamaSetting(f"draft-simple n_max {n_max}", ("-md", args.model_draft, "--spec-type",
                                                                     "draft-simple", "--spec-draft-n-max", str(n_max))))
    if args.mtp:
        settings += [mtp_setting(n_max) for n_max in args.llama_n_max]
    settings += [LlamaSetting(t, ("--spec-type", t)) for t in ngram_types()]
    return settings


def fixed_llama_setting(args: argparse.Namespace) -> LlamaSetting:
    """llama-server's setting without a sweep: the draft model if ``--llama-draft``; else, on a target with a NextN
    head, draft-mtp at -k (as llama-server drafts from such a model) unless ``--llama-args`` names a --spec-type;
    then ``--llama-args``."""
    if args.llama_draft:
        flags: tuple[str, ...] = ("-md", args.model_draft, *(("--spec-draft-n-max", str(args.k)) if args.k else ()))
    elif args.mtp and "--spec-type" not in args.llama_args.split():
        flags = mtp_setting(args.k or MTP_K).flags
    else:
        flags = ()
    return LlamaSetting(" ".join([*flags, args.llama_args]).strip() or "no speculation", flags)


# -- requests ----------------------------------------------------------------------------------------


def drafts_of(reply: Reply) -> tuple[int, int]:
    """A reply's drafted and accepted tokens: specstack's ``speculative`` object, llama-server's ``timings``
    (``draft_n``, ``draft_n_accepted``); (0, 0) where the server reported neither."""
    spec, timings = reply.spec or {}, reply.timings or {}
    drafted = int(spec.get("n_drafted", timings.get("draft_n", 0)) or 0)
    accepted = int(spec.get("n_accepted", timings.get("draft_n_accepted", 0)) or 0)
    return drafted, accepted


@dataclass
class LoadStats(Stats):
    """One (workload, clients, server) run's raw numbers, with its identical-to-solo checks, the drafted and
    accepted tokens its replies report (so a table shows that each server really speculated) and the server's
    resident memory; ``summary`` reduces them."""

    identical: int = 0
    checked: int = 0
    drafted: int = 0
    accepted: int = 0
    rss: list[float] = field(default_factory=list)

    def add(self, r: Reply) -> None:
        super().add(r)
        drafted, accepted = drafts_of(r)
        self.drafted += drafted
        self.accepted += accepted

    def summary(self) -> dict[str, Any]:
        rss = self.rss or [0.0]
        ms = {f"{key}_{name}_ms": 1000 * percentile(getattr(self, key), q)
              for key in ("ttft", "itl") for name, q in (("p50", 0.5), ("p99", 0.99))}
        return {"ok": self.requests, "429": self.rate_limited, "reconnects": self.reconnects,
                "failures": len(self.failures), "tok_s": self.tok_s(), "tokens": self.tokens, "wall_s": self.wall,
                **ms, "stall_p99_ms": 1000 * percentile(self.stall, 0.99),
                "latency_p50_s": percentile(self.latency, 0.5),
                "prompt_tokens_mean": sum(self.prompt_tokens) / len(self.prompt_tokens) if self.prompt_tokens else 0,
                "identical": self.identical, "checked": self.checked, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "rss_mb": {"start": rss[0], "max": max(rss), "end": rss[-1]}}


async def text_of(client: openai.AsyncOpenAI, stats: Stats, n: int, **request: Any) -> str | None:
    """One streamed request's text (None if it failed), its numbers in ``stats``."""
    reply = await stream(client, stats, n, **request)
    return None if reply is None else reply.text


async def sample_rss(pid: int | None, stop: float, stats: LoadStats) -> None:
    """The server's resident memory every 2 s of a run (a leak shows as a climb across runs)."""
    while time.perf_counter() < stop:
        stats.rss.append(rss_mb(pid))
        await asyncio.sleep(2)


# -- workloads ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What every run of a workload shares: the inputs, each server's solo answers, and the run's shape."""

    args: argparse.Namespace
    prompts: list[str]  # the code workload's
    pool: list[str]  # every held-out prompt: chat code and long prompts are cut from it
    references: dict[str, dict[str, str]] = field(default_factory=dict)  # server url -> prompt -> solo answer


@dataclass
class Conversation:
    """A chat workload conversation: what each turn sent and what came back."""

    number: int
    turns: list[tuple[list[dict[str, str]], str]] = field(default_factory=list)


def user_message(turn: int, tag: str, number: int, plan: Plan) -> str:
    """Conversation ``number``'s user message at ``turn``: about held-out code cut from the bundled prompts."""
    chars = plan.args.chat_chars
    code = plan.pool[number % len(plan.pool)][-chars:]
    other = plan.pool[(number + 7) % len(plan.pool)][-chars:]
    return CHAT_TURNS[turn % len(CHAT_TURNS)].format(tag=tag, code=code, other=other)


def long_prompt(plan: Plan, tag: str, j: int) -> str:
    """The j-th long prompt of a burst run: held-out prompts joined to ``--long-chars``, after a line naming it,
    so no cached prefix of any other prompt covers more than a few tokens of it."""
    head = f"# request {tag}-{j}\n"
    body, i = "", j
    while len(body) < plan.args.long_chars:
        body += plan.pool[i % len(plan.pool)] + "\n\n"
        i += 1
    return head + body[: plan.args.long_chars]


async def code_streams(client: openai.AsyncOpenAI, clients: int, stop: float, plan: Plan,
                       reference: dict[str, str], stats: LoadStats) -> None:
    """Each client cycles through the code prompts (client i starts at prompt i) until ``stop``."""

    def check(prompt: str, reply: Reply) -> None:
        if prompt in reference:
            stats.checked += 1
            stats.identical += reply.text == reference[prompt]

    await closed_loop(client, clients, stop, plan.prompts, plan.args.n, stats, check)


async def run_code(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan) -> dict[str, Any]:
    stats = LoadStats()
    stop = time.perf_counter() + plan.args.seconds
    t0 = time.perf_counter()
    await asyncio.gather(sample_rss(server.pid, stop, stats),
                         code_streams(client, clients, stop, plan, plan.references.get(server.url, {}), stats))
    stats.wall = time.perf_counter() - t0
    return {"main": stats}


async def run_chat(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan) -> dict[str, Any]:
    """Client i holds conversations i, i + clients, ...; each turn resends the whole conversation."""
    stats = LoadStats()
    args = plan.args
    stop = time.perf_counter() + args.seconds
    done: list[Conversation] = []

    async def user(i: int) -> None:
        number = i
        while time.perf_counter() < stop:
            talk = Conversation(number)
            messages: list[dict[str, str]] = []
            for turn in range(args.chat_turns):
                if time.perf_counter() >= stop:
                    break
                text = user_message(turn, f"{clients}.{number}", number, plan)
                messages = messages + [{"role": "user", "content": text}]
                reply = await text_of(client, stats, args.n, messages=messages)
                if reply is None:
                    break
                talk.turns.append((messages, reply))
                messages = messages + [{"role": "assistant", "content": reply}]
            done.append(talk)
            number += clients

    t0 = time.perf_counter()
    await asyncio.gather(sample_rss(server.pid, stop, stats), *(user(i) for i in range(clients)))
    stats.wall = time.perf_counter() - t0
    return {"main": stats, "conversations": sorted(done, key=lambda c: c.number)}


async def run_burst(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan) -> dict[str, Any]:
    """The code streams, and bursts of long prompts at fixed times (open loop: both servers get the same bursts)."""
    streams, long = LoadStats(), LoadStats()
    args = plan.args
    start = time.perf_counter()
    stop = start + args.seconds

    async def bursts() -> None:
        tasks, m = [], 0
        while (at := start + args.burst_every * (m + 0.5)) < stop:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            prompts = [long_prompt(plan, f"{clients}.{m}", j) for j in range(args.burst_size)]
            tasks += [asyncio.create_task(stream(client, long, args.burst_n, prompt=p)) for p in prompts]
            m += 1
        await asyncio.gather(*tasks)

    await asyncio.gather(sample_rss(server.pid, stop, streams), bursts(),
                         code_streams(client, clients, stop, plan, plan.references.get(server.url, {}), streams))
    streams.wall = long.wall = time.perf_counter() - start
    return {"main": streams, "long": long}


def agent_grammars() -> list[str]:
    """Each agentic turn's grammar, as the GBNF text both servers get (llama.cpp's converter)."""
    from specstack.llama.schema_gbnf import schema_to_gbnf

    return [schema_to_gbnf(schema) for _, schema in AGENT_TASKS]


def agent_message(turn: int, number: int, plan: Plan) -> str:
    """Conversation ``number``'s user message at ``turn``: the document first, then one question a turn."""
    question = AGENT_TASKS[turn % len(AGENT_TASKS)][0] + " Answer with JSON only."
    if turn:
        return question
    doc = plan.pool[number % len(plan.pool)][-plan.args.chat_chars:]
    return f"Document {number}:\n\n```python\n{doc}\n```\n\n{question}"


@dataclass
class AgentStats(LoadStats):
    """The agentic and tools workloads' numbers: drafted and accepted tokens by turn, and by draft source
    (specstack's ``speculative.by_source``: the grammar's forced text apart from prompt lookup's or suffix's
    copies), beside ``LoadStats``' totals."""

    by_turn: dict[int, list[int]] = field(default_factory=dict)  # turn -> [drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted, accepted]

    def note(self, turn: int, reply: Reply) -> None:
        drafted, accepted = drafts_of(reply)
        cell = self.by_turn.setdefault(turn, [0, 0])
        cell[0] += drafted
        cell[1] += accepted
        for name, counts in ((reply.spec or {}).get("by_source") or {}).items():
            cell = self.by_source.setdefault(name, [0, 0])
            cell[0] += int(counts.get("drafted", 0))
            cell[1] += int(counts.get("accepted", 0))

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["acceptance_by_turn"] = {t: (a / d if d else 0.0) for t, (d, a) in sorted(self.by_turn.items())}
        out["by_source"] = {name: {"drafted": d, "accepted": a} for name, (d, a) in sorted(self.by_source.items())}
        return out


async def run_turns(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan,
                    ask: Callable[[int, int, str | None], str], grammar: Callable[[int], str]) -> dict[str, Any]:
    """Client i holds conversations i, i + clients, ...: each turn sends the user message ``ask(turn, number,
    last reply's text)``, constrained by ``grammar(turn)``, and the whole conversation is resent every turn
    (the agentic and tools workloads)."""
    stats = AgentStats()
    args = plan.args
    stop = time.perf_counter() + args.seconds

    async def user(i: int) -> None:
        number = i
        while time.perf_counter() < stop:
            messages: list[dict[str, str]] = []
            last: str | None = None
            for turn in range(args.chat_turns):
                if time.perf_counter() >= stop:
                    break
                messages = messages + [{"role": "user", "content": ask(turn, number, last)}]
                reply = await stream(client, stats, args.n, messages=messages, body={"grammar": grammar(turn)})
                if reply is None:
                    break
                stats.note(turn, reply)
                last = reply.text
                messages = messages + [{"role": "assistant", "content": last}]
            number += clients

    t0 = time.perf_counter()
    await asyncio.gather(sample_rss(server.pid, stop, stats), *(user(i) for i in range(clients)))
    stats.wall = time.perf_counter() - t0
    return {"main": stats}


async def run_agentic(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan) -> dict[str, Any]:
    """One document a conversation, a constrained record a turn."""
    grammars = agent_grammars()
    return await run_turns(client, server, clients, plan, lambda turn, number, _: agent_message(turn, number, plan),
                           lambda turn: grammars[turn % len(grammars)])


def tool_document(number: int, plan: Plan) -> tuple[str, str, str]:
    """Conversation ``number``'s file: its path, its text (the pool's held-out code, the last ``--chat-chars``), and
    the name of a function in it (the task's target; ``main`` where it defines none)."""
    doc = plan.pool[number % len(plan.pool)][-plan.args.chat_chars:]
    names = re.findall(r"^\s*def (\w+)", doc, flags=re.M)
    return f"src/module_{number % len(plan.pool)}.py", doc, names[0] if names else "main"


def tool_result(call: str, path: str, doc: str) -> str:
    """What the called tool gives back, as the next message: the file, the lines matching a grep, the edit's
    lines, or an error naming the call that could not be read (a pretrained model's call may be odd, never
    ungrammatical: the grammar holds it to the schema)."""
    try:
        parsed = json.loads(call)
        tool, args = parsed["tool"], parsed["args"]
    except (ValueError, KeyError, TypeError):
        return f"Error: could not read the call {call[:80]!r}. Call one tool as JSON."
    if tool == "read_file":
        return f"Contents of {args.get('path', path)}:\n\n```python\n{doc}\n```"
    if tool == "grep":
        pattern = str(args.get("pattern", ""))
        hits = [f"{i + 1}: {line}" for i, line in enumerate(doc.splitlines()) if pattern and pattern in line]
        return f"grep {pattern!r} {args.get('path', path)}:\n" + ("\n".join(hits[:12]) or "(no match)")
    if tool == "edit_file":
        return f"Edited {args.get('path', path)}: replaced {str(args.get('old', ''))!r} with {str(args.get('new', ''))!r}."
    return "Finished."


async def run_tools(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan) -> dict[str, Any]:
    """One file a conversation: the task first, then each tool call's result as the next message."""
    from specstack.llama.schema_gbnf import schema_to_gbnf

    grammar = schema_to_gbnf(TOOL_SCHEMA)

    def ask(turn: int, number: int, call: str | None) -> str:
        path, doc, name = tool_document(number, plan)
        if call is None:
            return TOOLS_PROMPT.format(number=number, path=path, name=name)
        return tool_result(call, path, doc)

    return await run_turns(client, server, clients, plan, ask, lambda turn: grammar)


def edit_messages() -> list[list[dict[str, str]]]:
    """The bench's grounded-edit workload as chat requests: a third-party function shown in the message, an edit
    asked of it, and the whole function asked back (the answer copies most of the message)."""
    from specstack.bench.workloads import load

    opening = "\n\n```python\n"  # the completion prompt's answer opening: the chat's reply starts there instead
    return [[{"role": "user", "content": r.prompt.removesuffix(opening).rstrip()}] for r in load("grounded-edit").requests]


async def run_edit(client: openai.AsyncOpenAI, server: Server, clients: int, plan: Plan) -> dict[str, Any]:
    """Client i cycles through the grounded edits from edit i, one chat request each (a single turn)."""
    stats = LoadStats()
    stop = time.perf_counter() + plan.args.seconds
    edits = edit_messages()

    async def user(i: int) -> None:
        j = i
        while time.perf_counter() < stop:
            await stream(client, stats, plan.args.n, messages=edits[j % len(edits)])
            j += clients

    t0 = time.perf_counter()
    await asyncio.gather(sample_rss(server.pid, stop, stats), *(user(i) for i in range(clients)))
    stats.wall = time.perf_counter() - t0
    return {"main": stats}


RUNNERS = {"code": run_code, "chat": run_chat, "agentic": run_agentic, "tools": run_tools, "edit": run_edit,
           "burst": run_burst}


async def solo_answers(client: openai.AsyncOpenAI, prompts: list[str], n: int) -> dict[str, str]:
    """Each code prompt's answer with the server otherwise idle: the reference for identical-to-solo. Also warms
    the server up (its first requests, and a host prompt cache both servers then hold alike)."""
    answers = {}
    for p in prompts:
        text = await text_of(client, Stats(), n, prompt=p)
        if text is not None:
            answers[p] = text
    return answers


async def check_chat(client: openai.AsyncOpenAI, conversations: list[Conversation], limit: int, n: int,
                     stats: LoadStats) -> None:
    """Replay the first ``limit`` conversations' turns alone, each with the messages it was sent under load."""
    for talk in [c for c in conversations if c.turns][:limit]:
        for messages, reply in talk.turns:
            alone = await text_of(client, Stats(), n, messages=messages)
            stats.checked += 1
            stats.identical += alone == reply


def run_point(server: Server, workload: str, clients: int, plan: Plan) -> dict[str, Any]:
    """One timed run; a chat run's conversations are then checked (untimed)."""
    result = with_client(server.url, lambda c: RUNNERS[workload](c, server, clients, plan))
    if workload == "chat" and plan.args.chat_check:
        with_client(server.url, lambda c: check_chat(c, result["conversations"], plan.args.chat_check, plan.args.n,
                                                     result["main"]))
    return result


# -- reports -----------------------------------------------------------------------------------------


def report(workload: str, clients: int, name: str, result: dict[str, Any]) -> str:
    s = result["main"].summary()
    check = f"identical to solo {s['identical']}/{s['checked']}" if s["checked"] else "identity not checked"
    line = (f"{workload:5s} {name:12s} clients {clients:3d}: {s['ok']} ok, {s['429']} x 429 (retried), "
            f"{s['reconnects']} stale connections (retried), {s['failures']} failures; {s['tok_s']:.1f} tok/s "
            f"aggregate; TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms; "
            f"ITL p50 {s['itl_p50_ms']:.1f} "
            f"ms p99 {s['itl_p99_ms']:.1f} ms; stall p99 {s['stall_p99_ms']:.0f} ms; {check}; "
            f"RSS {s['rss_mb']['start']:.0f} -> max {s['rss_mb']['max']:.0f} MB; "
            f"drafted {s['drafted']}, accepted {s['accepted']} ({s['acceptance']:.2f})")
    if "acceptance_by_turn" in s:
        by_turn = ", ".join(f"{t}: {a:.2f}" for t, a in s["acceptance_by_turn"].items())
        line += f"\n      acceptance by turn {by_turn or '-'}"
        sources = ", ".join(f"{n} {v['accepted']}/{v['drafted']}" for n, v in s.get("by_source", {}).items())
        line += f"; accepted/drafted by source {sources or '-'}"
    if "long" in result:
        g = result["long"].summary()
        line += (f"\n      long prompts: {g['ok']} ok, {g['failures']} failures, {g['prompt_tokens_mean']:.0f} prompt "
                 f"tokens each; TTFT p50 {g['ttft_p50_ms']:.0f} ms p99 {g['ttft_p99_ms']:.0f} ms")
    return line


def failures(result: dict[str, Any]) -> list[str]:
    return [f for key in ("main", "long") if key in result for f in result[key].failures]


def pair(a: dict[str, Any], b: dict[str, Any], key: str, digits: int = 0) -> tuple[str, str]:
    """``a``'s and ``b``'s p50 / p99 of one latency (ms), as two table cells."""
    return tuple(f"{s[key + '_p50_ms']:.{digits}f} / {s[key + '_p99_ms']:.{digits}f}" for s in (a, b))


def drafts(s: dict[str, Any]) -> str:
    """A run's accepted/drafted tokens and acceptance, as its replies reported them: a table cell."""
    return f"{s['accepted']}/{s['drafted']} ({s['acceptance']:.2f})" if s["drafted"] else "0/0"


def draft_check(rows: list[dict[str, Any]], setting: LlamaSetting) -> str:
    """A note for under the table: whether llama-server drafted, by its replies' ``timings`` (a speculation flag
    this build or model ignores would leave its runs plain without a word)."""
    ours = [r["main"] for r in rows if r["server"] == LLAMA]
    drafted, accepted = sum(s["drafted"] for s in ours), sum(s["accepted"] for s in ours)
    if drafted:
        return (f"llama-server ({setting.label}) drafted {drafted} tokens and accepted {accepted} "
                f"({accepted / drafted:.2f}), by its replies' timings (draft_n, draft_n_accepted)")
    if setting.flags or "--spec-type" in setting.label:
        return f"WARNING: llama-server ({setting.label}) drafted nothing in any run: its speculation did not run"
    return "llama-server ran without speculation"


def markdown(rows: list[dict[str, Any]]) -> str:
    """workload x clients: both servers' tok/s and ratio, TTFT and ITL p50/p99 (ms); burst's long prompts apart."""
    by = {(r["workload"], r["clients"], r["server"]): r for r in rows}
    points = sorted({(r["workload"], r["clients"]) for r in rows}, key=lambda p: (WORKLOADS.index(p[0]), p[1]))
    cells = []
    for w, c in points:
        a, b = by[(w, c, SPECSTACK)]["main"], by[(w, c, LLAMA)]["main"]
        ratio = a["tok_s"] / b["tok_s"] if b["tok_s"] else float("nan")
        same = (f"{a['identical']}/{a['checked']} / {b['identical']}/{b['checked']}" if a["checked"] or b["checked"]
                else "not checked")
        cells.append([w, c, f"{a['tok_s']:.1f}", f"{b['tok_s']:.1f}", f"{ratio:.2f}x", *pair(a, b, "ttft"),
                      *pair(a, b, "itl", 1), same, drafts(a), drafts(b)])
    out = markdown_table(["workload", "clients", "specstack tok/s", "llama-server tok/s", "ratio",
                          "TTFT p50 / p99 ms specstack", "llama-server", "ITL p50 / p99 ms specstack", "llama-server",
                          "identical to solo s / l", "accepted/drafted specstack", "llama-server"], cells)
    agentic = [p for p in points if p[0] in ("agentic", "tools")]
    if agentic:
        cells = []
        for w, c in agentic:
            a, b = by[(w, c, SPECSTACK)]["main"], by[(w, c, LLAMA)]["main"]
            turns = " / ".join(f"{x:.2f}" for x in a["acceptance_by_turn"].values())
            sources = ", ".join(f"{name} {v['accepted']}/{v['drafted']}" for name, v in a.get("by_source", {}).items())
            share = (f"{a['accepted'] / a['tokens']:.0%}" if a.get("tokens") else "-")
            cells.append([f"{w}, {c}", f"{a['accepted']}/{a['drafted']} ({a['acceptance']:.2f})",
                          f"{b['accepted']}/{b['drafted']} ({b['acceptance']:.2f})", sources or "-", share,
                          turns or "-"])
        out += "\n\n" + markdown_table(["workload, clients", "accepted/drafted specstack", "llama-server",
                                         "specstack accepted/drafted by source", "specstack tokens accepted from drafts",
                                         "specstack acceptance by turn"], cells)
    bursts = [p for p in points if p[0] == "burst"]
    if bursts:
        cells = []
        for w, c in bursts:
            a, b = by[(w, c, SPECSTACK)], by[(w, c, LLAMA)]
            cells.append([c, *pair(a["long"], b["long"], "ttft"), f"{a['main']['stall_p99_ms']:.0f}",
                          f"{b['main']['stall_p99_ms']:.0f}", f"{a['long']['prompt_tokens_mean']:.0f}"])
        out += "\n\n" + markdown_table(["burst, clients", "long-prompt TTFT p50 / p99 ms specstack", "llama-server",
                                         "stream stall p99 ms specstack", "llama-server", "long prompt tokens"], cells)
    return out


def record(workload: str, clients: int, server: Server, result: dict[str, Any]) -> dict[str, Any]:
    """A run as JSON: summaries, and the raw per-request numbers."""
    row: dict[str, Any] = {"workload": workload, "clients": clients, "server": server.name, "settings": server.label}
    for key in ("main", "long"):
        if key in result:
            row[key] = result[key].summary()
            row[key + "_raw"] = dataclasses.asdict(result[key])
    return row


# -- modes -------------------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> Plan:
    return Plan(args, held_out_prompts(args.prompts), held_out_prompts())


def prepare(server: Server, plan: Plan, others: list[Server]) -> None:
    """Warm a server up, let it settle (specstack measures a model it has not seen beside its first requests,
    and its call shapes may change when that ends), then keep its answers to the code prompts alone as the
    references."""
    t0 = time.perf_counter()
    with_client(server.url, lambda c: solo_answers(c, plan.prompts[:1], plan.args.n))
    wait_quiet([server, *others])
    plan.references[server.url] = with_client(server.url, lambda c: solo_answers(c, plan.prompts, plan.args.n))
    say(f"{server.name}: warmed up, {len(plan.references[server.url])} solo answers, {time.perf_counter() - t0:.1f} s "
        f"({server.label})")


SWEEP_COLUMNS: list[Column] = [("setting", "setting", str), ("tok_s", "tok/s", "{:.1f}".format),
                               ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}".format),
                               ("itl_p50_ms", "ITL p50 ms", "{:.1f}".format), ("ok", "ok", str),
                               ("failures", "failures", str)]


def llama_sweep(args: argparse.Namespace, plan: Plan, parallel: int) -> tuple[LlamaSetting, list[dict[str, Any]]]:
    """Each llama-server setting on ``--llama-sweep-workload`` at ``--llama-sweep-clients``: the fastest without
    failures wins. Each gets a fresh server with the main run's slots and a warm-up request."""
    rows = []
    sweep_args = argparse.Namespace(**{**vars(args), "seconds": args.llama_sweep_seconds})
    sweep_plan = dataclasses.replace(plan, args=sweep_args, references={})
    for setting in llama_settings(args):
        try:
            server = spawn_llama(args, parallel, setting)
        except ServerFailed as exc:  # a setting this build or model refuses: reported, not fatal
            say(f"llama-sweep {setting.label:22s}: did not start\n{exc}")
            continue
        try:
            with_client(server.url, lambda c: solo_answers(c, plan.prompts[:1], args.n))  # warm-up
            wait_quiet([server])
            runner = RUNNERS[args.llama_sweep_workload]
            stats = with_client(server.url, lambda c: runner(c, server, args.llama_sweep_clients, sweep_plan))["main"]
        finally:
            server.stop()
        s = stats.summary()
        rows.append({"setting": setting.label, "flags": list(setting.flags), **s})
        say(f"llama-sweep {setting.label:22s}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms, ITL p50 "
            f"{s['itl_p50_ms']:.1f} ms, {s['ok']} ok, {s['failures']} failures")
    if not rows:
        raise ServerFailed("no llama-server setting started")
    ok = [r for r in rows if r["failures"] == 0 and r["ok"]] or rows
    best = max(ok, key=lambda r: r["tok_s"])
    print(f"\nllama-server sweep at {args.llama_sweep_clients} clients, {args.llama_sweep_seconds:g} s each:\n")
    print(table([{**r, "setting": r["setting"] + (" **(winner)**" if r is best else "")} for r in rows], SWEEP_COLUMNS))
    print(f"\nwinner: {best['setting']} ({' '.join(best['flags']) or 'no speculation flags'})\n", flush=True)
    return LlamaSetting(best["setting"], tuple(best["flags"])), rows


def agree(plan: Plan, servers: list[Server]) -> str:
    """Whether the two servers' solo greedy answers to the code prompts are the same text (the same model and
    greedy decoding: each one's speculation is lossless, so they should be, up to kernels' last bits)."""
    a, b = (plan.references.get(s.url, {}) for s in servers)
    both = [p for p in a if p in b]
    same = sum(a[p] == b[p] for p in both)
    return f"the servers' solo answers agree on {same}/{len(both)} code prompts"


def check_chat_template(servers: list[Server]) -> None:
    """Warn if the servers format one chat message into different prompt lengths (different chat templates)."""
    lengths = {}
    for server in servers:
        stats = Stats()
        with_client(server.url, lambda c: stream(c, stats, 1, messages=[{"role": "user", "content": "Hello."}]))
        lengths[server.name] = stats.prompt_tokens[-1] if stats.prompt_tokens else None
    same = len(set(lengths.values())) == 1
    say(f"chat template check: one user message is {lengths} prompt tokens"
        f"{'' if same else ' -- WARNING: the servers format chats differently (--chat-template)'}")


def run_peer(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    workloads = args.workload.split(",")
    counts = [int(c) for c in args.sweep.split(",")]
    parallel = max(counts) + (args.burst_size if "burst" in workloads else 0)
    sweep: list[dict[str, Any]] = []
    setting = fixed_llama_setting(args)
    if args.llama_sweep:
        setting, sweep = llama_sweep(args, plan, parallel)
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    saved = {"args": vars(args), "llama_sweep": sweep, "llama_setting": dataclasses.asdict(setting),
             "parallel": parallel, "results": rows}
    try:
        servers = [spawn_specstack(args, parallel), spawn_llama(args, parallel, setting)]
        say(f"logs: {', '.join(str(s.log) for s in servers)}")
        for server in servers:
            prepare(server, plan, servers)
        agreement = agree(plan, servers)
        say(agreement)
        if {"chat", "agentic", "tools", "edit"} & set(workloads):
            check_chat_template(servers)
        for k, (clients, workload) in enumerate((c, w) for c in counts for w in workloads):
            for server in (servers if k % 2 == 0 else servers[::-1]):
                wait_quiet(servers)
                result = run_point(server, workload, clients, plan)
                say(report(workload, clients, server.name, result))
                for f in failures(result)[:5]:
                    print("  failure:", f)
                rows.append(record(workload, clients, server, result))
                write_json(args.json, saved)  # after every run: an interrupted run keeps what it measured
    finally:
        for server in servers:
            server.stop()
    print(f"\nspecstack: {servers[0].label}; llama-server: {servers[1].label}; "
          f"{parallel} slots each, {slot_context(args)} positions per slot, {args.threads} threads, {args.seconds:g} s "
          f"per run, {args.n} tokens per request\n")
    print(markdown(rows))
    print(f"\n{draft_check(rows, setting)}; {agreement}")
    if args.json:
        print(f"\nwrote {args.json}")


def run_single(args: argparse.Namespace) -> None:
    """``--spawn`` (a fresh server per client count, slots = clients) or ``--url``."""
    plan = make_plan(args)
    counts = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.clients]
    rows = []
    for clients in counts:
        server = Server(args.url or "", args.url or "")
        if args.spawn:
            parallel = clients if args.sweep else args.parallel
            server = (spawn_specstack(args, parallel) if args.spawn == SPECSTACK
                      else spawn_llama(args, parallel, fixed_llama_setting(args)))
        try:
            prepare(server, plan, [])
            for workload in args.workload.split(","):
                wait_quiet([server])
                result = run_point(server, workload, clients, plan)
                say(report(workload, clients, args.spawn or args.url, result))
                for f in failures(result)[:5]:
                    print("  failure:", f)
                rows.append(record(workload, clients, server, result))
                write_json(args.json, {"args": vars(args), "results": rows})
        finally:
            server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="an already running server")
    mode.add_argument("--spawn", choices=(SPECSTACK, LLAMA), help="start this server for each client count")
    mode.add_argument("--peer", choices=(LLAMA,), help="specstack against this server, interleaved, in one run")
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("-md", "--model-draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--drafter", default=None, help="specstack's default drafter (default: mtp on a target with a "
                    "NextN head, else prompt-lookup)")
    ap.add_argument("-k", "--draft-max", dest="k", type=int, default=None,
                    help="draft tokens a step at most, both servers: specstack's -k and --k-max, llama-server's "
                    f"--spec-draft-n-max (draft-mtp, or -md with --llama-draft). Default: {MTP_K} on a target with a "
                    "NextN head (specstack's default k), else each server's own")
    ap.add_argument("--specstack-args", default="", help="extra specstack serve flags, e.g. '--exact off'")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. '--spec-draft-n-max 8'")
    ap.add_argument("--llama-draft", action="store_true", help="give llama-server the draft model (-md)")
    ap.add_argument("--llama-sweep", action="store_true",
                    help="with --peer: first try llama-server's speculation settings and keep the fastest")
    ap.add_argument("--llama-n-max", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8],
                    help="--spec-draft-n-max values the sweep tries (default 2,4,8)")
    ap.add_argument("--llama-sweep-clients", type=int, default=4)
    ap.add_argument("--llama-sweep-seconds", type=float, default=20)
    ap.add_argument("--llama-sweep-workload", choices=WORKLOADS, default=None,
                    help="the workload the sweep judges settings on (default: the first of --workload)")
    ap.add_argument("--chat-template", default=None, help="both servers' chat template: a llama.cpp built-in name "
                    "(gemma, chatml, ...) or a Jinja file")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=0,
                    help="context per slot, both servers (default: 4096, or the trained context if shorter)")
    ap.add_argument("--cache-ram", type=int, default=512, help="MiB of host prompt cache, both servers (default 512)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--sweep", default=None, help="comma-separated client counts (--peer: default 1,2,4,8)")
    ap.add_argument("--parallel", type=int, default=4, help="server slots with --spawn and without --sweep")
    ap.add_argument("--workload", default=None,
                    help="comma-separated: code, chat, agentic, tools, edit, burst (default: code; --peer: all)")
    ap.add_argument("--seconds", type=float, default=120, help="each run's length")
    ap.add_argument("-n", type=int, default=64, help="tokens per request (chat: per turn)")
    ap.add_argument("--prompts", type=int, default=12, help="code prompts cycled")
    ap.add_argument("--chat-turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--chat-chars", type=int, default=900, help="characters of code in a chat message (the last ones)")
    ap.add_argument("--chat-check", type=int, default=1,
                    help="conversations per chat run replayed alone to check identical-to-solo (0: none)")
    ap.add_argument("--burst-every", type=float, default=None,
                    help="seconds between bursts, the first at half of it (default --seconds: one burst, mid-run)")
    ap.add_argument("--burst-size", type=int, default=2, help="long prompts per burst (default 2)")
    ap.add_argument("--burst-n", type=int, default=8, help="tokens per long prompt")
    ap.add_argument("--long-chars", type=int, default=5400, help="characters per long prompt (default 5400: about "
                    "1,600 Gemma tokens)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every result here")
    args = ap.parse_args(argv)
    if args.peer:
        args.sweep = args.sweep or "1,2,4,8"
    args.workload = args.workload or (",".join(WORKLOADS) if args.peer else "code")
    unknown = set(args.workload.split(",")) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workload {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOADS)}")
    args.burst_every = args.burst_every or args.seconds
    args.llama_sweep_workload = args.llama_sweep_workload or args.workload.split(",")[0]
    if args.llama_sweep and not args.peer:
        ap.error("--llama-sweep goes with --peer")
    if args.k is not None and args.k < 1:
        ap.error(f"-k must be >= 1 (got {args.k})")
    args.mtp = not args.url and has_mtp(args.model)  # what llama-server drafts with from this model: its own head
    args.drafter = args.drafter or ("mtp" if args.mtp else DEFAULT_DRAFTER)
    args.k = args.k or (MTP_K if args.mtp else None)
    return args


def main() -> None:
    args = parse_args()
    try:
        run_peer(args) if args.peer else run_single(args)
    except ServerFailed as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
