"""llama-server's flags on ``specstack serve``: its command lines run with the binary's name swapped.

Three kinds, each declared here once and listed in docs/serve.md's table:

- flags with a meaning here, mapped onto specstack's: ``--spec-type`` onto drafters (``SPEC_TYPES``; a
  comma list is a cascade), ``--spec-draft-n-max`` onto k and k_max, ``--spec-draft-p-min`` onto the
  draft's p_min, the sampling flags onto the role's request defaults (``--ignore-eos``, ``-l``, ``--samplers``
  among them), ``-md`` alone onto the drafter its file's kind says (an EAGLE-3 head: eagle3; a DFlash head:
  dflash; NextN layers: mtp; a model: draft-model);
- flags of samplers not implemented here (Mirostat, DRY, XTC, top-n-sigma, dynamic temperature, adaptive-p):
  taken at llama.cpp's default only, any other value refused in one line (``DEFAULT_ONLY``), as a request's
  fields of the same samplers are;
- flags naming what specstack always does (``--metrics``, ``-cb``, ``--no-context-shift``, ...): accepted,
  their help saying why nothing changes;
- flags that cannot apply here (``-hf``, ``--lora``, ``--mmproj``, the router's): refused in one line that
  says why and what to use (``REFUSED``), never the bare "unrecognized arguments" they used to get.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..draft_length import MAX_DRAFT
from ..drafters import cascade, none
from ..drafters.base import llama_spec_types
from ..errors import InvalidParameterError
from ..server.tools.reasoning import FORMATS as REASONING_FORMATS
from .common import ON_CPU, at_least, flag_given, gpu_layers

if TYPE_CHECKING:
    from ..modelfile.meta import GGUFInfo

# llama-server's --spec-type for no speculation: anywhere in a list it turns speculation off (as llama-server reads
# it), so it is this table's own entry rather than a drafter's job
NO_SPECULATION = "none"
# llama-server's --spec-type names (common/speculative.cpp) -> the specstack drafter doing that job, as each drafter
# declares it (``drafters.base.LlamaCpp``)
SPEC_TYPES = {NO_SPECULATION: none.NAME, **llama_spec_types()}
# llama-server's n-gram tuning flags (common/arg.cpp): accepted, not used (``add_llama_server_args``)
NGRAM_TUNING = tuple(f"--spec-ngram{kind}-{knob}" for kind in ("", "-simple", "-map-k", "-map-k4v")
                     for knob in ("size-n", "size-m", "min-hits")) + \
    tuple(f"--spec-ngram-mod-{knob}" for knob in ("n-min", "n-max", "n-match"))
# llama-server's types no specstack drafter does yet, each with why (draft-eagle3 and draft-dflash are eagle3's and
# dflash's, declared there)
NOT_OFFERED = {"draft-dspark": "specstack has no DSpark drafter yet (a DFlash head with Markov tensors, drafting "
               "anchor-first); use draft-dflash with a DFlash head, draft-eagle3 with an EAGLE-3 head, draft-simple (a "
               "draft model, -md) or draft-mtp"}
# A draft GGUF's kind of head (``GGUFInfo.head``) -> the --spec-type that reads it, for -md alone
HEAD_SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "dspark": "draft-dspark"}

AGENT = ("llama-server's web-UI agent (its built-in file and shell tools, MCP servers, media files) is not offered: "
         "specstack serves the API, and a client runs its own tools (tool calls come back in the answer)")
DOWNLOADS = ("specstack downloads nothing: fetch the GGUF (huggingface-cli download REPO FILE) and pass -m FILE (-md for "
             "a draft)")
# Flags that cannot apply here: (flags, how many values they take, why and what to use instead)
REFUSED = (
    (("-hf", "-hfr", "--hf-repo", "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", "-hff", "--hf-file", "-hft",
      "--hf-token", "-mu", "--model-url", "-dr", "--docker-repo"), True, DOWNLOADS),
    (("--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
      "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
      "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default"), False,
     "this preset downloads its model from Hugging Face, and " + DOWNLOADS),
    (("-cl", "--cache-list"), False, "specstack downloads nothing, so it keeps no model cache: `specstack models` lists "
     "the GGUFs on this machine"),
    (("--completion-bash",), False, "no shell completion script is offered: `specstack serve --help` lists the flags"),
    (("-lcs", "--lookup-cache-static", "-lcd", "--lookup-cache-dynamic"), True, "n-gram lookup cache files are not "
     "read: --spec-type ngram-cache (the suffix drafter) learns from the served prompts and outputs instead"),
    (("-r", "--reverse-prompt"), True, "a server-wide stop string is not offered: send stop in each request"),
    (("--spm-infill",), False, "/infill builds llama-server's default prefix-suffix-middle prompt only: leave "
     "--spm-infill out"),
    (("-nocb", "--no-cont-batching"), False, "continuous batching cannot be turned off: the -np slots always decode "
     "together; -np 1 serves one request at a time"),
    (("--rpc",), True, "specstack runs every model on this machine's CPU, so RPC devices are not used: scale out "
     "with --ray (docs/scale-out.md)"),
    (("--control-vector", "--control-vector-scaled"), True, "control vectors (which change the model's activations) "
     "are not supported: serve them with llama-server"),
    (("--control-vector-layer-range",), 2, "control vectors (which change the model's activations) are not "
     "supported: serve them with llama-server"),
    (("--lora-init-without-apply",), False, "LoRA adapters are not supported: merge the adapter into the GGUF "
     "(llama.cpp's export-lora) and serve that with -m"),
    (("--embd-normalize",), True, "embeddings are not offered here (--embedding): serve them with llama-server"),
    (("--path",), True, "the page at / is specstack's own status page: serve your files from a web server in front"),
    (("--api-prefix",), True, "routes are served at the root: put a reverse proxy in front that strips the prefix"),
    (("--ui-config", "--webui-config", "--ui-config-file", "--webui-config-file"), True, "there is no web UI to "
     "configure (the page at / is a read-only status page): leave it out"),
    (("--props",), False, "changing settings through POST /props is not offered (GET /props answers): restart with "
     "the new flags"),
    (("--chat-template-kwargs",), True, "a server-wide default is not offered: send chat_template_kwargs in each "
     "request (-rea on/off sets enable_thinking for all)"),
    (("--reasoning-effort",), True, "a server-wide default is not offered: send reasoning_effort in each request"),
    (("--reasoning-budget-message",), True, "a thinking budget is not implemented here, so there is no message to "
     "inject: leave it out"),
    (("--no-reasoning-preserve",), False, "the chat template gets each message as the request sends it: leave out "
     "the reasoning_content of earlier turns to drop it"),
    (("--skip-chat-parsing",), False, "chat answers are always parsed (reasoning_content, tool_calls): "
     "--reasoning-format none keeps the <think> block in content"),
    (("--no-prefill-assistant",), False, "a trailing assistant message is always continued (llama-server's "
     "default): end the messages on a user turn to start a new answer"),
    (("--no-cors-credentials",), False, "CORS credentials are always allowed here (llama-server's default): "
     "--cors-origins localhost limits who may call"),
    (("--log-jsonl",), False, "log lines are plain text here: each response's timings and /metrics carry the "
     "figures"),
    (("--log-prompts-dir",), True, "prompts are not written to files: the access log has one line per request"),
    (("--lora", "--lora-scaled"), True, "LoRA adapters are not supported: merge the adapter into the GGUF "
     "(llama.cpp's export-lora) and serve that with -m"),
    (("-mm", "--mmproj", "-mmu", "--mmproj-url"), True, "multimodal projectors are not supported (specstack serves "
     "text only): serve vision models with llama-server"),
    (("--models-dir", "--models-preset", "--models-max"), True, "the router (several models loaded on demand) is "
     "not offered: list the models as roles in a --config roles file (each loaded at start)"),
    (("--context-shift",), False, "the context is never shifted here: a generation stops at the context limit "
     "(finish_reason length); give a larger -c"),
    (("--embedding", "--embeddings", "--reranking", "--rerank"), False, "every role loads its model for generation; "
     "embeddings and reranking are not offered (/v1/embeddings answers 501): serve them with llama-server"),
    (("--pooling",), True, "embeddings are not offered here (--embedding), so there is nothing to pool: serve them "
     "with llama-server"),
    (("--slot-save-path",), True, "saving and restoring a slot's KV to files is not offered (GET /slots is read-only): "
     "a finished prompt's KV is kept in host memory instead (--cache-ram)"),
    (("--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "--media-path"), True, AGENT),
    (("-ag", "--agent"), False, AGENT),
    (("--ui-mcp-proxy", "--webui-mcp-proxy"), False, "there is no web UI, so no MCP proxy for it: leave it out"),
    (("--spec-synth-len", "--spec-synth-rates"), True, "synthetic acceptance (llama-server's benchmarking mode) "
     "accepts draft tokens whether or not the target would have chosen them, so the output is no longer the "
     "target's; speculation here is always lossless: measure acceptance with real drafts (`specstack bench`, the "
     "timings' draft_n_accepted)"),
    (("-gan", "--grp-attn-n", "-gaw", "--grp-attn-w"), True, "self-extend (grouped attention) is not offered: it "
     "changes the model's attention, so speculation could not stay lossless against plain decoding; give a model "
     "with a longer trained context"),
)
CPU = "no-op on a CPU: specstack runs every model on the CPU"
NO_MMPROJ = "no multimodal projector is ever loaded (text only), so nothing reads it"
ONE_PROCESS = ("accepted, not used: specstack's prompt, generation and draft calls share one process, whose CPUs and "
               "priority -C/-Cr and --prio set")
NO_SHIFT = "the context is never shifted here (a generation stops at the context limit, finish_reason length)"
# llama-server's flags accepted with nothing to change, device flags on a CPU among them: (flags, value hint, None for
# a switch, and the note --help shows)
ACCEPTED = (
    (("-dev", "--device"), "<dev1,dev2,..>", f"{CPU}, so no device is chosen"),
    (("-devd", "--device-draft", "--spec-draft-device"), "<dev1,dev2,..>", f"{CPU}, the draft model too"),
    (("-sm", "--split-mode"), "{none,layer,row,tensor}", f"{CPU}, so there is nothing to split across GPUs"),
    (("-ts", "--tensor-split"), "N0,N1,...", f"{CPU}, so there is nothing to split across GPUs"),
    (("-mg", "--main-gpu"), "INDEX", f"{CPU}, so no GPU is used"),
    (("-fit", "--fit"), "[on|off]", f"{CPU}: nothing is fitted to GPU memory (the KV cache is checked against host "
     "memory at load instead)"),
    (("-fitt", "--fit-target"), "MiB0,...", f"{CPU}: nothing is fitted to GPU memory"),
    (("-fitc", "--fit-ctx"), "N", f"{CPU}: nothing is fitted to GPU memory (-c sets the context)"),
    (("-ot", "--override-tensor"), "PATTERN=TYPE,...", f"{CPU}, so every tensor is in host memory already"),
    (("-otd", "--override-tensor-draft", "--spec-draft-override-tensor"), "PATTERN=TYPE,...",
     f"{CPU}, so every tensor is in host memory already"),
    (("-cmoe", "--cpu-moe"), None, f"{CPU}, so the MoE experts are there already"),
    (("-ncmoe", "--n-cpu-moe"), "N", f"{CPU}, so the MoE experts are there already"),
    (("-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe"), None, f"{CPU}, so the MoE experts are there already"),
    (("-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe"), "N",
     f"{CPU}, so the MoE experts are there already"),
    (("-ncffn", "--n-cpu-ffn"), "N", f"{CPU}, so the FFN weights are there already"),
    (("-kvo", "--kv-offload", "-nkvo", "--no-kv-offload"), None, f"{CPU}, so the KV cache is in host memory either "
     "way"),
    (("--op-offload", "--no-op-offload"), None, f"{CPU}, so no operation is offloaded"),
    (("--no-host",), None, f"{CPU}, so there is no device buffer to bypass"),
    (("--mmproj-auto", "--no-mmproj-auto", "--mmproj-offload", "--no-mmproj-offload"), None, NO_MMPROJ),
    (("-mmdev", "--mmproj-device", "--image-min-tokens", "--image-max-tokens", "--mtmd-batch-max-tokens",
      "--video-fps", "--video-timestamp-interval", "--video-ffmpeg-dir"), "VALUE", NO_MMPROJ),
    (("--offline",), None, "specstack never downloads anything, so it is always offline"),
    (("--threads-http",), "N", "HTTP requests are served by one asyncio event loop (uvicorn), so none waits for an "
     "HTTP thread; -t sets the model's threads"),
    (("--keep",), "N", f"{NO_SHIFT}, so there is no shift to keep tokens from; a prompt longer than the context is "
     "refused (400), never truncated"),
    (("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", "-cms", "--checkpoint-min-step"), "N",
     "a finished prompt's whole state (KV and recurrent state) is kept in host memory (--cache-ram) and restored "
     "whole, so no per-slot checkpoints are needed"),
    (("-sps", "--slot-prompt-similarity"), "SIMILARITY", "a request reuses the longest cached prefix of any "
     "finished prompt (--cache-ram), whichever slot it gets"),
    (("--cache-prompt", "--no-cache-prompt"), None, "a cached prefix is always reused, and never changes the output "
     "(exact); --cache-ram 0 turns the host cache off"),
    (("--cache-idle-slots",), None, "finished prompts' KV is kept in host memory by --cache-ram (0: off)"),
    (("--perf", "--no-perf"), None, "every response carries its timings, and /metrics the totals"),
    (("-e", "--escape", "--no-escape"), None, "there is no command-line prompt to unescape: request texts are used "
     "as sent"),
    (("--warmup", "--no-warmup"), None, "specstack runs no warm-up decode before serving; what its first load "
     "measures (call shapes, --exact auto's verdict) is cached per model and threads"),
    (("-dt", "--defrag-thold"), "N", "deprecated in llama.cpp too: the KV cache needs no defragmenting"),
    (("--spec-draft-p-split", "--draft-p-split"), "P", "drafts are chains per slot (trees only with a roles file's "
     "tree = true), so there is no split; it changes speed only, never the output"),
    (("-td", "--threads-draft", "--spec-draft-threads", "-tbd", "--threads-batch-draft",
      "--spec-draft-threads-batch"), "N", "the draft model runs on the target's -t threads (the two take turns); "
     "it changes speed only, never the output"),
    (("-Cb", "--cpu-mask-batch", "-Crb", "--cpu-range-batch", "-Cd", "--cpu-mask-draft", "--spec-draft-cpu-mask",
      "-Crd", "--cpu-range-draft", "--spec-draft-cpu-range", "-Cbd", "--cpu-mask-batch-draft",
      "--spec-draft-cpu-mask-batch", "--prio-batch", "--prio-draft", "--spec-draft-prio", "--prio-batch-draft",
      "--spec-draft-prio-batch"), "VALUE", ONE_PROCESS),
    (("--cpu-strict", "--cpu-strict-batch", "--cpu-strict-draft", "--spec-draft-cpu-strict",
      "--cpu-strict-batch-draft", "--spec-draft-cpu-strict-batch", "--poll", "--poll-batch", "--poll-draft",
      "--spec-draft-poll", "--poll-batch-draft", "--spec-draft-poll-batch"), "VALUE",
     "accepted, not used: llama.cpp's threads place and wait as its defaults here (the process's CPUs are -C/-Cr's)"),
    (("--sse-ping-interval",), "N", "accepted, not used: the interval of a stream's keep-alive pings is not "
     "configurable here"),
    (("--cors-credentials",), None, "CORS credentials are always allowed (llama-server's default)"),
    (("--cors-methods",), "METHODS", "accepted, not used: preflights allow llama-server's default methods (GET, POST, "
     "DELETE, OPTIONS)"),
    (("--cors-headers",), "HEADERS", "accepted, not used: preflights allow any header (llama-server's default *)"),
    (("--log-colors",), "[on|off|auto]", "log lines are plain text"),
    (("--log-prefix", "--no-log-prefix", "--log-timestamps", "--no-log-timestamps", "--no-log-jsonl"), None,
     "log lines have one plain format here"),
    (("--reasoning-preserve",), None, "the chat template gets each message's reasoning_content as the request sends "
     "it"),
    (("--no-skip-chat-parsing", "--prefill-assistant"), None, "as specstack always does (llama-server's default)"),
    (("-no-ag", "--no-agent", "--no-ui-mcp-proxy", "--no-webui-mcp-proxy"), None, "no web-UI agent is offered"),
    (("--models-autoload", "--no-models-autoload"), None, "there is no router: the models are the roles, each "
     "loaded at start"),
)
# llama-server's switches that change nothing here, so typed only on a llama-server command line (its binary's name
# swapped): with one of them, /metrics follows llama-server's rule, off (501) unless --metrics (``metrics_endpoint``)
LLAMA_SERVER_ONLY = ("--slots", "--no-slots", "--jinja", "--no-jinja", "-cb", "--cont-batching", "-kvu", "--kv-unified",
                     "--swa-full", "--no-context-shift", "--cache-reuse", "--no-mmproj", "--no-cache-idle-slots",
                     "-bs", "--backend-sampling", "--backend_sampling")


class Refuse(argparse.Action):
    """A llama-server flag that cannot apply here: refused at once, in one line saying why and what to use (without
    the usage argparse's errors print first, which the flags below made a hundred lines long)."""

    def __init__(self, option_strings: list[str], dest: str, why: str = "", **kwargs: Any) -> None:
        self.why = why
        super().__init__(option_strings, dest, default=None, help=f"refused: {why}", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.exit(2, f"{parser.prog}: error: {option_string} cannot apply to specstack serve: {self.why}\n")


class Checked(argparse.Action):
    """A llama-server sampling flag whose value ``check`` reads: one it refuses is refused at once in one line naming
    the flag, the value, why and what to use (not argparse's usage dump); ``append`` collects every use (-l)."""

    def __init__(self, option_strings: list[str], dest: str, check: Callable[[str], Any] = str, append: bool = False,
                 **kwargs: Any) -> None:
        self.check, self.append = check, append
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            value = self.check(values)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            shown = values if values and values.isprintable() and values.strip() == values else repr(values)
            parser.exit(2, f"{parser.prog}: error: {option_string} {shown}: {exc}\n")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), value] if self.append else value)


