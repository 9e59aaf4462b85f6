"""``specstack serve``: an OpenAI-compatible server with speculation per request, roles and a live page."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..calibration import EXACT_MODES
from ..drafters.base import DEFAULT_DRAFTER
from ..errors import InvalidParameterError
from ..paths import DEFAULT_DRAFT
from ..loading import bundled_draft_check, bundled_draft_fits, resolve_draft
from ..llama.vocab import check_grammar
from .common import (ROPE_FLAGS, add_constraint_args, add_loading_args, apply_process_flags, at_least,
                     constraints_from_args, flag_given, json_schema_text, llama_load_values, settle_flash_attn)
from .llama_server_flags import (add_llama_server_args, api_key_from_file, check_sampling_flags, metrics_endpoint,
                                 speculation_values)

# The flags that make the one role served without --config: (flag, args attribute, Role key).  Each defaults to
# None (the Role's own default applies), so a flag given beside --config, which it cannot change, is told apart.
ROLE_FLAGS = (("-m", "model", "model"), ("-md", "model_draft", "draft"), ("-np", "parallel", "parallel"),
              ("--drafter", "drafter", "drafter"), ("--k-policy", "k_policy", "k_policy"), ("-k", "k", "k"),
              ("--k-max", "k_max", "k_max"), ("-t", "threads", "threads"),
              ("--ctx-per-slot", "ctx_per_slot", "ctx"), ("--exact", "exact", "exact"),
              ("--rollback", "rollback", "rollback"),
              ("--chat-template", "chat_template", "chat_template"), ("--cache-ram", "cache_ram", "cache_mb"),
              ("--batch-tokens", "batch_tokens", "batch_tokens"), ("--prefill-cap", "prefill_cap", "prefill_cap"),
              # llama.cpp's flags: loading options and request defaults (the role keys of the same names)
              ("-fa", "flash_attn", "flash_attn"), ("--mlock", "mlock", "mlock"), ("--no-mmap", "mmap", "mmap"),
              ("-ctk", "cache_type_k", "cache_type_k"), ("-ctv", "cache_type_v", "cache_type_v"),
              ("-s", "seed", "seed"), ("--repeat-penalty", "repeat_penalty", "repeat_penalty"),
              ("--repeat-last-n", "repeat_last_n", "repeat_last_n"),
              ("--presence-penalty", "presence_penalty", "presence_penalty"),
              ("--frequency-penalty", "frequency_penalty", "frequency_penalty"), ("--grammar", "grammar", "grammar"),
              ("--grammar-file", "grammar_file", "grammar_file"), ("-j", "json_schema", "json_schema"),
              ("--temp", "temperature", "temperature"), ("--top-k", "top_k", "top_k"), ("--top-p", "top_p", "top_p"),
              ("--min-p", "min_p", "min_p"), ("--spec-draft-p-min", "p_min", "p_min"),
              ("--ignore-eos", "ignore_eos", "ignore_eos"), ("-l", "logit_bias", "logit_bias"),
              ("--samplers/--sampler-seq", "samplers", "samplers"),
              ("--reasoning-format", "reasoning_format", "reasoning_format"), ("--reasoning", "reasoning", "reasoning"))
# Flags beside ROLE_FLAGS that also describe the one role, worked out in ``build_roles``.
ROLE_EXTRA = (("-c", "ctx_size"), ("-b", "batch_size"), ("-ub", "ubatch_size"), ("-jf", "json_schema_file"),
              ("-a", "alias"), ("--tags", "tags"), ("--spec-type", "spec_type"), ("--spec-draft-n-max", "n_max"),
              # llama.cpp's further loading flags (``common.llama_load_values``)
              ("-tb", "threads_batch"), ("--override-kv", "override_kv"), ("--load-mode", "load_mode"),
              ("--lazy-mode", "lazy_mode"), ("--check-tensors", "check_tensors"), ("-nr", "repack"),
              ("--special", "special"), ("--rope-scaling", "rope_scaling"), ("--rope-scale", "rope_scale"),
              *((flag, field) for flag, field, _ in ROPE_FLAGS))
READY_POLL_S = 0.1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, metrics, live page)",
        # one line: the whole usage of serve's and llama-server's flags is a hundred lines above every error
        usage="specstack serve [-h] [OPTIONS]  (specstack serve --help lists them: specstack's and llama-server's)",
        description="Serve one or more models over an OpenAI-compatible API: /v1/completions, /v1/chat/completions "
        "(streaming with stream_options.include_usage), /v1/models, /health, /metrics (Prometheus) and a live page at /. "
        "Every request may override speculation with a 'speculative' object, e.g. "
        '{"drafter": "draft-model", "k_policy": "fixed", "k": 8}; responses report drafted/accepted tokens by source. '
        "Without --config the bundled pair is served as one role.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="roles.toml example (the request's 'model' picks the role; the first is the default):\n\n"
        "  [roles.frontdoor]\n  model = \"small.gguf\"\n  drafter = \"prompt-lookup\"\n  parallel = 4\n\n"
        "  [roles.coder]\n  model = \"coder-q4_k_m.gguf\"\n  draft = \"coder-draft.gguf\"\n"
        "  drafter = \"cascade:suffix,prompt-lookup,draft-model\"\n  threads = 16\n  ctx = 8192\n\n"
        "  [roles.architect]\n  model = \"big-q4_k_m.gguf\"\n  draft = \"big-draft.gguf\"\n"
        "  profile = \"architect.toml\"   # from `specstack tune`\n\n"
        "keys: model, draft, drafter, k_policy, k, k_max, threads, ctx (per slot), parallel, kv_unified (-kvu: the "
        "slots share one pool of ctx cells), exact, rollback, cache_mb, "
        "batch_tokens, prefill_cap, profile, category, chat_template, tool_call_format, replicas (with --ray), experts, "
        "tree, rollback_depth, flash_attn, ubatch_size, mmap, mlock, cache_type_k, cache_type_v, and request defaults "
        "seed, repeat_penalty, "
        "repeat_last_n, frequency_penalty, presence_penalty, grammar, grammar_file, json_schema, temperature, top_k, top_p, "
        "min_p, ignore_eos, logit_bias, samplers, p_min (draft-model/mtp), reasoning_format and reasoning (see "
        "docs/serve.md)",
    )
    p.add_argument("--config", type=Path, default=None, help="roles file (TOML); default: the bundled pair as one role. "
                   "It sets every role's model and engine: the flags marked 'without --config' cannot go with it")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only); a comma "
                   "list listens on each, as llama-server's (--host 127.0.0.1,::1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-np", "--parallel", type=slots, default=None,
                   help="slots per role without --config: generations batched together (default 4); -1: "
                   "llama-server's auto, 4 slots sharing one KV pool of -c cells (as -np 4 -kvu: any slot may "
                   "fill it)")
    p.add_argument("--max-queue", type=at_least(0), default=16,
                   help="requests that may wait for a slot; past it the answer is 429 with Retry-After (default 16)")
    p.add_argument("--api-key", default=os.environ.get("SPECSTACK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECSTACK_API_KEY, else none); "
                   "/health stays open. An empty key is refused")
    p.add_argument("--timeout", "-to", type=at_least(0, float), default=600.0,
                   help="seconds a request may take before it is stopped (default 600, as llama-server's -to; 0 = none)")
    p.add_argument("--max-tokens", type=at_least(0), default=0, help="largest max_tokens a request may ask for, and where "
                   "a request without one stops (default 0: no bound but the context's end, as llama-server)")
    p.add_argument("--max-prompt-tokens", type=at_least(0), default=0, help="longest prompt in tokens (default: the context)")
    p.add_argument("--max-body", type=at_least(1), default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--drafter", default=None, help=f"default drafter without --config (default {DEFAULT_DRAFTER})")
    p.add_argument("--k-policy", default=None, help="default k policy without --config (default cost)")
    p.add_argument("-k", dest="k", type=at_least(1), default=None,
                   help="default k without --config: draft tokens per step under --k-policy fixed, the start of window "
                   "and heuristic (default 4; the roles file's k; a request's speculative.k)")
    p.add_argument("--k-max", type=at_least(1), default=None,
                   help="default upper bound on k without --config, for the adaptive policies (default 16 for cost; the "
                   "roles file's k_max; a request's speculative.k_max). llama-server's --spec-draft-n-max is the "
                   "nearest: -k N --k-max N drafts at most N tokens a step, as it does")
    p.add_argument("-m", "--model", type=Path, default=None, help="target GGUF without --config (default: bundled pycoder-6m)")
    p.add_argument("-md", "--model-draft", "--spec-draft-model", type=Path, default=None,
                   help="draft GGUF without --config, for the draft-model drafter (the role's or a request's; default: "
                   "the bundled pycoder-1m with the bundled target, else only if `specstack check` finds its "
                   "vocabulary identical or compatible with -m)")
    p.add_argument("-t", "--threads", type=at_least(0), default=None, help="threads without --config (default: physical "
                   "cores; with --ray: the CPUs shared out among the replicas)")
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("-c", "--ctx-size", type=at_least(0), default=None,
                     help="context of all slots together without --config, as llama-server's -c: each of the -np slots "
                     "gets an equal share (-c 16384 -np 4: 4096 per slot; 0 = the model's trained context, shared "
                     "out), or with -kvu one pool of -c that any slot may fill. Default: 4096 per slot (-kvu: a "
                     "4096 pool), or the model's trained context if shorter. Each role's context per slot and KV "
                     "cache size are printed at load")
    ctx.add_argument("--ctx-per-slot", "--kv-unified-per-slot", type=at_least(0), default=None, metavar="N",
                     help="context of each slot without --config (the roles file's ctx key; 0 = the model's trained "
                     "context)")
    p.add_argument("--exact", choices=EXACT_MODES, default=None,
                   help="exact call shapes without --config: auto (default), on or off (see `specstack generate --help`); "
                   "/health and /v1/models say which mode each role runs in and why. Without exactness several slots "
                   "share one unified KV cache with flash attention, so auto's first run with several slots measures its "
                   "verdict before serving (seconds, once per model, threads and slots; cached)")
    p.add_argument("--rollback", choices=("auto", "rollback", "checkpoint"), default=None,
                   help="recurrent/hybrid targets without --config: how rejected drafts leave the state "
                   "(see `specstack generate --help`)")
    p.add_argument("--chat-template", "--chat-template-file", default=None, metavar="NAME|FILE",
                   help="chat format without --config: one of llama.cpp's built-in templates by name (gemma, chatml, "
                   "llama3, mistral-v7, phi4, ...; an unknown name lists them all) or a Jinja template file. Default: the "
                   "GGUF's tokenizer.chat_template; a model without one gets chatml (llama-server's fallback) and a warning")
    p.add_argument("-cram", "--cache-ram", type=at_least(0), default=None, help="MiB of host memory for finished prompts' KV, "
                   "restored instead of prefilled when a prompt comes back, without --config (default 512; 0 = off)")
    p.add_argument("--batch-tokens", type=at_least(0), default=None,
                   help="rows one engine step may process without --config (like vLLM's max_num_batched_tokens): the "
                   "running generations' pending and draft tokens first, then waiting prompts in chunks, so a long "
                   "prompt never stalls the streams (default 512; 0 = prefill each prompt whole when it is admitted)")
    p.add_argument("--prefill-cap", type=at_least(1), default=None,
                   help="prompt tokens of one request per step at most, without --config, so one long prompt cannot take "
                   "a whole step (default 256; rounded to the 128-token chunks a solo run prefills)")
    llama = p.add_argument_group("llama-server's flags (same meaning; see docs/serve.md)")
    llama.add_argument("-a", "--alias", default=None, metavar="NAME", help="the model name without --config: the role's "
                       "name in responses and /v1/models, and the name requests pick it by (default: the model file's "
                       "name)")
    llama.add_argument("--tags", default=None, metavar="A,B", help="labels of the model without --config, shown under "
                       "'tags' in /v1/models (llama-server's); -a takes several names the same way (A,B: the id is the "
                       "first in sorted order, and every one picks the model)")
    llama.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None, metavar="N",
                       help="tokens a request generates when it gives no max_tokens (default -1, as llama-server's: "
                       "until the end of text or of the slot's context, or --max-tokens where given)")
    llama.add_argument("-s", "--seed", type=int, default=None, help="sampling seed of a request that gives none "
                       "(default: each request its own random one; -1: random)")
    llama.add_argument("--jinja", action="store_true", help="accepted for llama-server command lines: the GGUF's Jinja "
                       "chat template is always what chat uses (sandboxed), tools included")
    llama.add_argument("--no-slots", dest="slots", action="store_false", default=True, help="turn GET /slots off")
    add_loading_args(llama, unset=True)
    add_llama_server_args(p, llama)
    add_constraint_args(p, unset=True)
    ray = p.add_argument_group("scale-out on Ray Serve (pip install 'specstack[ray]'; see docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true", help="serve each role as a Ray Serve deployment of replicas, "
                     "requests routed to the replica holding their prefix or session; the same API")
    ray.add_argument("--address", default=None, help="with --ray: the Ray cluster to join ('auto': the one `ray start` "
                     "runs on this machine); default: start a local Ray instance, stopped again on SIGTERM")
    ray.add_argument("--replicas", type=at_least(1), default=None, help="with --ray: engines per role (default: each "
                     "role's 'replicas' key, else 1); each asks Ray for its role's threads as CPUs, and a layout that "
                     "does not fit the CPUs is refused before anything is deployed")
    ray.add_argument("--routing", choices=("prefix", "session", "pow2"), default="prefix",
                     help="with --ray: prefix (default: the replica holding the longest prefix, else the session's, "
                     "else the least loaded), session (x-session-id or 'user' only) or pow2 (Ray's default)")
    ray.add_argument("--suffix-log", type=Path, default=None, metavar="PATH",
                     help="with --ray: checkpoint the finished outputs the replicas share (suffix statistics) to "
                     "PATH (a folder: one file per role), and load them back at start")
    ray.add_argument("--no-share-suffix", action="store_true",
                     help="with --ray: each replica keeps its own suffix statistics")
    p.set_defaults(func=run)


def build_roles(args: argparse.Namespace):
    """The roles file's roles, or the one role the flags describe; a role flag beside --config is refused
    (``--config roles.toml -m X`` used to serve the file's model without a word about -m)."""
    from ..paths import DEFAULT_TARGET
    from ..server.roles import Role, default_roles, load_roles

    given = [(flag, key) for flag, attr, key in ROLE_FLAGS if getattr(args, attr) is not None]
    given += [(flag, attr) for flag, attr in ROLE_EXTRA if getattr(args, attr, None) is not None]
    given += [("-kvu", "kv_unified")] if args.kv_unified else []
    if args.config is not None:
        if given:
            raise InvalidParameterError(
                f"--config {args.config} sets every role, so {', '.join(f for f, _ in given)} would be ignored: "
                f"set {', '.join(ROLE_KEYS.get(k, k) for _, k in given)} in the file's [roles.NAME] tables, or leave "
                "--config out")
        return load_roles(args.config)
    settle_flash_attn(args)  # -fa on (or a quantized -ctv): exactness off, or refused under --exact on
    constraints_from_args(args)  # the penalties' ranges and the grammar flags, named by flag
    values = {key: getattr(args, attr) for flag, attr, key in ROLE_FLAGS if getattr(args, attr) is not None}
    unified = bool(args.kv_unified)
    if values.get("parallel") == -1:  # llama-server's auto: 4 slots, one unified KV cache
        values["parallel"], unified = AUTO_SLOTS, True
    values.update(llama_load_values(args))  # -tb, --override-kv, --load-mode, RoPE/YaRN, --special, ...
    check_sampling_flags(args)
    values.update(speculation_values(args))  # --spec-type, --spec-draft-n-max, -md alone: llama-server's meanings
    if args.batch_size is not None or args.ubatch_size is not None:  # llama.cpp: n_ubatch = min(-b, -ub)
        values["ubatch_size"] = min(args.batch_size or 2048, args.ubatch_size or 512)
    schema = json_schema_text(args) if args.json_schema_file is not None else None
    if schema is not None:
        values["json_schema"] = schema
    if args.ctx_size is not None:
        # -kvu: llama-server's unified KV lets one sequence use the whole -c, so each slot may reach all of it
        shared_by = 1 if unified else values.get("parallel", 4)
        values["ctx"] = ctx_per_slot(args.ctx_size, shared_by, values.get("model", DEFAULT_TARGET))
    # ...in one pool of -c cells they share; --ctx-per-slot N (llama-server's --kv-unified-per-slot) sizes it
    # -np x N, each slot N, which never runs over: the per-slot layout
    values["kv_unified"] = unified and args.ctx_per_slot is None
    if values["kv_unified"] and values.get("parallel", 4) > 1 and values.get("exact") == "on":
        raise InvalidParameterError("--exact on cannot go with -kvu (or -np -1): the slots' cells interleave in "
                                    "their shared KV pool, which no call shape keeps exact; use --exact off or auto, "
                                    "or leave -kvu out (each slot then gets -c / -np)")
    if args.tags is not None:
        values["tags"] = names_list(args.tags, "--tags")
    if args.alias is not None:
        aliases = names_list(args.alias, "--alias")
        # llama-server's model id is the first alias in sorted order; every alias picks the model
        return [Role(name=min(aliases), aliases=aliases if len(aliases) > 1 else (), **values)]
    return default_roles(**values)


def names_list(text: str, flag: str) -> tuple[str, ...]:
    """A comma list of names (llama-server's -a A,B and --tags), none of them empty."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise InvalidParameterError(f"{flag} is empty or has an empty name (got {text!r}); give the names clients "
                                    "should ask for, comma-separated, or leave it out")
    return names


ROLE_KEYS = {"ctx_size": "ctx", "kv_unified": "kv_unified = true", "batch_size": "ubatch_size", "json_schema_file": "json_schema", "alias": "the table names",
             "tags": "tags",
             "spec_type": "drafter", "n_max": "k and k_max", "override_kv": "kv_overrides",
             "load_mode": "mmap, mlock or direct_io", "lazy_mode": "model_params", "check_tensors": "model_params",
             "rope_scaling": "context_params", "rope_scale": "context_params",
             **{field: "context_params" for _, field, _ in ROPE_FLAGS}}
AUTO_SLOTS = 4  # llama-server's -np -1 (auto): 4 slots and a unified KV cache (tools/server/server.cpp)


def slots(text: str) -> int:
    """-np: a slot count >= 1, or -1 (llama-server's auto)."""
    value = at_least(-1)(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1, or -1 for llama-server's auto (4 slots, unified KV) (got 0)")
    return value


def ctx_per_slot(total: int, slots: int, model: Path) -> int:
    """llama-server's -c (all slots together) as the context of each slot: an equal share, as llama-server
    gives (0: the model's trained context, shared out the same way)."""
    if total == 0:
        from ..modelfile.meta import read_gguf

        total = read_gguf(model, tensors=False).context_length or 0
        if not total:
            return 0  # the trained context is not in the file's metadata: each slot gets the model's own
    share = total // slots
    if share < 1:
        raise InvalidParameterError(f"-c {total} cannot be shared out among {slots} slots (-np); give at least "
                                    f"{slots} positions, or use --ctx-per-slot")
    return share


def default_tokens(args: argparse.Namespace) -> int:
    """-n: what a request that names no max_tokens generates; -1 (the default, llama-server's) runs to the end of
    text or of the context (``jobs._max_tokens`` resolves it per request, since the room left depends on the
    prompt).  A 16-token default, OpenAI's legacy completions value, cut every agent framework's tool call short."""
    if args.n_predict is None or args.n_predict == -1:
        return -1
    bound = args.max_tokens or None
    if args.n_predict < 1 or (bound is not None and args.n_predict > bound):
        within = f"1..{bound} (--max-tokens)" if bound else ">= 1"
        raise InvalidParameterError(f"-n {args.n_predict} must be {within}, or -1 to run to the end of text or of "
                                    "the context")
    return args.n_predict


def request_limits(args: argparse.Namespace, limits: type) -> Any:
    """What one request may ask for, from the flags (``server.backends.Limits``, passed in so this module imports
    no server package before ``run`` has checked they are installed)."""
    return limits(max_body_bytes=args.max_body, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                  timeout_s=args.timeout, default_max_tokens=default_tokens(args))


def check_api_key(args: argparse.Namespace) -> None:
    """An empty key would leave /v1 open while the user believes it is protected: refuse it, naming its source.
    llama-server's --api-key-file gives it from a file (beside --api-key it is refused: two keys)."""
    if args.api_key_file is not None:
        if flag_given(args, "--api-key"):
            raise InvalidParameterError("--api-key and --api-key-file each give the API key; pass one of them")
        args.api_key = api_key_from_file(args.api_key_file)
    if args.api_key is None or args.api_key.strip():
        return
    source = "--api-key" if flag_given(args, "--api-key") else "$SPECSTACK_API_KEY (set but empty)"
    raise InvalidParameterError(f"{source} gives an empty API key, which would serve /v1 to anyone: give a non-empty "
                                "key, or leave --api-key out and unset SPECSTACK_API_KEY to serve without one")


def check_roles(roles: list, from_config: bool) -> list:
    """Every role checked as far as it can be without loading weights, before the port is bound: its model file and
    metadata, drafter name and whether the drafter can be built here, its draft model (resolved: ``resolve_draft``)
    and chat template.  A role that failed here used to leave a server up answering 503 forever."""
    from ..modelfile.meta import read_gguf
    from ..server.chat import load_template
    from ..llama import check_gguf_file

    checked = []
    for role in roles:
        label = f"role {role.name!r}" if from_config else "-m"
        read_gguf(check_gguf_file(role.model, f"{label} model" if from_config else "model (-m)"), tensors=False)
        role = check_drafter(role, from_config)
        try:
            load_template(role.model, role.chat_template)  # a Jinja template is compiled: a syntax error stops here
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"{label}: {exc}" if from_config else str(exc)) from None
        check_grammar(role.model, role.controls().grammar, f"{label}'s grammar" if from_config else "the grammar "
                      "(--grammar, --grammar-file, -j or -jf)")
        check_logit_bias(role, f"{label}: logit_bias" if from_config else "-l/--logit-bias")
        checked.append(role)
    return checked


def check_logit_bias(role, where: str) -> None:
    """The role's logit biases (``-l``, the roles file's logit_bias) name tokens of its model's vocabulary: checked
    on a vocabulary-only load before anything is served, where a bad id would otherwise fail every request that
    takes the defaults (400) while the server looked healthy."""
    if not role.logit_bias:
        return
    from ..llama.vocab import VocabModel

    vocab = VocabModel(role.model)
    try:
        n_vocab = vocab.n_vocab
    finally:
        vocab.close()
    bad = [token for token, _ in role.logit_bias if token >= n_vocab]
    if bad:
        raise InvalidParameterError(f"{where}: token id {bad[0]} is outside the vocabulary of {role.model.name} "
                                    f"(0..{n_vocab - 1}); give an id of this model's tokens (a server's /tokenize "
                                    "shows a text's ids)")


def check_drafter(role, from_config: bool):
    """The role's drafter: a valid name, buildable by a server (no datastore can be given to one), what it needs of
    the model there (``Needs.check``: mtp a NextN head, moe-self experts), with its draft model resolved and checked;
    returns the role with its draft settled. Asked of the registry (``drafters.base``), never by drafter name."""
    from ..drafters.base import Asked, check_target, needs_datastore, reads_draft_model
    from ..modelfile.compat import require_draftable
    from ..modelfile.meta import read_gguf
    from ..llama import check_gguf_file
    from ..server.roles import SERVE_ALTERNATIVES

    where = f"role {role.name!r}'s drafter" if from_config else "--drafter"
    stored = needs_datastore(role.drafter, where)  # the name checked first
    if stored is not None:
        raise InvalidParameterError(f"{where} {role.drafter!r} needs {stored}'s datastore, and specstack serve cannot "
                                    f"be given one; choose {SERVE_ALTERNATIVES} (or a cascade of them)")
    meta = read_gguf(role.model, tensors=False)  # the model's metadata, read once
    # what each drafter needs of the model (mtp: a NextN head; moe-self: experts): one line, before the load
    given = {"draft_model": role.draft} if role.draft is not None else {}  # eagle3's head, gemma4's assistant
    check_target(role.drafter, meta, Asked(f"{where} {role.drafter}", given, alternatives=f"{SERVE_ALTERNATIVES}; "
                                            "mtp needs a model with NextN layers (`specstack check -m MODEL` lists "
                                            "them)"))
    if role.draft is not None:  # given: checked now, whatever the drafter (a request may ask for draft-model)
        check_gguf_file(role.draft, f"role {role.name!r} draft model" if from_config else "draft model (-md)")
        require_draftable(role.model, role.draft)
    fix = f'draft = "{{path}}" in role {role.name!r}' if from_config else "-md {path}"
    if reads_draft_model(role.drafter):
        role = dataclasses.replace(role, draft=resolve_draft(meta, role.draft, f"{where} {role.drafter!r}", fix))
    elif role.draft is None and bundled_draft_fits(bundled_draft_check(meta)):
        # for requests that ask for draft-model; a draft left None means the role has no usable one
        role = dataclasses.replace(role, draft=DEFAULT_DRAFT)
    return role


def run(args: argparse.Namespace) -> int:
    check_api_key(args)
    default_tokens(args)  # a bad -n fails here, before anything loads
    if not args.ray and (args.address or args.replicas or args.suffix_log or args.no_share_suffix
                         or args.routing != "prefix"):
        raise InvalidParameterError("--address, --replicas, --routing, --suffix-log and --no-share-suffix apply to "
                                    "--ray only; add --ray or leave them out")
    if args.ray and "," in args.host:
        raise InvalidParameterError(f"--host {args.host}: with --ray the server listens on one address (Ray Serve's "
                                    "proxy); give one, or leave --ray out")
    sleep_s, hosts = sleep_seconds(args), host_list(args.host)
    for host in hosts:  # before any model loads: a bad --host used to fail only after the load and its measurements
        check_host(host)
    roles = check_roles(build_roles(args), args.config is not None)  # before anything loads or binds
    apply_server_flags(args)
    tls = tls_options(args)
    if not 0 < args.port < 65536:
        raise InvalidParameterError(f"--port must be in 1..65535 (got {args.port})")
    try:
        import uvicorn

        from ..server.app import Limits, create_app
    except ImportError as exc:
        raise InvalidParameterError(f"specstack serve needs its server packages ({exc.name} is missing): "
                                    "reinstall specstack (pip install .), which brings fastapi, uvicorn and sse-starlette") from None
    limits = request_limits(args, Limits)
    if args.ray:
        return run_ray(args, roles, limits)
    from ..server.access import stderr_line

    vertex_ai = vertex_from_env(args)
    app = create_app(roles, limits, api_key=args.api_key, max_queue=args.max_queue,
                     access_log=None if args.log_disable else stderr_line,
                     slots=args.slots, cors_origins=args.cors_origins, page=not args.no_webui, vertex_ai=vertex_ai,
                     verbose=bool(args.verbose), metrics_endpoint=metrics_endpoint(args), sleep_idle_s=sleep_s)
    names = ", ".join(r.name for r in roles)
    print(f"specstack serve: loading {names} for http://{hosts[0]}:{args.port}/ (/health answers 503 while "
          "loading)", flush=True)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal to the handler
    # that was there before it started: make that a clean exit, or status 2 after a role failed to load.
    outcome = {"status": 0}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(outcome["status"]))
    threading.Thread(target=watch_start, args=(app.state.workers, hosts[0], args.port, names, outcome),
                     name="specstack-ready", daemon=True).start()
    config = uvicorn.Config(app, host=hosts[0], port=args.port, log_level="critical" if args.log_disable else "warning",
                            timeout_graceful_shutdown=args.timeout or None, **tls,
                            **app.state.http_options)
    own_sockets = len(hosts) > 1 or args.reuse_port  # uvicorn binds one host, without SO_REUSEPORT
    uvicorn.Server(config).run(sockets=bind_sockets(hosts, args.port, args.reuse_port) if own_sockets else None)
    return outcome["status"]


def apply_server_flags(args: argparse.Namespace) -> None:
    """llama-server's flags for the process, before any model loads: llama.cpp's log and NUMA strategy
    (``apply_process_flags``; --log-disable silences it), --log-file, -C/-Cr (the process's CPUs) and --prio."""
    if args.log_disable:
        args.verbose, args.verbosity = False, None
    apply_process_flags(args)
    if args.log_file is not None:
        tee_stderr(args.log_file)
    cpus = (args.cpu_mask or set()) | (args.cpu_range or set())
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, ValueError) as exc:
            raise InvalidParameterError(f"-C/-Cr: cannot run on CPUs {sorted(cpus)} ({exc}); give CPUs of this "
                                        f"machine (these may be used: {sorted(os.sched_getaffinity(0))})") from None
    if args.prio is not None:
        from .llama_server_flags import PRIORITIES

        try:
            os.setpriority(os.PRIO_PROCESS, 0, PRIORITIES[args.prio])
        except OSError as exc:
            raise InvalidParameterError(f"--prio {args.prio}: cannot set this priority ({exc}); raising it needs "
                                        "the privilege (CAP_SYS_NICE): run with it, or use --prio 0 or -1") from None


