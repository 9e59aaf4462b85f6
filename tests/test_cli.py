"""Bad input at the CLI: each case gets one clear error line and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specstack.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-m", "/nonexistent/model.gguf"], "target file not found"),
        (["-k", "0"], "k must be at least 1"),
        (["--temp", "-1"], "temperature must be >= 0"),
        (["--drafter", "nope"], "unknown drafter 'nope'"),
        (["-n", "0"], "max_tokens must be >= 1"),
    ],
)
def test_bad_generate_arguments_give_clear_errors(capsys, argv, message):
    code, _, err = run_cli(capsys, "generate", "-p", "def f():", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_file_that_is_not_gguf_is_refused(capsys, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("import os\n")
    code, _, err = run_cli(capsys, "generate", "-p", "x", "-m", str(fake))
    assert code == 2 and "is not GGUF" in err


def test_a_vocab_only_gguf_is_refused_as_draft_before_generation(capsys, shared_dir):
    vocab = shared_dir / "vocab" / "ggml-vocab-gpt-2.gguf"
    code, out, err = run_cli(capsys, "generate", "-p", "x", "--drafter", "draft-model", "-md", str(vocab))
    assert code == 2 and out == ""
    assert "vocabulary-only" in err and "ggml-vocab-gpt-2.gguf" in err


def test_a_vocab_only_gguf_is_refused_as_target(capsys, shared_dir):
    vocab = shared_dir / "vocab" / "ggml-vocab-gpt-2.gguf"
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-m", str(vocab))
    assert code == 2 and out == "" and "vocabulary-only" in err and "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["--temp", "nan"], "temperature must be >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--drafter", "draft-model", "-md", "/etc/hostname"], "not a GGUF file"),
    (["--drafter", "draft-model", "-md", "/nonexistent.gguf"], "no such file"),
])
def test_bad_sampling_and_draft_inputs_are_refused(capsys, args, message):
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "4", *args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_cross_tokenizer_draft_of_same_domain_drafts_through_text(capsys, shared_dir):
    spm = shared_dir / "models" / "pycoder-1m-spm.gguf"
    code, out, _ = run_cli(capsys, "generate", "-p", "import os\n", "-n", "24", "--json", "--drafter", "draft-model",
                           "--k-policy", "fixed", "-md", str(spm))
    assert code == 0 and json.loads(out)["n_accepted"] > 0


def test_prompt_longer_than_context_is_refused(capsys, tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * 800)
    code, _, err = run_cli(capsys, "generate", "-f", str(long))
    assert code == 2 and "shorten the prompt" in err


def test_missing_prompt_file_is_reported(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "-f", str(tmp_path / "none.txt"))
    assert code == 2 and "cannot read prompt file" in err


def test_generate_json_has_the_documented_fields(capsys):
    code, out, _ = run_cli(capsys, "generate", "-p", "def add(a, b):\n", "-n", "24", "--json")
    data = json.loads(out)
    for key in ("text", "n_tokens", "n_drafted", "n_accepted", "acceptance_rate", "mean_accepted_length", "tokens_per_second", "drafter", "k"):
        assert key in data
    assert code == 0 and data["n_tokens"] == 24


def test_console_entry_point_prints_no_traceback(tmp_path):
    """Through a real process: the error path of the installed command."""
    proc = subprocess.run(
        [sys.executable, "-m", "specstack", "generate", "-p", "x", "-m", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["-t", "-3"], "threads must be >= 0"),
    (["--k-policy", "fixed", "-k", "1000"], "at most 62"),
    (["--k-max", "100"], "at most 62"),
    (["--drafter", "suffix", "--suffix-cache", "/nonexistent-dir/x.npz"], "cannot write in /nonexistent-dir"),
])
def test_bad_flags_fail_before_generating(capsys, args, message):
    code, out, err = run_cli(capsys, "generate", "-p", "import os", "-n", "4", *args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["generate", "-p", "x"], ["demo"], ["tune"], ["bench", "run", "--workload", "w"], ["bench", "replay", "r.json"],
])
def test_k_is_spelled_as_in_generate_everywhere(argv):
    """-k and --draft-max set args.k in every command that runs drafts; --k stays as an old spelling
    where it was one (without it argparse would read --k as an abbreviation of --k-max)."""
    from specstack.cli import build_parser

    parser = build_parser()
    listed = argv[0] in ("tune", "bench")  # these take a comma-separated list of k
    for flag in ("-k", "--draft-max", *(["--k"] if listed else [])):
        args = parser.parse_args([*argv, flag, "3"])
        assert args.k == ([3] if listed else 3), flag


def test_generate_statistics_are_one_aligned_table(capsys):
    code, _, err = run_cli(capsys, "generate", "-p", "def f(x):\n", "-n", "8")
    rows = err[err.index("-" * 60):].splitlines()[1:]
    assert code == 0 and [r.split("  ")[0] for r in rows[:2]] == ["drafter", "tokens"]
    starts = {len(r) - len(r[r.index("  "):].lstrip()) for r in rows}
    assert len(starts) == 1, rows  # every value starts in the same column


def test_every_drafter_flag_reaches_its_config_field(tmp_path):
    """The flag table is the one mapping: each flag's value arrives in each config field it names."""
    from dataclasses import fields

    from specstack.cli import build_parser
    from specstack.commands.common import DRAFTER_FLAGS, drafter_options
    from specstack.drafters.base import config_from_options

    samples = {int: "2", float: "0.5", Path: str(tmp_path / "x")}
    argv = ["generate", "-p", "x"]
    for f in DRAFTER_FLAGS:
        argv += [f.flag] if f.type is None else [f.flag, samples[f.type]]
    options = drafter_options(build_parser().parse_args(argv))
    for f in DRAFTER_FLAGS:
        expected = True if f.type is None else f.type(samples[f.type])
        for cls in f.configs.values():
            given = {"sources": ("suffix",)} if "sources" in {x.name for x in fields(cls)} else {}
            assert getattr(config_from_options(cls, options, **given), f.field) == expected, (f.flag, cls.__name__)


