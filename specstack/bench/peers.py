"""llama.cpp's own binaries as benchmark peers: plain generation, speculative-simple and lookup.

The binaries come from ``scripts/build_llama_bins.sh``, built from the llama.cpp tree vendored in
the same llama-cpp-python release specstack runs on. Each runner takes (model, draft, prompt,
n_predict, threads, k), runs one binary greedily (``--temp 0 --top-k 1``), and parses its log
into a dict with the keys in ``RESULT_KEYS``. Parsing is kept in pure functions
(``parse_speculative_simple``, ``parse_lookup``, ``parse_plain``, ``parse_llama_bench``) so it is
testable on captured outputs without the binaries.

Kernels: the stock build runs llama.cpp's own CPU kernels; ``KERNELS=specstack scripts/build_llama_bins.sh``
builds the same binaries with specstack's verification kernels into another folder.  ``bin_dir(path, kernels)``
finds and checks the folder of either, so a run labelled with one kernel set never ran on the other.

Units: ``tok_per_s`` is the decode rate each binary reports itself. For speculative-simple and
lookup that is generated tokens / decode-loop seconds (drafting included, prompt excluded); for
plain generation it is llama.cpp's "eval time" rate (one token per run, prompt excluded).
``acceptance`` is accepted / drafted tokens, None when nothing was drafted.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import InvalidParameterError, SpecstackError

RESULT_KEYS = ("method", "tok_per_s", "n_drafted", "n_accepted", "acceptance", "n_predicted", "raw")

# Draftless n-gram drafters of llama-speculative-simple (``--spec-type``), with the flag that
# caps their draft length; ngram-cache's draft length is fixed at 8 in this llama.cpp.
NGRAM_SPEC_TYPES: dict[str, tuple[str, ...]] = {
    "ngram-simple": ("--spec-ngram-simple-size-m",),
    "ngram-map-k": ("--spec-ngram-map-k-size-m",),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-m",),
    "ngram-mod": ("--spec-ngram-mod-n-max",),
    "ngram-cache": (),
}
NGRAM_CACHE_DRAFT = 8
# ngram-mod only drafts when it can fill n_min tokens; llama.cpp's defaults are 48 of 64.
NGRAM_MOD_MIN_FRACTION = 48 / 64

PEER_METHODS: tuple[str, ...] = (
    "llama-plain",
    "llama-draft-simple",
    "llama-draft-mtp",  # the target's own NextN head (--spec-type draft-mtp), as specstack's --drafter mtp
    "llama-draft-eagle3",  # a trained EAGLE-3 head (-md, --spec-type draft-eagle3), as specstack's --drafter eagle3
    "llama-draft-dflash",  # a trained DFlash head (-md, --spec-type draft-dflash), as specstack's --drafter dflash
    *(f"llama-{t}" for t in NGRAM_SPEC_TYPES),
    "llama-lookup",
)

# The peers that draft from a trained head given as -md, with the head's name in messages
HEAD_PEERS = {"llama-draft-eagle3": "EAGLE-3", "llama-draft-dflash": "DFlash"}

DEFAULT_BIN_DIR = Path.home() / ".cache" / "specstack" / "llama-bins" / "bin"
BIN_DIR_ENV = "SPECSTACK_LLAMA_BINS"
# The same binaries built from a tree with specstack's verification kernels in ggml-cpu
# (KERNELS=specstack scripts/build_llama_bins.sh), so a table can tell the kernels' gain from the drafting's.
SPECSTACK_BIN_DIR = Path.home() / ".cache" / "specstack" / "llama-bins-specstack" / "bin"
SPECSTACK_BIN_DIR_ENV = "SPECSTACK_LLAMA_BINS_SPECSTACK"
KERNELS = ("stock", "specstack")  # which ggml-cpu kernels a bin folder's binaries run
BUILD_COMMAND = {"stock": "scripts/build_llama_bins.sh",
                 "specstack": "KERNELS=specstack scripts/build_llama_bins.sh"}


# llama.cpp's logger writes from a worker thread and is never joined at exit (llama.cpp issue
# 22142): when the process ends before that thread is scheduled, as on a loaded machine, the
# run exits 0 with the tail of its log, stats and text included, missing. Whatever is printed
# arrives in order, so a present final stats line means nothing before it was lost; a run
# without it is run again, up to this many times in all.
LOST_LOG_TRIES = 3


class PeerError(SpecstackError):
    """A llama.cpp peer binary is missing, failed, or printed something we cannot parse."""


# ---------------------------------------------------------------------------------------------
# Parsing (pure)
# ---------------------------------------------------------------------------------------------

_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|[-+]?nan)"


def _float(s: str) -> float:
    return float(s)  # float() reads "inf", "-nan" and friends too


def _find(pattern: str, text: str, what: str) -> re.Match[str]:
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise PeerError(f"could not find {what} in the peer's output; last lines:\n{_tail(text)}")
    return m


def _find_int(key: str, text: str) -> int:
    # Lines look like "0.01.044.701 I n_drafted = 170" (timestamp and level prefix optional).
    return int(_find(rf"\b{key}\s*=\s*(\d+)\s*$", text, f"'{key} = N'").group(1))


def _tail(text: str, n: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _result(method: str | None, tok_per_s: float, n_drafted: int, n_accepted: int, n_predicted: int,
            raw: str, **extra: Any) -> dict[str, Any]:
    return {
        "method": method,
        "tok_per_s": tok_per_s,
        "n_drafted": n_drafted,
        "n_accepted": n_accepted,
        "acceptance": n_accepted / n_drafted if n_drafted else None,
        "n_predicted": n_predicted,
        "raw": raw,
        **extra,
    }


def _parse_spec_log(text: str, method: str | None) -> dict[str, Any]:
    enc = _find(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s", text, "'encoded ... t/s'")
    dec = _find(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s", text, "'decoded ... t/s'")
    n_predicted = _find_int("n_predict", text)
    return _result(
        method,
        tok_per_s=_float(dec.group(3)),
        n_drafted=_find_int("n_drafted", text),
        n_accepted=_find_int("n_accept", text),
        n_predicted=n_predicted,
        raw=text,
        k=_find_int("n_draft", text),
        decode_s=_float(dec.group(2)),
        prompt_tokens=int(enc.group(1)),
        prompt_tok_per_s=_float(enc.group(3)),
    )


def parse_speculative_simple(text: str, method: str | None = "llama-speculative-simple") -> dict[str, Any]:
    """Parse the log (stderr) of ``llama-speculative-simple``.

    ``k`` is the binary's ``n_draft`` line, i.e. ``--spec-draft-n-max``; the n-gram types cap
    their drafts with their own flags (see ``NGRAM_SPEC_TYPES``).
    """
    return _parse_spec_log(text, method)


def parse_lookup(text: str, method: str | None = "llama-lookup") -> dict[str, Any]:
    """Parse the log (stderr) of ``llama-lookup``: the same summary plus drafting time."""
    out = _parse_spec_log(text, method)
    m = re.search(rf"\bt_draft\s*=\s*{_NUM} ms", text)
    out["draft_ms"] = _float(m.group(1)) if m else None
    return out


def parse_plain(text: str, method: str | None = "llama-plain") -> dict[str, Any]:
    """Parse the log of plain generation: ``llama-completion`` or ``llama-simple``.

    Both end with llama.cpp's perf summary, whose ``eval time`` line counts one run per generated
    token after the first (the first comes from the prompt's logits).  The rate is of the decode loop,
    as specstack's plain rate is: the eval time plus the sampling time (``llama-completion``'s
    ``sampling time``, ``llama-simple``'s ``samplers time``), which the eval rate alone leaves out
    (0.35 ms a token on Gemma 3 270M, where specstack's loop spends 0.4-0.5 ms beside llama_decode).
    """
    m = _find(rf"(?<!prompt )eval time =\s*{_NUM} ms /\s*(\d+) (?:runs|tokens)\s*\(\s*{_NUM} ms per token,"
              rf"\s*{_NUM} tokens per second\)", text, "the 'eval time' perf line")
    runs = int(m.group(2))
    p = re.search(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens", text)
    sampling = re.search(rf"sampling time =\s*{_NUM} ms", text) or re.search(rf"samplers time =\s*{_NUM} ms", text)
    loop_s = (_float(m.group(1)) + (_float(sampling.group(1)) if sampling else 0.0)) / 1000
    return _result(
        method,
        tok_per_s=runs / loop_s if loop_s > 0 else _float(m.group(4)),
        n_drafted=0,
        n_accepted=0,
        n_predicted=runs + 1,
        raw=text,
        decode_s=loop_s,
        prompt_tokens=int(p.group(2)) if p else None,
    )


def parse_llama_bench(text: str, method: str | None = "llama-bench-tg") -> dict[str, Any]:
    """Parse ``llama-bench -o jsonl`` output: the token-generation test's mean rate."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    tg = [r for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not tg:
        raise PeerError(f"no token-generation row in llama-bench output; last lines:\n{_tail(text)}")
    r = tg[-1]
    return _result(method, tok_per_s=float(r["avg_ts"]), n_drafted=0, n_accepted=0,
                   n_predicted=int(r["n_gen"]), raw=text, stddev_tok_per_s=float(r.get("stddev_ts", math.nan)),
                   repetitions=len(r.get("samples_ts", [])))


def generated_text(stdout: str, prompt: str) -> str:
    """The generated part of a binary's stdout (everything after the echoed prompt)."""
    i = stdout.find(prompt)
    out = stdout[i + len(prompt):] if i >= 0 else stdout
    return out.rstrip("\n")


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def bin_dir(path: Path | str | None = None, kernels: str = "stock") -> Path:
    """Where the peer binaries on ``kernels`` live: ``path``, else $SPECSTACK_LLAMA_BINS (stock) or
    $SPECSTACK_LLAMA_BINS_SPECSTACK (specstack), else the build cache's folder.

    The folder must hold binaries on those kernels, and ours must be built from the current C sources and
    edits: a row labelled with one kernel set must never have run on the other."""
    if kernels not in KERNELS:
        raise InvalidParameterError(f"unknown peer kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    env, default = (BIN_DIR_ENV, DEFAULT_BIN_DIR) if kernels == "stock" else (SPECSTACK_BIN_DIR_ENV, SPECSTACK_BIN_DIR)
    d = Path(path or os.environ.get(env) or default)
    if not (d / "llama-speculative-simple").exists():
        minutes = "about 8 minutes" if kernels == "stock" else "once, about 9 minutes"
        raise PeerError(f"llama.cpp peer binaries on {kernels} kernels not found in {d}; build them with "
                        f"{BUILD_COMMAND[kernels]} ({minutes} on 2 cores) or set ${env}")
    found = kernels_of(d)
    if found != kernels:
        raise PeerError(f"{d} holds llama.cpp binaries on {found} kernels, not {kernels}: point "
                        f"${env} at the folder {BUILD_COMMAND[kernels]} prints")
    if kernels == "specstack":
        _check_current(d)
    return d


def kernels_of(folder: Path) -> str:
    """Which kernels a bin folder's binaries run: its KERNELS file (written by the specstack build) says."""
    try:
        line = (folder / "KERNELS").read_text().strip()
    except OSError:
        return "stock"
    return "specstack" if line.startswith("specstack") else "stock"


def _check_current(folder: Path) -> None:
    """Specstack-kernel bins built from other C sources or edits than this checkout's would run other kernels."""
    from ..llama.kernel_tree import bins_key  # stdlib and the edit list only: no llama_cpp

    try:
        version = (folder / "VERSION").read_text().splitlines()[0].strip()
        built = (folder / "KERNELS").read_text().split()[1]
    except (OSError, IndexError):
        raise PeerError(f"{folder} does not say what it was built from (VERSION, KERNELS); rebuild with "
                        f"{BUILD_COMMAND['specstack']}") from None
    if built != bins_key(version):
        raise PeerError(f"the llama.cpp binaries in {folder} were built with older specstack kernels (build {built}, "
                        f"now {bins_key(version)}); rebuild with {BUILD_COMMAND['specstack']}")


def kernel_folders(kernels: Sequence[str], stock: Path | str | None = None) -> dict[str, Path]:
    """The checked bin folder of each of ``kernels``, in order; ``stock`` is --llama-cpp-bin (the specstack
    folder is found by its variable or in the cache): a missing one fails before anything is measured."""
    return {k: bin_dir(stock if k == "stock" else None, k) for k in kernels}


def _common(model: Path, prompt_file: Path, n_predict: int, threads: int, ctx: int, seed: int) -> list[str]:
    # --no-escape: prompts are code, whose "\n" inside string literals must stay two characters.
    return ["-m", str(model), "-f", str(prompt_file), "--no-escape", "-n", str(n_predict), "-t", str(threads),
            "-c", str(ctx), "--temp", "0", "--top-k", "1", "--seed", str(seed)]


def peer_command(method: str, model: Path | str, prompt_file: Path | str, *, draft: Path | str | None = None,
                 n_predict: int = 128, threads: int = 2, k: int = 4, ctx: int = 512, seed: int = 1,
                 bins: Path | str | None = None, kernels: str = "stock") -> list[str]:
    """The argv that runs ``method`` (one of ``PEER_METHODS``) from the bin folder on ``kernels``."""
    if method not in PEER_METHODS:
        raise InvalidParameterError(f"unknown peer method {method!r}; choose one of {', '.join(PEER_METHODS)}")
    if k < 1:
        raise InvalidParameterError(f"k must be at least 1, got {k}")
    b = bin_dir(bins, kernels)
    common = _common(Path(model), Path(prompt_file), n_predict, threads, ctx, seed)
    if method == "llama-plain":
        return [str(b / "llama-completion"), *common, "-no-cnv", "--no-display-prompt"]
    if method == "llama-lookup":
        return [str(b / "llama-lookup"), *common, "--spec-draft-n-max", str(k)]
    spec = [str(b / "llama-speculative-simple"), *common, "--spec-draft-n-max", str(k)]
    if method in HEAD_PEERS or method == "llama-draft-simple":  # a draft model, or a trained head, as -md
        if draft is None:
            raise InvalidParameterError(f"{method} needs a draft model" + (f" (the {HEAD_PEERS[method]} head, -md)"
                                                                            if method in HEAD_PEERS else ""))
        return [*spec, "--spec-type", method.removeprefix("llama-"), "-md", str(draft)]
    if method == "llama-draft-mtp":  # the model's NextN layers; llama.cpp loads them (load_mtp) for this type
        return [*spec, "--spec-type", "draft-mtp"]
    spec_type = method.removeprefix("llama-")
    args = [*spec, "--spec-type", spec_type]
    for flag in NGRAM_SPEC_TYPES[spec_type]:
        args += [flag, str(k)]
    if spec_type == "ngram-mod":
        args += ["--spec-ngram-mod-n-min", str(max(1, math.ceil(k * NGRAM_MOD_MIN_FRACTION)))]
    return args


_PARSERS: dict[str, Callable[[str, str | None], dict[str, Any]]] = {
    "llama-plain": parse_plain,
    "llama-lookup": parse_lookup,
}


def run_peer(method: str, model: Path | str, prompt: str, *, draft: Path | str | None = None,
             n_predict: int = 128, threads: int = 2, k: int = 4, ctx: int = 512, seed: int = 1,
             bins: Path | str | None = None, timeout: float = 600,
             extra_args: Sequence[str] = (), kernels: str = "stock") -> dict[str, Any]:
    """Run one peer greedily on ``prompt`` and return its parsed result.

    Besides ``RESULT_KEYS`` the dict holds ``command``, ``k`` (the effective draft cap), ``kernels``
    (the ggml-cpu kernels its binary runs: ``stock`` or ``specstack``) and ``text`` (the generated text,
    to check that every method produced the same output).
    """
    parse = _PARSERS.get(method, parse_speculative_simple)
    with tempfile.TemporaryDirectory(prefix="specstack-peer-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        # llama.cpp's -f drops one trailing newline; add one so the prompt arrives unchanged.
        prompt_file.write_text(prompt + "\n", encoding="utf-8")
        cmd = [*peer_command(method, model, prompt_file, draft=draft, n_predict=n_predict, threads=threads,
                             k=k, ctx=ctx, seed=seed, bins=bins, kernels=kernels), *extra_args]
        for attempt in range(1, LOST_LOG_TRIES + 1):
            proc = _run(cmd, method, timeout, show_command=True)
            try:
                result = parse(proc.stderr, method)
                break
            except PeerError:
                # A clean exit without its closing stats lost the tail of its log (see LOST_LOG_TRIES).
                if attempt == LOST_LOG_TRIES:
                    raise
    result["command"] = cmd
    result["kernels"] = kernels
    result["text"] = generated_text(proc.stdout, prompt)
    if method == "llama-plain":
        result["k"] = 0
    elif method == "llama-ngram-cache":
        result["k"] = NGRAM_CACHE_DRAFT
    return result


def run_llama_bench(model: Path | str, *, n_gen: int = 128, threads: int = 2, repetitions: int = 3,
                    bins: Path | str | None = None, timeout: float = 600, kernels: str = "stock") -> dict[str, Any]:
    """Plain decode rate from ``llama-bench`` (no prompt, ``repetitions`` runs averaged) on ``kernels``."""
    cmd = [str(bin_dir(bins, kernels) / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n_gen),
           "-t", str(threads), "-r", str(repetitions), "-o", "jsonl"]
    proc = _run(cmd, "llama-bench", timeout)
    result = parse_llama_bench(proc.stdout)
    result["command"] = cmd
    result["kernels"] = kernels
    return result


def _run(cmd: list[str], what: str, timeout: float, show_command: bool = False) -> subprocess.CompletedProcess:
    """Run one llama.cpp binary; a timeout or a failure is a ``PeerError`` that quotes its stderr's tail."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"{what} did not finish within {timeout:.0f} s") from exc
    if proc.returncode != 0:
        shown = f": {' '.join(cmd)}" if show_command else ""
        raise PeerError(f"{what} exited with status {proc.returncode}{shown}\n{_tail(proc.stderr)}")
    return proc