SPECULATION = "it would change the distribution that speculation verifies drafts against (temperature, top-k, top-p, " \
    "min-p and the penalties)"
DRY = f"DRY penalties are not implemented here: {SPECULATION}"
# llama.cpp's sampling flags whose sampler is not implemented here: each taken at llama.cpp's default (the sampler off,
# or its parameter as a request's field must be) and refused at any other value, in one line saying why and what to
# use; a request's fields of the same samplers are taken likewise (``server.unimplemented``).  (flags, value type,
# the values taken or a test of one, how --help and the refusal name them, why, what to use)
DEFAULT_ONLY: tuple[tuple[tuple[str, ...], type, tuple[float, ...] | Callable[[float], bool], str, str, str], ...] = (
    (("--top-nsigma", "--top-n-sigma"), float, (-1.0,), "-1 (off)",
     f"top-n-sigma sampling is not implemented here: {SPECULATION}", "leave it out, or cut the tail with --min-p"),
    (("--xtc-probability",), float, (0.0,), "0 (off)", f"XTC sampling is not implemented here: {SPECULATION}",
     "leave it out"),
    (("--xtc-threshold",), float, (0.1,), "0.1 (llama.cpp's default; XTC is off)",
     f"XTC sampling is not implemented here: {SPECULATION}", "leave it out"),
    (("--dry-multiplier",), float, (0.0,), "0 (off)", DRY, "leave it out, or use --repeat-penalty or --frequency-penalty"),
    (("--dry-base",), float, (1.75,), "1.75 (llama.cpp's default; DRY is off)", DRY, "leave it out"),
    (("--dry-allowed-length",), int, (2,), "2 (llama.cpp's default; DRY is off)", DRY, "leave it out"),
    (("--dry-penalty-last-n",), int, (64, 0), "64 (llama.cpp's default) or 0 (DRY is off)", DRY, "leave it out"),
    (("--adaptive-target",), float, lambda v: v < 0, "a negative value (off; llama.cpp's default -1)",
     f"adaptive-p sampling is not implemented here: {SPECULATION}", "leave it out"),
    (("--adaptive-decay",), float, (0.9,), "0.9 (llama.cpp's default; adaptive-p is off)",
     f"adaptive-p sampling is not implemented here: {SPECULATION}", "leave it out"),
    (("--dynatemp-range",), float, (0.0,), "0 (off)", f"dynamic temperature is not implemented here: {SPECULATION}",
     "leave it out and give a fixed --temp"),
    (("--dynatemp-exp",), float, (1.0,), "1 (llama.cpp's default; dynamic temperature is off)",
     f"dynamic temperature is not implemented here: {SPECULATION}", "leave it out and give a fixed --temp"),
    (("--mirostat",), int, (0,), "0 (off)", f"Mirostat sampling is not implemented here: {SPECULATION}",
     "leave it out, and bound the output with --top-k, --top-p or --min-p"),
    (("--mirostat-lr",), float, (0.1,), "0.1 (llama.cpp's default; Mirostat is off)",
     f"Mirostat sampling is not implemented here: {SPECULATION}", "leave it out"),
    (("--mirostat-ent",), float, (5.0,), "5 (llama.cpp's default; Mirostat is off)",
     f"Mirostat sampling is not implemented here: {SPECULATION}", "leave it out"),
)
DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default DRY sequence breakers
DRY_BREAKERS_TAKEN = f"so its sequence breakers stay llama.cpp's defaults ({', '.join(map(repr, DRY_BREAKERS))}); " \
    "leave --dry-sequence-breaker out"