def test_drafter_flag_help_reads_the_config_defaults():
    from specstack.commands.common import DRAFTER_FLAGS
    from specstack.drafters.cascade import CascadeConfig

    helps = {f.flag: f.help_text() for f in DRAFTER_FLAGS}
    assert f"(default {CascadeConfig(('x',)).min_len})" in helps["--cascade-min-len"]
    assert helps["--min-token-prob"].startswith("suffix/rest: ")
    assert "(default: suffix 0.1, rest 0.2)" in helps["--min-token-prob"]


@pytest.mark.parametrize("args,k,note", [
    (["-k", "8"], None, True),  # the default cost policy chooses k itself: -k is not used, and not recorded
    ([], None, False),
    (["--k-policy", "fixed", "-k", "3"], 3, False),
])
def test_k_is_recorded_only_where_it_is_used(capsys, args, k, note):
    code, out, err = run_cli(capsys, "generate", "-p", "def f(x):\n", "-n", "8", "--json", *args)
    assert code == 0 and json.loads(out)["k"] == k
    assert ("-k 8 is not used by --k-policy cost" in err) == note


@pytest.mark.parametrize("ctx,message", [
    ("99999999", "KV cache, but only"),  # refused before llama.cpp allocates it (it once crashed after its error)
    ("4294967296", "more than llama.cpp can address"),  # wraps llama.cpp's 32-bit n_ctx and aborts inside it
])
def test_impossible_context_sizes_are_errors_not_crashes(ctx, message):
    """Through a real process, since a crash inside llama.cpp would take pytest down with it."""
    proc = subprocess.run([sys.executable, "-m", "specstack", "generate", "-p", "x", "-n", "2", "-c", ctx],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert message in proc.stderr and "--ctx-size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("ctx", ["16", "100"])
def test_small_contexts_run_without_aborting_in_llama_cpp(ctx):
    """-c 100 once aborted in llama.cpp (GGML_ASSERT n_tokens_all <= n_batch): it rounds a small n_ctx up to 256 but
    kept the n_batch it was given, and the shape probe and cost curve made calls wider than that."""
    proc = subprocess.run([sys.executable, "-m", "specstack", "generate", "-p", "def f(", "-n", "8", "-c", ctx, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert json.loads(proc.stdout)["n_tokens"] == 8


def test_a_context_too_small_for_any_step_is_refused():
    proc = subprocess.run([sys.executable, "-m", "specstack", "generate", "-p", "x", "-n", "2", "-c", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--ctx-size 3 is too small" in proc.stderr and "Traceback" not in proc.stderr


def test_a_context_past_the_trained_one_is_a_warning(capsys):
    with pytest.warns(UserWarning, match="more than the 512 positions it was trained on"):
        code, out, _ = run_cli(capsys, "generate", "-p", "import os", "-n", "4", "-c", "1024", "--json")
    assert code == 0 and json.loads(out)["n_tokens"] == 4


def test_an_empty_prompt_generates_from_bos_like_llama_cpp(capsys):
    """-p '' tokenizes to BOS alone (the bundled model adds one), so plain decoding starts from it."""
    code, out, err = run_cli(capsys, "generate", "-p", "", "-n", "6", "--json", "--drafter", "prompt-lookup")
    assert code == 0 and json.loads(out)["n_tokens"] == 6 and "Traceback" not in err


def test_k_max_zero_is_refused_not_taken_as_the_default(capsys):
    code, _, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "--k-max", "0")
    assert code == 2 and "k_max must be at least 1 (got 0)" in err


def test_seed_minus_one_means_random_as_in_llama_cpp(capsys):
    code, out, err = run_cli(capsys, "generate", "-p", "import os", "-n", "4", "--temp", "0.8", "--seed", "-1",
                             "--drafter", "draft-model", "--json")
    assert code == 0 and json.loads(out)["n_tokens"] == 4 and "Traceback" not in err


def test_more_threads_than_cpus_warn(capsys):
    code, _, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "-t", "64", "--json")
    assert code == 0 and "-t 64 is more than the" in err


def test_a_prompt_file_with_invalid_utf8_is_read_like_llama_cpp(capsys, tmp_path):
    path = tmp_path / "p.py"
    path.write_bytes(b"def f(\xff\xfe):\n    return ")
    code, out, err = run_cli(capsys, "generate", "-f", str(path), "-n", "3", "--json")
    assert code == 0 and json.loads(out)["n_tokens"] == 3 and "not valid UTF-8 (byte 6)" in err


# ----------------------------------------------------------------------------- issue 22: more bad input

@pytest.mark.parametrize("content,message", [
    (b'k = "abc"\n', "unknown top-level keys k"),
    (b"default = 5\n", "default and category must be tables"),
    (b'[default]\nk = "abc"\n', "k must be an integer of at least 1"),
    (b"\x7fELF\x02\x01\x01\x00\xd0\xff", "not UTF-8 text"),
])
def test_a_bad_profile_is_a_clear_error(capsys, tmp_path, content, message):
    profile = tmp_path / "p.toml"
    profile.write_bytes(content)
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "--profile", str(profile))
    assert code == 2 and out == "" and message in err and "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["--drafter", "prompt-lookup", "--tree"], "--tree applies to --drafter rest or suffix"),
    (["--drafter", "draft-model", "--ngram-min", "2"], "--ngram-min applies to --drafter prompt-lookup"),
    (["--drafter", "prompt-lookup", "--ngram-min", "5", "--ngram-max", "2"], "--ngram-min <= --ngram-max"),
    (["--drafter", "draft-model", "--draft-p-min", "2"], "--draft-p-min must be in [0, 1)"),
    (["--drafter", "cascade:suffix,magic"], "unknown drafter 'magic'"),
])
def test_drafter_arguments_are_checked_before_the_target_loads(capsys, args, message):
    """Named by the flags the user typed, and before the target's load line: a load and probe take minutes."""
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", *args)
    assert code == 2 and out == "" and message in err and "loaded" not in err and "Traceback" not in err


