"""Parsers for llama.cpp's peer binaries, on outputs captured from the real binaries.

The fixtures in tests/fixtures/peers were made by ``scripts/build_llama_bins.sh``'s binaries on
the bundled pycoder pair (first line of each: the command). Only the last test runs a binary,
and it is skipped when they are not built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstack.bench import peers
from specstack.bench.peers import (
    PEER_METHODS,
    RESULT_KEYS,
    PeerError,
    generated_text,
    parse_llama_bench,
    parse_lookup,
    parse_plain,
    parse_speculative_simple,
    peer_command,
)
from specstack.errors import InvalidParameterError
from specstack.paths import DATA_DIR, DEFAULT_DRAFT, DEFAULT_TARGET

FIXTURES = Path(__file__).parent / "fixtures" / "peers"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_speculative_simple_draft_model():
    r = parse_speculative_simple(fixture("speculative-simple-draft-simple-k4.stderr.txt"), "llama-draft-simple")
    assert set(RESULT_KEYS) <= set(r)
    assert r["method"] == "llama-draft-simple"
    assert r["tok_per_s"] == pytest.approx(369.083)
    assert (r["n_predicted"], r["n_drafted"], r["n_accepted"], r["k"]) == (65, 105, 38, 4)
    assert r["acceptance"] == pytest.approx(38 / 105)
    assert r["decode_s"] == pytest.approx(0.176)
    assert r["prompt_tokens"] == 265
    # The perf summary's own "eval time ... inf tokens per second" must not be mistaken for the rate.
    assert r["raw"].endswith(fixture("speculative-simple-draft-simple-k4.stderr.txt")[-50:])


@pytest.mark.parametrize("name, tok_per_s, predicted, drafted, accepted, k", [
    ("speculative-simple-ngram-map-k-k4.stderr.txt", 577.246, 69, 40, 40, 4),
    ("speculative-simple-ngram-mod-k8.stderr.txt", 243.303, 72, 32, 32, 8),
])
def test_speculative_simple_ngram_types(name, tok_per_s, predicted, drafted, accepted, k):
    r = parse_speculative_simple(fixture(name))
    assert r["tok_per_s"] == pytest.approx(tok_per_s)
    assert (r["n_predicted"], r["n_drafted"], r["n_accepted"], r["k"]) == (predicted, drafted, accepted, k)
    assert r["acceptance"] == 1.0


def test_nothing_drafted_gives_no_acceptance():
    # ngram-simple's default 12-token lookup key found no match: llama.cpp prints "accept = -nan%".
    r = parse_speculative_simple(fixture("speculative-simple-ngram-simple-k4.stderr.txt"))
    assert (r["n_drafted"], r["n_accepted"], r["acceptance"]) == (0, 0, None)
    assert r["tok_per_s"] == pytest.approx(42.945)


def test_lookup():
    r = parse_lookup(fixture("lookup-k4.stderr.txt"))
    assert r["method"] == "llama-lookup"
    assert r["tok_per_s"] == pytest.approx(575.369)
    assert (r["n_predicted"], r["n_drafted"], r["n_accepted"], r["k"]) == (69, 48, 48, 4)
    assert r["draft_ms"] == pytest.approx(0.05)


def test_plain_completion():
    r = parse_plain(fixture("completion-plain.stderr.txt"))
    # "prompt eval time" comes first and must not be taken for the decode rate; the loop's rate counts the
    # sampling time beside the eval time (63 runs in 289.22 + 0.26 ms), as specstack's plain rate does.
    assert r["tok_per_s"] == pytest.approx(63 / 0.28948)
    assert r["n_predicted"] == 64  # 63 eval runs + the token sampled from the prompt's logits
    assert (r["n_drafted"], r["n_accepted"], r["acceptance"]) == (0, 0, None)
    assert r["prompt_tokens"] == 265


def test_plain_simple():
    r = parse_plain(fixture("simple-plain.stderr.txt"))
    assert r["tok_per_s"] == pytest.approx(31 / 0.07874)  # eval 78.70 ms + samplers 0.04 ms
    assert r["n_predicted"] == 32


def test_llama_bench_jsonl():
    r = parse_llama_bench(fixture("llama-bench-tg.jsonl.txt"))
    row = json.loads(fixture("llama-bench-tg.jsonl.txt").splitlines()[0])
    assert r["tok_per_s"] == pytest.approx(row["avg_ts"])
    assert (r["n_predicted"], r["repetitions"]) == (32, 2)


@pytest.mark.parametrize("parse", [parse_speculative_simple, parse_lookup, parse_plain, parse_llama_bench])
def test_unparseable_output_raises_peer_error(parse):
    with pytest.raises(PeerError, match="could not find|no token-generation"):
        parse("main: error: failed to load model\n")


def test_generated_text_strips_the_echoed_prompt():
    stdout = fixture("speculative-simple-draft-simple-k4.stdout.txt")
    prompt = json.loads((DATA_DIR / "prompts" / "code-complete.jsonl").read_text().splitlines()[0])["prompt"]
    text = generated_text(stdout, prompt)
    assert prompt not in text and text and stdout.rstrip("\n").endswith(text)


# ----------------------------------------------------------------------------- commands

@pytest.fixture
def fake_bins(tmp_path) -> Path:
    for name in ("llama-speculative-simple", "llama-lookup", "llama-completion"):
        (tmp_path / name).write_text("")
    return tmp_path


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_commands_are_greedy_with_shared_settings(fake_bins):
    for method in PEER_METHODS:
        cmd = peer_command(method, "t.gguf", "p.txt", draft="d.gguf", n_predict=64, threads=2, k=8, bins=fake_bins)
        assert (_flag(cmd, "--temp"), _flag(cmd, "--top-k"), _flag(cmd, "-t"), _flag(cmd, "-c")) == ("0", "1", "2", "512")
        assert _flag(cmd, "-n") == "64" and "--no-escape" in cmd
        if method not in ("llama-plain", "llama-ngram-cache"):
            assert "8" in cmd[cmd.index("-n") + 2:], method  # the draft cap reaches the binary


def test_command_per_method(fake_bins):
    cmd = peer_command("llama-draft-simple", "t.gguf", "p.txt", draft="d.gguf", k=4, bins=fake_bins)
    assert Path(cmd[0]).name == "llama-speculative-simple"
    assert (_flag(cmd, "--spec-type"), _flag(cmd, "-md"), _flag(cmd, "--spec-draft-n-max")) == ("draft-simple", "d.gguf", "4")
    cmd = peer_command("llama-ngram-mod", "t.gguf", "p.txt", k=4, bins=fake_bins)
    # llama.cpp's default n_min (48 of 64) would exceed a small k and disable drafting.
    assert (_flag(cmd, "--spec-ngram-mod-n-max"), _flag(cmd, "--spec-ngram-mod-n-min")) == ("4", "3")
    cmd = peer_command("llama-ngram-simple", "t.gguf", "p.txt", k=4, bins=fake_bins)
    assert _flag(cmd, "--spec-ngram-simple-size-m") == "4"
    cmd = peer_command("llama-lookup", "t.gguf", "p.txt", k=4, bins=fake_bins)
    assert Path(cmd[0]).name == "llama-lookup" and _flag(cmd, "--spec-draft-n-max") == "4"
    cmd = peer_command("llama-plain", "t.gguf", "p.txt", bins=fake_bins)
    assert Path(cmd[0]).name == "llama-completion" and "-no-cnv" in cmd


def test_command_errors(fake_bins, tmp_path):
    with pytest.raises(InvalidParameterError, match="unknown peer method"):
        peer_command("llama-eagle", "t.gguf", "p.txt", bins=fake_bins)
    with pytest.raises(InvalidParameterError, match="needs a draft model"):
        peer_command("llama-draft-simple", "t.gguf", "p.txt", bins=fake_bins)
    with pytest.raises(PeerError, match="build_llama_bins.sh"):
        peer_command("llama-plain", "t.gguf", "p.txt", bins=tmp_path / "empty")


# ----------------------------------------------------------------------------- real binaries

def _have_bins() -> bool:
    try:
        peers.bin_dir()
    except PeerError:
        return False
    return True


def _replaying_peer(bin_dir: Path, lost_runs: int) -> None:
    """A llama-speculative-simple that replays a captured run, its log's tail lost the first times.

    The loss is llama.cpp's own (its logger thread is not joined at exit): it cannot be forced in
    the real binary, so this replays the real binary's captured output.
    """
    stderr = FIXTURES / "speculative-simple-draft-simple-k4.stderr.txt"
    stdout = FIXTURES / "speculative-simple-draft-simple-k4.stdout.txt"
    script = bin_dir / "llama-speculative-simple"
    script.write_text(f"""#!/bin/sh