def default_only(kind: type, taken: tuple[float, ...] | Callable[[float], bool], shown: str, why: str,
                 use: str) -> Callable[[str], float]:
    """The check of a ``DEFAULT_ONLY`` flag: its value read as llama.cpp reads it, and taken where it changes
    nothing here."""

    def check(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, and only {shown} "
                                             f"is taken; {use}") from None
        if not (taken(value) if callable(taken) else value in taken):
            raise argparse.ArgumentTypeError(f"{why}, so only {shown} is taken; {use}")
        return value

    return check


def dry_breaker(text: str) -> str:
    """--dry-sequence-breaker: one of llama.cpp's default breakers (DRY is off here, so they are never read);
    ``check_sampling_flags`` then wants all four, in llama.cpp's order, as the flag builds a new list."""
    if text not in DRY_BREAKERS:
        raise argparse.ArgumentTypeError(f"{DRY}, {DRY_BREAKERS_TAKEN}")
    return text


def sampler_names(text: str) -> tuple[str, ...]:
    """--samplers: llama.cpp's ';'-separated sampler names (any case) as canonical names, in an order this server
    applies (``unimplemented.applied_chain``)."""
    from ..server.unimplemented import applied_chain

    return _chain_or_why(applied_chain, [n.strip().lower() for n in text.split(";") if n.strip()])