def test_a_workload_that_is_not_utf8_is_a_clear_error(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "\xd0\xff"}\n')
    code, _, err = run_cli(capsys, "bench", "run", "--workload", str(bad), "--methods", "none", "-q", "-o", str(tmp_path / "o"))
    assert code == 2 and "not UTF-8 text" in err and "Traceback" not in err


@pytest.mark.parametrize("corpus,out,message", [
    ("/bin/ls", None, "nothing to index"),
    (None, "/proc/nope/store", "cannot write the datastore in /proc/nope"),
])
def test_datastore_build_refuses_what_would_be_empty_or_unwritable(capsys, tmp_path, corpus, out, message):
    readme = Path(__file__).resolve().parents[1] / "README.md"
    target = Path(out) if out else tmp_path / "store"
    code, _, err = run_cli(capsys, "datastore", "build", corpus or str(readme), "-o", str(target))
    assert code == 2 and message in err and "Traceback" not in err and not target.exists()


def test_models_scan_fails_when_no_file_could_be_read(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GG")
    proc = subprocess.run([sys.executable, "-m", "specstack", "models", "scan", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1 and "none of the 1 GGUF file(s) found could be read" in proc.stderr


@pytest.mark.parametrize("argv,message", [
    (["--port", "-1"], "--port must be in 1..65535"),
    (["--drafter", "magic"], "unknown drafter 'magic' in --drafter"),
    (["--drafter", "draft-model", "-md", "/nonexistent.gguf"], "draft model (-md)"),
])
def test_serve_refuses_bad_arguments_at_start_up(argv, message):
    """It used to start and answer every request with 503 (--drafter magic), or print a traceback (--port -1)."""
    proc = subprocess.run([sys.executable, "-m", "specstack", "serve", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_roles_file_with_a_wrong_type_names_the_key(tmp_path):
    roles = tmp_path / "roles.toml"
    roles.write_text('[roles.a]\nparallel = "two"\n')
    proc = subprocess.run([sys.executable, "-m", "specstack", "serve", "--config", str(roles)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "role 'a': parallel must be an integer (got 'two')" in proc.stderr