n=$(cat "{bin_dir}/runs" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "{bin_dir}/runs"
if [ $n -le {lost_runs} ]; then head -n 2 "{stderr}" >&2; exit 0; fi
cat "{stderr}" >&2; cat "{stdout}"
""")
    script.chmod(0o755)


@pytest.mark.parametrize("lost_runs, runs, ok", [(0, 1, True), (2, 3, True), (3, 3, False)])
def test_a_run_that_lost_its_log_tail_runs_again(tmp_path, lost_runs, runs, ok):
    _replaying_peer(tmp_path, lost_runs)
    run = lambda: peers.run_peer("llama-draft-simple", DEFAULT_TARGET, "x", draft=DEFAULT_DRAFT, bins=tmp_path)
    if ok:
        assert run()["n_accepted"] > 0
    else:
        with pytest.raises(PeerError, match="encoded"):
            run()
    assert int((tmp_path / "runs").read_text()) == runs == min(lost_runs + 1, peers.LOST_LOG_TRIES)


@pytest.mark.skipif(not _have_bins(), reason="llama.cpp peer binaries not built (scripts/build_llama_bins.sh)")
def test_run_peer_draft_model_matches_plain_greedy_output():
    prompt = "def fibonacci(n):\n    if n < 2:\n"
    # One thread: this checks output, not speed, and 2 spinning threads stall on a busy machine.
    plain = peers.run_peer("llama-plain", DEFAULT_TARGET, prompt, n_predict=24, threads=1, k=4)
    spec = peers.run_peer("llama-draft-simple", DEFAULT_TARGET, prompt, draft=DEFAULT_DRAFT, n_predict=24,
                          threads=1, k=4)
    assert spec["n_drafted"] > 0 and spec["n_accepted"] > 0
    n = min(len(plain["text"]), len(spec["text"]))
    assert n > 20 and plain["text"][:n] == spec["text"][:n]


def test_the_peers_each_drafter_declares_are_peer_binaries_and_each_spec_type_has_one_drafter():
    """What llama.cpp calls a drafter's job is declared beside its ``@register`` (``LlamaCpp``): a peer it names must be
    one the bench can run, and a --spec-type declared by two drafters would map to whichever registered last."""
    from specstack.bench.results import PLAIN
    from specstack.drafters import available, base

    declared = base.llama_peers()
    assert declared[PLAIN] == ("llama-plain",) and set(declared) <= set(available())
    assert {p for ps in declared.values() for p in ps} <= set(PEER_METHODS)
    assert set(base.llama_spec_types().values()) <= set(available())
    types = [t for llama in base._LLAMA_CPP.values() for t in llama.spec_types]
    assert len(types) == len(set(types))