def sampler_letters(text: str) -> tuple[str, ...]:
    """--sampler-seq/--sampling-seq: llama.cpp's one-letter sequence (``ekpmt``) as canonical names."""
    from ..server.unimplemented import applied_chain

    return _chain_or_why(applied_chain, text.strip())


def _chain_or_why(read: Callable[[Any], tuple[str, ...]], value: Any) -> tuple[str, ...]:
    try:
        return read(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; give llama.cpp's names in the order applied here (penalties;top_k;"
                                         "top_p;min_p;temperature, or letters ekpmt: each one left out is off), or "
                                         "leave the flag out") from None


LOGIT_BIAS_FORM = ("must be TOKEN_ID(+/-)BIAS, as llama.cpp reads it: 15043+1 raises token 15043, 15043-1 lowers it, "
                   "15043-inf bans it")


def logit_bias(text: str) -> tuple[int, float]:
    """-l/--logit-bias TOKEN_ID(+/-)BIAS, llama.cpp's syntax (common/arg.cpp): a token id, a sign, a number (``inf``
    too); a bias in a request's range [-100, 100], or -inf, which bans the token.  The id is checked against the
    model's vocabulary at start-up (``serve.check_roles``), when the model's vocabulary is read."""
    from ..constraints import LOGIT_BIAS_LIMIT  # here: numpy is not imported to parse the command line

    match = re.fullmatch(r"\s*(-?\d+)\s*([+-])\s*(\S+)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(LOGIT_BIAS_FORM)
    token, sign, amount = int(match[1]), match[2], match[3]
    try:
        bias = float(amount) * (-1.0 if sign == "-" else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(LOGIT_BIAS_FORM) from None
    if token < 0:
        raise argparse.ArgumentTypeError(f"token id {token} is negative; {LOGIT_BIAS_FORM}")
    if bias != -math.inf and not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
        raise argparse.ArgumentTypeError(f"a bias must be in [-100, 100], a request's logit_bias range (OpenAI's), or "
                                         f"-inf to ban the token (got {bias:g}); give {token}-inf to ban it")
    return token, bias


def typical(text: str) -> float:
    """--typical: 1 (off, llama.cpp's default) is what specstack samples with; typical sampling is not offered."""
    value = at_least(0, float)(text)
    if value != 1.0:
        raise argparse.ArgumentTypeError(f"locally typical sampling is not implemented here, so 1 (off) is the only "
                                         f"value taken (got {text}); leave --typical out or pass 1")
    return value


# llama.cpp's is_truthy / is_falsey / is_autoy words for --reasoning
REASONING_WORDS = {"on": "on", "enabled": "on", "true": "on", "1": "on", "off": "off", "disabled": "off",
                   "false": "off", "0": "off", "auto": "auto", "-1": "auto"}


def reasoning_mode(text: str) -> str:
    """-rea/--reasoning: on, off or auto (llama.cpp's words for them too)."""
    try:
        return REASONING_WORDS[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"must be on, off or auto (got {text!r})") from None


def reasoning_budget(text: str) -> int:
    """--reasoning-budget: -1 (unrestricted, llama.cpp's default) is the only value taken."""
    value = at_least(-1)(text)
    if value != -1:
        raise argparse.ArgumentTypeError(f"a thinking budget is not implemented here, so -1 (unrestricted) is the "
                                         f"only value taken (got {text}); leave --reasoning-budget out, or bound the "
                                         "whole answer with max_tokens")
    return value


def add_llama_server_args(p: argparse.ArgumentParser, llama: argparse._ArgumentGroup) -> None:
    """llama-server's flags beyond the loading and penalty ones (``common.add_loading_args``,
    ``add_constraint_args``): speculation, sampling defaults, the no-ops and the refusals."""
    spec = p.add_argument_group("llama-server's speculation flags (mapped onto drafters and k; see docs/serve.md)")
    spec.add_argument("--spec-type", default=None, metavar="TYPE[,TYPE...]",
                      help="llama-server's speculation types, as the drafter without --config: draft-simple = "
                      "draft-model, draft-mtp = mtp, draft-eagle3 = eagle3, draft-dflash = dflash (the head as -md), "
                      "ngram-simple/ngram-map-k/ngram-map-k4v = prompt-lookup, ngram-mod/ngram-cache = suffix, none = "
                      "none; a comma list is a cascade of them in that order (cascade:suffix,draft-model); "
                      "draft-dspark is refused (not built yet)")
    spec.add_argument("--spec-default", dest="spec_type", action="store_const", const="ngram-mod",
                      help="llama-server's default speculation: --spec-type ngram-mod (the suffix drafter)")
    spec.add_argument("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft", dest="n_max", type=at_least(1),
                      default=None, metavar="N", help=f"most tokens drafted per step, as llama-server's: -k N and "
                      f"--k-max N (the cost policy drafts up to N; at most {MAX_DRAFT})")
    spec.add_argument("--spec-draft-n-min", "--draft-min", "--draft-n-min", dest="n_min", type=at_least(0),
                      default=None, metavar="N", help="accepted, not used: llama-server drops drafts shorter than N; "
                      "here every draft is verified, and the cost policy already drafts only where it pays "
                      "(it changes speed only, never the output)")
    spec.add_argument("--spec-draft-p-min", "--draft-p-min", dest="p_min", type=float, default=None, metavar="P",
                      help="draft-model/mtp: stop drafting when the draft's confidence is below P (the role's p_min; "
                      "a request's speculative.p_min)")
    spec.add_argument(*NGRAM_TUNING, dest="ngram_tuning", type=at_least(0), default=None, metavar="N",
                      help="llama-server's n-gram tuning (--spec-ngram-*-size-n/-size-m/-min-hits, "
                      "--spec-ngram-mod-n-min/-n-max/-n-match): accepted, not used; prompt lookup follows a match as "
                      "far back as it runs and scores it, and the suffix drafter keeps every length, so the cost policy "
                      "decides the draft's length (it changes speed only, never the output)")
    sampling = p.add_argument_group("sampling defaults (a request's own value wins; see docs/serve.md)")
    sampling.add_argument("--temp", "--temperature", dest="temperature", type=at_least(0, float), default=None,
                          metavar="T", help="temperature of a request that gives none (the role's temperature; "
                          "default: llama-server's 0.8, on every route)")
    sampling.add_argument("--top-k", dest="top_k", type=at_least(0), default=None, metavar="N",
                          help="top_k of a request that gives none (default: llama-server's 40)")
    sampling.add_argument("--top-p", dest="top_p", type=float, default=None, metavar="P",
                          help="top_p of a request that gives none (default: llama-server's 0.95)")
    sampling.add_argument("--min-p", dest="min_p", type=float, default=None, metavar="P",
                          help="min_p of a request that gives none (default: llama-server's 0.05)")
    sampling.add_argument("--typical", "--typical-p", dest="typical_p", type=typical, default=None, metavar="P",
                          help="accepted at 1 (off, the default) only: typical sampling is not implemented")
    add_sampler_args(sampling)
    reasoning = p.add_argument_group("reasoning (a thinking model's <think> block; see docs/serve.md)")
    reasoning.add_argument("--reasoning-format", dest="reasoning_format", choices=REASONING_FORMATS, default=None,
                           help="how chat answers return a thinking model's <think> block: none (left in content), "
                           "deepseek (in message.reasoning_content), deepseek-legacy (both), auto (as deepseek; the "
                           "default); a request's reasoning_format wins (the role's reasoning_format)")
    reasoning.add_argument("-rea", "--reasoning", dest="reasoning", type=reasoning_mode, default=None,
                           metavar="on|off|auto", help="ask the chat template to think (on: enable_thinking true, off: "
                           "false) unless a request's chat_template_kwargs says; auto (default): the template's own "
                           "(the role's reasoning)")
    reasoning.add_argument("--reasoning-budget", dest="reasoning_budget", type=reasoning_budget, default=None,
                           metavar="N", help="accepted at -1 (unrestricted, the default) only: a thinking budget is "
                           "not implemented")
    llama.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                       help="read the API key from FILE (its one non-empty line), as --api-key")
    llama.add_argument("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
                       help="show llama.cpp's own log")
    noop = p.add_argument_group("llama-server's flags for what specstack always does (accepted, nothing changes)")
    noop.add_argument("--metrics", action="store_true", help="/metrics (Prometheus, specstack's and llama-server's "
                      "llamacpp:* figures) is on by default; a llama-server command line (one with --slots/--no-slots, "
                      "--jinja/--no-jinja, -cb, -kvu, ...) has it off (501) unless --metrics, as llama-server")
    noop.add_argument("--slots", dest="slots", action="store_true", default=True, help="GET /slots is on unless "
                      "--no-slots")
    noop.add_argument("-cb", "--cont-batching", dest="cont_batching", action="store_true",
                      help="continuous batching is always on: the -np slots decode together, requests joining and "
                      "leaving between steps")
    noop.add_argument("--no-webui", "--no-ui", dest="no_webui", action="store_true",
                      help="turn the page at / off (404), as llama-server's web UI (here a read-only status page)")
    noop.add_argument("--cors-origins", default="*", metavar="ORIGINS",
                      help="llama-server's CORS: * (default) echoes any caller's Origin, localhost only localhost "
                      "origins, anything else is sent as it is in Access-Control-Allow-Origin")
    noop.add_argument("--no-jinja", dest="no_jinja", action="store_true",
                      help="accepted: a chat template here is rendered as Jinja (sandboxed) or by a built-in name "
                      "(--chat-template), with or without it")
    noop.add_argument("--no-mmproj", dest="no_mmproj", action="store_true",
                      help="no multimodal projector is ever loaded (text only)")
    llama.add_argument("--sleep-idle-seconds", dest="sleep_idle_seconds", type=at_least(-1), default=None,
                       metavar="S", help="free each role's model after S seconds without work and load it again on "
                       "the next request that needs one (/health, /props, /models and /metrics do not wake it; /props "
                       "says is_sleeping); -1 (default): never")
    noop.add_argument("-bs", "--backend-sampling", "--backend_sampling", dest="backend_sampling", action="store_true",
                      help="accepted: the sampler always runs on the host here, on the same distributions (a "
                      "request's backend_sampling is accepted likewise)")
    noop.add_argument("--spec-draft-backend-sampling", "--no-spec-draft-backend-sampling", dest="draft_backend_sampling",
                      action="store_true", help="accepted either way: a draft model's tokens are chosen on the host "
                      "here")
    noop.add_argument("--no-cache-idle-slots", dest="no_cache_idle_slots", action="store_true",
                      help="accepted: finished prompts' KV is kept in host memory by --cache-ram (0: off)")
    noop.add_argument("--no-context-shift", dest="no_context_shift", action="store_true",
                      help="the context is never shifted: a generation stops at the context limit")
    noop.add_argument("--cache-reuse", dest="cache_reuse", type=at_least(0), default=None, metavar="N",
                      help="a prompt's cached prefix is always reused (--cache-ram); chunks are never moved by KV "
                      "shifting, so N changes nothing")
    llama.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true",
                       help="as llama-server's: one KV pool of -c cells that all -np slots share, any one sequence "
                       "up to all of -c (without it each slot gets -c / -np). The KV cache is -c, not -np x -c. A "
                       "prompt waits while the pool lacks room for it (one longer than -c is refused); a generation "
                       "whose next token finds the pool full ends with llama-server's 500 \"Context size has been "
                       "exceeded.\", its slot freed, the others going on (llama-server fails every running slot "
                       "there); drafts are cut to the free "
                       "cells. The slots' cells interleave, so with -np > 1 exactness is off (--exact on is "
                       "refused; /health says why). With --ctx-per-slot (--kv-unified-per-slot) N: each slot N, "
                       "the cache -np x N, as llama-server sizes it")
    noop.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                      help="each slot gets an equal share of -c (the default here; -np -1 shares one pool all the "
                      "same, as llama-server's auto)")
    noop.add_argument("--ui", "--webui", dest="no_webui", action="store_false", help="the page at / is on (the "
                      "default; --no-webui turns it off)")
    noop.add_argument("--swa-full", dest="swa_full", action="store_true",
                      help="sliding-window layers always keep a full-size cache here (llama.cpp's context default)")
    for flags, hint, note in ACCEPTED:
        shape = {"action": "store_true"} if hint is None else {"metavar": hint}
        noop.add_argument(*flags, dest="accepted_" + flags[-1].lstrip("-").replace("-", "_"), help=note, **shape)
    add_process_args(p, llama)
    refused = p.add_argument_group("llama-server's flags that cannot apply here (refused, saying what to use)")
    for flags, values, why in REFUSED:
        refused.add_argument(*flags, action=Refuse, why=why, dest=argparse.SUPPRESS, nargs=int(values),
                             metavar="VALUE")


