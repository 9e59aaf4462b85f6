"""``specstack serve``: an OpenAI-compatible server with speculation per request, roles and a live page."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..draft_length.costs import EXACT_MODES
from ..errors import InvalidParameterError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, metrics, live page)",
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
        "keys: model, draft, drafter, k_policy, k, k_max, threads, ctx, parallel, exact, rollback, cache_mb, batch_tokens, "
        "prefill_cap, profile, category, chat_template, replicas (with --ray)",
    )
    p.add_argument("--config", type=Path, default=None, help="roles file (TOML); default: the bundled pair as one role")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots per role without --config: generations batched together (default 4)")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for a slot; past it the answer is 429 with Retry-After (default 16)")
    p.add_argument("--api-key", default=os.environ.get("SPECSTACK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECSTACK_API_KEY, else none); /health stays open")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before it is stopped (default 600; 0 = none)")
    p.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens a request may ask for (default 4096)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt in tokens (default: the context)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--drafter", default="prompt-lookup", help="default drafter without --config (default prompt-lookup)")
    p.add_argument("--k-policy", default="cost", help="default k policy without --config (default cost)")
    p.add_argument("-m", "--model", type=Path, default=None, help="target GGUF without --config (default: bundled pycoder-6m)")
    p.add_argument("-md", "--model-draft", type=Path, default=None, help="draft GGUF without --config (default: bundled pycoder-1m)")
    p.add_argument("-t", "--threads", type=int, default=0, help="threads without --config (default: physical cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context per slot without --config (default 4096, or the model's trained context if shorter; "
                   "0 = the model's trained context); each role's context and KV cache size are printed at load")
    p.add_argument("--exact", choices=EXACT_MODES, default="auto",
                   help="exact call shapes: auto (default), on or off (see `specstack generate --help`); /health and "
                   "/v1/models say which mode each role runs in and why. Without exactness several slots share one "
                   "unified KV cache with flash attention, so auto's first run with several slots measures its "
                   "verdict before serving (seconds, once per model, threads and slots; cached)")
    p.add_argument("--rollback", choices=("auto", "rollback", "checkpoint"), default="auto",
                   help="recurrent/hybrid targets without --config: how rejected drafts leave the state "
                   "(see `specstack generate --help`)")
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="chat format without --config: one of llama.cpp's built-in templates by name (gemma, chatml, "
                   "llama3, mistral-v7, phi4, ...; an unknown name lists them all) or a Jinja template file. Default: the "
                   "GGUF's tokenizer.chat_template; a model without one gets a plain '### User:' format and a warning")
    p.add_argument("--cache-ram", type=int, default=512, help="MiB of host memory for finished prompts' KV, restored "
                   "instead of prefilled when a prompt comes back (default 512; 0 = off)")
    p.add_argument("--batch-tokens", type=int, default=512,
                   help="rows one engine step may process (like vLLM's max_num_batched_tokens): the running generations' "
                   "pending and draft tokens first, then waiting prompts in chunks, so a long prompt never stalls "
                   "the streams (default 512; 0 = prefill each prompt whole when it is admitted)")
    p.add_argument("--prefill-cap", type=int, default=256,
                   help="prompt tokens of one request per step at most, so one long prompt cannot take a whole "
                   "step (default 256; rounded to the 128-token chunks a solo run prefills)")
    ray = p.add_argument_group("scale-out on Ray Serve (pip install 'specstack[ray]'; see docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true", help="serve each role as a Ray Serve deployment of replicas, "
                     "requests routed to the replica holding their prefix or session; the same API")
    ray.add_argument("--address", default=None, help="with --ray: the Ray cluster to join ('auto': the one `ray start` "
                     "runs on this machine); default: start a local Ray instance, stopped again on SIGTERM")
    ray.add_argument("--replicas", type=int, default=None, help="with --ray: engines per role (default: each role's "
                     "'replicas' key, else 1); each takes its role's threads as CPUs")
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
    from ..server.roles import default_roles, load_roles

    if args.config is not None:
        return load_roles(args.config)
    overrides = {"drafter": args.drafter, "k_policy": args.k_policy, "threads": args.threads, "ctx": args.ctx_size,
                 "exact": args.exact, "cache_mb": args.cache_ram, "rollback": args.rollback,
                 "chat_template": args.chat_template, "batch_tokens": args.batch_tokens, "prefill_cap": args.prefill_cap}
    if args.model is not None:
        overrides["model"] = args.model
    if args.model_draft is not None:
        overrides["draft"] = args.model_draft
    return default_roles(parallel=args.parallel, **overrides)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..server.app import Limits, create_app
    except ImportError as exc:
        raise InvalidParameterError(f"specstack serve needs its server packages ({exc.name} is missing): "
                                    "reinstall specstack (pip install .), which brings fastapi, uvicorn and sse-starlette") from None
    if not 0 < args.port < 65536:
        raise InvalidParameterError(f"--port must be in 1..65535 (got {args.port})")
    roles = build_roles(args)
    from ..drafters.base import check_name
    from ..server.chat import load_template
    from ..target import check_gguf_file

    for role in roles:  # before anything loads: a wrong path, drafter or template name fails now, not per request
        check_gguf_file(role.model, f"role {role.name!r} model")
        if "draft-model" in check_name(role.drafter, f"role {role.name!r}'s drafter" if args.config else "--drafter"):
            check_gguf_file(role.draft, f"role {role.name!r} draft model (-md)")
        load_template(role.model, role.chat_template)
    limits = Limits(max_body_bytes=args.max_body, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                    timeout_s=args.timeout)
    if args.ray:
        return run_ray(args, roles, limits)
    if args.address or args.replicas or args.suffix_log or args.no_share_suffix or args.routing != "prefix":
        raise InvalidParameterError("--address, --replicas, --routing, --suffix-log and --no-share-suffix apply to "
                                    "--ray only; add --ray or leave them out")
    app = create_app(roles, limits, api_key=args.api_key, max_queue=args.max_queue)
    print(f"specstack serve: http://{args.host}:{args.port}/ roles: {', '.join(r.name for r in roles)}", flush=True)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal to the handler
    # that was there before it started: make that a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=args.timeout or None)
    return 0


def run_ray(args: argparse.Namespace, roles, limits) -> int:
    """``--ray``: the same API from Ray Serve deployments (``server.scaleout``)."""
    if args.replicas is not None and args.replicas < 1:
        raise InvalidParameterError(f"--replicas must be >= 1 (got {args.replicas})")
    try:
        from ..server.scaleout.deploy import application, run_until_signal
    except ImportError as exc:
        raise InvalidParameterError(f"specstack serve --ray needs Ray Serve ({exc.name} is missing): "
                                    "pip install 'specstack[ray]'") from None
    app = application(roles, limits, api_key=args.api_key, max_queue=args.max_queue, replicas=args.replicas,
                      routing=args.routing, suffix_log=args.suffix_log, share_suffix=not args.no_share_suffix)
    return run_until_signal(app, args.address, args.host, args.port)
