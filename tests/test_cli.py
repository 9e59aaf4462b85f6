"""Bad input at the CLI: each case gets one clear error line and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

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
        (["-k", "0"], "k must be >= 1"),
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
    (["--drafter", "suffix", "--suffix-cache", "/nonexistent-dir/x.npz"], "not writable"),
])
def test_bad_flags_fail_before_generating(capsys, args, message):
    code, out, err = run_cli(capsys, "generate", "-p", "import os", "-n", "4", *args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err