def add_sampler_args(sampling: argparse._ArgumentGroup) -> None:
    """llama-server's further sampling flags: --ignore-eos, -l and the sampler chain as the role's request defaults
    (role keys ignore_eos, logit_bias, samplers), and those of samplers not implemented here at their defaults only
    (``DEFAULT_ONLY``)."""
    sampling.add_argument("--ignore-eos", dest="ignore_eos", action="store_const", const=True, default=None,
                          help="end-of-generation tokens are never chosen, for a request that does not send "
                          "ignore_eos (the role's ignore_eos; /props lists their bans among the logit biases)")
    sampling.add_argument("-l", "--logit-bias", dest="logit_bias", action=Checked, check=logit_bias, append=True,
                          default=None, metavar="TOKEN_ID(+/-)BIAS",
                          help="llama.cpp's syntax: 15043+1 raises token 15043, 15043-1 lowers it, 15043-inf bans it; "
                          "repeat it for more tokens.  The logit biases of a request that sends no logit_bias (a "
                          "request's list replaces them, as llama-server); ids checked against the vocabulary at "
                          "start-up (the role's logit_bias)")
    sampling.add_argument("--samplers", dest="samplers", action=Checked, check=sampler_names, default=None,
                          metavar="SAMPLERS", help="the sampler chain of a request that sends no samplers, llama.cpp's "
                          "names separated by ';': a sampler left out is off (no penalties: no penalty; no "
                          "temperature: sampling at 1); the ones applied here come in the order penalties;top_k;top_p;"
                          "min_p;temperature, and dry, typ_p, xtc, top_n_sigma, adaptive_p (off here) may stand "
                          "anywhere (the role's samplers)")
    sampling.add_argument("--sampler-seq", "--sampling-seq", dest="samplers", action=Checked, check=sampler_letters,
                          default=None, metavar="SEQUENCE", help="--samplers in llama.cpp's letters (ekpmt: penalties, "
                          "top_k, top_p, min_p, temperature)")
    for flags, kind, taken, shown, why, use in DEFAULT_ONLY:
        sampling.add_argument(*flags, dest=flags[-1].lstrip("-").replace("-", "_"), action=Checked,
                              check=default_only(kind, taken, shown, why, use), default=None, metavar="N",
                              help=f"accepted at {shown} only: {why.split(':')[0]}")
    sampling.add_argument("--dry-sequence-breaker", dest="dry_sequence_breaker", action=Checked, check=dry_breaker,
                          append=True, default=None, metavar="STRING", help="accepted at llama.cpp's default "
                          "breakers only (all four, in order): DRY penalties are not implemented")