class _Tee:
    """stderr written to a log file too (--log-file), line-buffered into both."""

    def __init__(self, stream: Any, log: Any) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def tee_stderr(path: Path) -> None:
    """--log-file FNAME: what serve writes to stderr (its notes, the access log, llama.cpp's log) goes to FNAME
    too, appended."""
    try:
        log = path.expanduser().open("a", encoding="utf-8")
    except OSError as exc:
        raise InvalidParameterError(f"--log-file {path}: cannot write it ({exc})") from None
    sys.stderr = _Tee(sys.stderr, log)


def tls_options(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's TLS settings for --ssl-key-file and --ssl-cert-file (HTTPS: both, or neither)."""
    key, cert = args.ssl_key_file, args.ssl_cert_file
    if (key is None) != (cert is None):
        raise InvalidParameterError("--ssl-key-file and --ssl-cert-file go together (HTTPS needs both the key and "
                                    "the certificate); give both, or neither for HTTP")
    if key is None:
        return {}
    for flag, path in (("--ssl-key-file", key), ("--ssl-cert-file", cert)):
        if not path.expanduser().is_file():
            raise InvalidParameterError(f"{flag} {path}: no such file")
    return {"ssl_keyfile": str(key.expanduser()), "ssl_certfile": str(cert.expanduser())}


def vertex_from_env(args: argparse.Namespace) -> Any:
    """Vertex AI's settings when the server runs there (``AIP_MODE=PREDICTION``): its port wins over --port, as
    llama-server's does (``server.vertex``)."""
    from ..server.vertex import vertex_params

    try:
        params = vertex_params()
    except ValueError as exc:
        raise InvalidParameterError(str(exc)) from None
    if params is not None and params.port != args.port:
        print(f"specstack serve: Vertex AI: AIP_HTTP_PORT {params.port} overrides --port {args.port}", flush=True)
        args.port = params.port
    return params


def sleep_seconds(args: argparse.Namespace) -> float | None:
    """--sleep-idle-seconds S: a role's model is freed after S idle seconds (-1, or none given: never)."""
    s = args.sleep_idle_seconds
    if s is not None and s >= 0 and args.ray:
        raise InvalidParameterError("--sleep-idle-seconds is not offered with --ray (each replica keeps its model "
                                    "loaded); leave one of them out")
    return None if s is None or s < 0 else float(s)


def host_list(text: str) -> list[str]:
    """--host A,B: llama-server listens on each address of a comma list (IPv4 and IPv6 alike)."""
    hosts = [h.strip() for h in text.split(",")]
    if not all(hosts):
        raise InvalidParameterError(f"--host has an empty address (got {text!r}); give one address or a comma list "
                                    "of them, e.g. --host 127.0.0.1,::1")
    return hosts


def check_host(host: str) -> None:
    """``host`` is an address of this machine to listen on: an IP address (a string of digits and dots that is not
    one, 999.1.1.1, is refused without a DNS query) or a name that resolves to one, and an address a socket can be
    bound to here (port 0: whether --port is free is the server's bind to find, at start)."""
    import ipaddress

    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        address = host
    except ValueError:
        if ":" in host or all(c in "0123456789." for c in host):
            raise InvalidParameterError(f"--host {host}: not an IP address (IPv4: four numbers 0..255, such as "
                                        "127.0.0.1 or 0.0.0.0; IPv6: such as ::1)") from None
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
        except (socket.gaierror, UnicodeError) as exc:
            raise InvalidParameterError(f"--host {host}: the name does not resolve ({exc}); give an IP address of "
                                        "this machine, such as 127.0.0.1 or 0.0.0.0") from None
        address = sockaddr[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError as exc:
            raise InvalidParameterError(f"--host {host}: cannot listen there ({exc.strerror or exc}); give an address "
                                        "of this machine, such as 127.0.0.1, or 0.0.0.0 for all of them") from None


def bind_sockets(hosts: list[str], port: int, reuse_port: bool = False) -> list[socket.socket]:
    """One listening socket per address of --host A,B (uvicorn binds a single host by itself); ``reuse_port``:
    SO_REUSEPORT, so other servers may listen on the port too (--reuse-port)."""
    out = []
    for host in hosts:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise InvalidParameterError(f"--host {host}: cannot listen on port {port} there ({exc})") from None
        sock.listen(2048)
        sock.set_inheritable(True)
        out.append(sock)
    return out


def watch_start(workers: dict[str, Any], host: str, port: int, names: str, outcome: dict[str, int]) -> None:
    """Say "ready" once /health answers 200; if a role fails to load instead, log why and stop the server with
    status 2 (through SIGTERM, so uvicorn shuts down as it does for any stop) rather than answer 503 forever."""
    while True:
        failed = [w for w in workers.values() if w.load_error]
        if failed:
            for w in failed:
                print(f"specstack serve: error: role {w.role.name!r} failed to load: {w.load_error}", file=sys.stderr,
                      flush=True)
            outcome["status"] = 2
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if healthy(host, port):
            print(f"specstack serve: ready: http://{host}:{port}/ roles: {names}", flush=True)
            return
        time.sleep(READY_POLL_S)


def health_url(host: str, port: int) -> str:
    """/health as this machine reaches it: a wildcard bind address is reached on loopback."""
    reach = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{reach}:{port}/health"


def healthy(host: str, port: int) -> bool:
    """Whether /health answers 200 now (not listening yet, or 503 while loading: False)."""
    try:
        with urllib.request.urlopen(health_url(host, port), timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(host: str, port: int, stop: threading.Event, poll_s: float = 0.5) -> bool:
    """Wait until /health answers 200 (True), or until ``stop`` is set (False)."""
    while not stop.is_set():
        if healthy(host, port):
            return True
        stop.wait(poll_s)
    return False


def run_ray(args: argparse.Namespace, roles, limits) -> int:
    """``--ray``: the same API from Ray Serve deployments (``server.scaleout``), once the replicas' threads fit
    the CPUs (``deploy.plan_layout``)."""
    try:
        from ..server.scaleout.deploy import application, run_until_signal
    except ImportError as exc:
        raise InvalidParameterError(f"specstack serve --ray needs Ray Serve ({exc.name} is missing): "
                                    "pip install 'specstack[ray]'") from None

    def build(planned: list) -> Any:
        return application(planned, limits, api_key=args.api_key, max_queue=args.max_queue, replicas=args.replicas,
                           routing=args.routing, suffix_log=args.suffix_log, share_suffix=not args.no_share_suffix)

    def started(done: threading.Event) -> None:
        if wait_healthy(args.host, args.port, done):
            print(f"specstack serve --ray: ready: http://{args.host}:{args.port}/", flush=True)

    return run_until_signal(roles, args.replicas, build, args.address, args.host, args.port, started)