def add_process_args(p: argparse.ArgumentParser, llama: argparse._ArgumentGroup) -> None:
    """llama-server's flags for the process and its HTTP side, honoured by ``serve.run`` (``apply_server_flags``):
    the log, TLS, the port's sharing, CPU affinity and priority; and what prints and exits."""
    p.add_argument("--usage", action="help", help="show this help and exit (llama-server's spelling of -h)")
    p.add_argument("--version", action=ShowVersion, nargs=0, help="show specstack's and llama.cpp's versions and exit")
    p.add_argument("--list-devices", action=ListDevices, nargs=0, help="list the devices models run on (the CPU) "
                   "and exit")
    llama.add_argument("-lv", "--verbosity", "--log-verbosity", dest="verbosity", type=at_least(0), default=None,
                       metavar="N", help="show llama.cpp's own log up to level N: 1 errors, 2 warnings, 3 information, "
                       "4 debug (-v: all of it)")
    llama.add_argument("--log-disable", dest="log_disable", action="store_true",
                       help="no log: neither the access log's line per request nor llama.cpp's")
    llama.add_argument("--log-file", dest="log_file", type=Path, default=None, metavar="FNAME",
                       help="also write the log (everything serve writes to stderr) to FNAME")
    llama.add_argument("--ssl-key-file", dest="ssl_key_file", type=Path, default=None, metavar="FNAME",
                       help="serve HTTPS with this PEM private key (with --ssl-cert-file)")
    llama.add_argument("--ssl-cert-file", dest="ssl_cert_file", type=Path, default=None, metavar="FNAME",
                       help="serve HTTPS with this PEM certificate (with --ssl-key-file)")
    llama.add_argument("--reuse-port", dest="reuse_port", action="store_true",
                       help="listen with SO_REUSEPORT, so several servers may share the port")
    llama.add_argument("-C", "--cpu-mask", dest="cpu_mask", type=cpu_mask, default=None, metavar="M",
                       help="run the server on the CPUs of this hex mask (the process's affinity)")
    llama.add_argument("-Cr", "--cpu-range", dest="cpu_range", type=cpu_range, default=None, metavar="lo-hi",
                       help="run the server on CPUs lo..hi (the process's affinity); with -C, the CPUs of both")
    llama.add_argument("--prio", dest="prio", type=int, choices=tuple(PRIORITIES), default=None, metavar="N",
                       help="process priority, as llama.cpp sets it: -1 low, 0 normal (default), 1 medium, 2 high, "
                       "3 realtime (above normal needs the privilege to raise it)")
    llama.add_argument("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", dest="n_gpu_layers_draft",
                       type=gpu_layers, default=None, metavar="N", help=f"the draft model's -ngl: {ON_CPU}, so 0 only")
    llama.add_argument("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k", dest="cache_type_k_draft",
                       type=draft_cache_type, default=None, metavar="TYPE", help="the draft's K cache type: f16 only")
    llama.add_argument("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v", dest="cache_type_v_draft",
                       type=draft_cache_type, default=None, metavar="TYPE", help="the draft's V cache type: f16 only")


def draft_cache_type(text: str) -> str:
    """-ctkd/-ctvd: the draft model's KV cache stays f16 (llama.cpp's default), the one value taken; a draft's
    cache changes speed only, never the output, and a small draft's cache is small."""
    if text != "f16":
        raise argparse.ArgumentTypeError(f"the draft model's KV cache is f16 here (got {text}): it changes speed only, "
                                         "never the output; leave the flag out or pass f16 (-ctk/-ctv set the target's)")
    return text


# llama.cpp's --prio levels as nice values (common.cpp's set_process_priority on Linux)
PRIORITIES = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


def cpu_mask(text: str) -> set[int]:
    """-C M: the CPUs of a hex mask (0x optional), as llama.cpp's parse_cpu_mask reads it."""
    try:
        bits = int(text, 16)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a hex CPU mask such as 0xff (got {text!r})") from None
    cpus = {i for i in range(bits.bit_length()) if bits >> i & 1}
    if not cpus:
        raise argparse.ArgumentTypeError(f"names no CPU (got {text!r})")
    return cpus


def cpu_range(text: str) -> set[int]:
    """-Cr lo-hi: CPUs lo..hi, both included."""
    lo, dash, hi = text.partition("-")
    if not (dash and lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
        raise argparse.ArgumentTypeError(f"must be lo-hi, e.g. 0-7 (got {text!r})")
    return set(range(int(lo), int(hi) + 1))


class ShowVersion(argparse.Action):
    """--version: specstack's and llama-cpp-python's versions (the latter names the llama.cpp it bundles)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        def of(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        print(f"specstack {of('specstack')}, llama-cpp-python {of('llama-cpp-python')}")
        parser.exit()


class ListDevices(argparse.Action):
    """--list-devices: the one device specstack runs models on."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from ..host.sysinfo import allowed_cpus

        print(f"Available devices:\n  CPU: {len(allowed_cpus())} CPUs (specstack runs every model on the CPU)")
        parser.exit()


def speculation_values(args: argparse.Namespace) -> dict[str, Any]:
    """The role keys that --spec-type, --spec-draft-n-max and -md alone set (llama-server's meanings)."""
    values: dict[str, Any] = {}
    if args.spec_type is not None:
        if args.drafter is not None:
            raise InvalidParameterError(f"--spec-type {args.spec_type} and --drafter {args.drafter} each choose the "
                                        "drafter; pass one of them")
        values["drafter"] = drafter_for_spec_type(args.spec_type)
    elif args.model_draft is not None and args.drafter is None:
        values["drafter"] = drafter_for_draft_file(Path(args.model_draft))
    if args.n_max is not None:
        given = [f for f, a in (("-k", "k"), ("--k-max", "k_max")) if getattr(args, a) is not None]
        if given:
            raise InvalidParameterError(f"--spec-draft-n-max {args.n_max} sets k and k_max, and {' and '.join(given)} "
                                        "set them too; pass one of them")
        if args.n_max > MAX_DRAFT:
            print(f"specstack serve: note: --spec-draft-n-max {args.n_max} drafts at most {MAX_DRAFT} tokens a step "
                  "here (the longest draft specstack verifies)", file=sys.stderr, flush=True)
        values["k"] = values["k_max"] = min(args.n_max, MAX_DRAFT)
    return values


def check_sampling_flags(args: argparse.Namespace) -> None:
    """--temp, --top-k, --top-p and --min-p in a request's ranges, refused in the words typed (``--top-p must be
    in (0, 1]``), before the role would name its key; and --dry-sequence-breaker's list as llama.cpp's default (each
    use adds one, so a list short of it is known only here)."""
    from ..sampling import SamplingParams

    given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p") if getattr(args, k) is not None}
    try:
        SamplingParams(**given)
    except InvalidParameterError as exc:
        word, _, rest = str(exc).partition(" ")
        flag = "--temp" if word == "temperature" else f"--{word.replace('_', '-')}"
        raise InvalidParameterError(f"{flag} {rest}") from None
    breakers = getattr(args, "dry_sequence_breaker", None)
    if breakers is not None and tuple(breakers) != DRY_BREAKERS:
        raise InvalidParameterError(f"--dry-sequence-breaker {' '.join(map(repr, breakers))}: {DRY}, "
                                    f"{DRY_BREAKERS_TAKEN}")


def spec_type_of_draft(info: "GGUFInfo") -> str | None:
    """The --spec-type a draft GGUF (``info``, its metadata) is read with where -md comes alone, as llama-server's
    ``common_speculative_types_from_gguf`` infers it: a DFlash/DSpark head or a file with NextN layers (an MTP
    assistant too) by its own type; an EAGLE-3 head too (llama-server infers it only from a Hugging Face repo's
    sidecar, never from a local -md, and then drafts nothing: here the head drafts); None: a draft model."""
    if info.head is not None:
        return HEAD_SPEC_TYPES[info.head.kind]
    if info.nextn_layers > 0 or info.mtp_mode == "assistant":
        return "draft-mtp"
    return None


def drafter_for_draft_file(path: Path) -> str:
    """The drafter of -md FILE without --drafter or --spec-type: the one the file's kind is read with
    (``spec_type_of_draft``), else draft-model; said on stderr, since the command line names none."""
    from ..modelfile.meta import read_gguf

    # with its tensor infos: a DSpark head is a dflash GGUF told apart by its Markov tensor (``GGUFInfo.is_dspark``)
    spec_type = spec_type_of_draft(read_gguf(path, role="draft model (-md)"))
    if spec_type is None:
        print(f"specstack serve: note: -md {path} without --drafter or --spec-type drafts with draft-model, as "
              "llama-server does (--drafter prompt-lookup keeps the draft for requests only)", file=sys.stderr,
              flush=True)
        return SPEC_TYPES["draft-simple"]  # llama-server's drafter for -md alone
    if spec_type in NOT_OFFERED:
        raise InvalidParameterError(f"-md {path} is a {spec_type.removeprefix('draft-')} head (llama-server reads it "
                                    f"with --spec-type {spec_type}), and {NOT_OFFERED[spec_type]}")
    drafter = SPEC_TYPES[spec_type]
    print(f"specstack serve: note: -md {path} without --drafter or --spec-type drafts with {drafter}, as --spec-type "
          f"{spec_type} does (the file's metadata says what it is)", file=sys.stderr, flush=True)
    return drafter


def drafter_for_spec_type(text: str) -> str:
    """``--spec-type`` as a drafter name: one type is its drafter, a list a cascade in the order given; ``none``
    anywhere in the list is no speculation (as llama-server reads it)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InvalidParameterError("--spec-type is empty; give one of " + ", ".join(SPEC_TYPES))
    for name in names:
        if name in NOT_OFFERED:
            raise InvalidParameterError(f"--spec-type {name} is not offered: {NOT_OFFERED[name]}")
        if name not in SPEC_TYPES:
            raise InvalidParameterError(f"--spec-type {name!r} is not one of llama-server's types: "
                                        f"{', '.join([*SPEC_TYPES, *NOT_OFFERED])}")
    if NO_SPECULATION in names:
        return SPEC_TYPES[NO_SPECULATION]
    drafters = list(dict.fromkeys(SPEC_TYPES[n] for n in names))
    return drafters[0] if len(drafters) == 1 else f"{cascade.NAME}:" + ",".join(drafters)


def api_key_from_file(path: Path) -> str:
    """--api-key-file: the file's one non-empty line (llama-server takes several; one key is served here)."""
    try:
        lines = [line.strip() for line in path.expanduser().read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"--api-key-file {path}: cannot read it ({exc})") from None
    if len(lines) != 1:
        raise InvalidParameterError(f"--api-key-file {path} holds {len(lines)} keys; specstack serve takes exactly "
                                    "one (write one key on one line)")
    return lines[0]


def metrics_endpoint(args: argparse.Namespace) -> bool:
    """Whether GET /metrics is on: always for specstack's own command lines (its live page and benchmarks read it);
    on a llama-server command line (``LLAMA_SERVER_ONLY``) only with --metrics, as llama-server has it."""
    return bool(args.metrics) or not flag_given(args, *LLAMA_SERVER_ONLY)
