"""Issue 55, item 2: ``specstack serve`` takes every flag of the vendored llama-server's --help.

Each flag is honoured where it maps onto llama.cpp or the server, accepted with a note in --help where it cannot
change anything here (device flags on a CPU), or refused in one line saying why and what to use; never argparse's
bare "unrecognized arguments".  The list is ``fixtures/llama_server_flags.txt``, which
``scripts/llama_server_flags.py`` reads from llama.cpp's common/arg.cpp.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specstack.cli import build_parser, main
from specstack.paths import DEFAULT_TARGET

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "llama_server_flags.txt"
ARG_CPP = Path(os.environ.get("LLAMA_CPP_SRC", "/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")) / "common" / "arg.cpp"

# A value each flag takes on a llama-server command line, by the value hint --help shows (else "1")
BY_HINT = {"[on|off|auto]": "auto", "{none,linear,yarn}": "yarn", "TYPE": "f16", "MODE": "auto", "M": "0x1",
           "lo-hi": "0-0", "KEY=TYPE:VALUE,...": "tokenizer.ggml.add_bos_token=bool:false", "FORMAT": "auto",
           "START END": "1 2", "SCHEMA": "{}", "[on|off]": "off", "P": "0.5"}
BY_FLAG = {"--numa": "distribute", "-lzm": "auto", "--lazy-mode": "auto", "-lm": "mmap", "--load-mode": "mmap",
           "-ngl": "0", "--gpu-layers": "0", "--n-gpu-layers": "0", "--reasoning-budget": "-1", "--spec-type": "ngram-mod",
           "--grammar": 'root ::= "a"', "--prio": "0", "--host": "127.0.0.1", "-fa": "on", "--flash-attn": "on",
           "--typical": "1", "--typical-p": "1", "--top-p": "0.9", "--min-p": "0.1",
           **dict.fromkeys(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"), "0")}
# llama-server's sampling flags (arg.cpp's set_sampling) that do not parse yet: the lead's part of issue 55, kept
# here so that the list of what is left stays true (strict: one that starts parsing fails until it is taken out)
LEFT_TO_LEAD = {"--samplers", "--sampler-seq", "--sampling-seq", "--ignore-eos", "--top-nsigma", "--top-n-sigma",
                "--xtc-probability", "--xtc-threshold", "--dry-multiplier", "--dry-base", "--dry-allowed-length",
                "--dry-penalty-last-n", "--dry-sequence-breaker", "--adaptive-target", "--adaptive-decay",
                "--dynatemp-range", "--dynatemp-exp", "--mirostat", "--mirostat-lr", "--mirostat-ent", "-l",
                "--logit-bias"}


def fixture_flags() -> list[tuple[str, str]]:
    """(flag, value hint) for every spelling of every option in the fixture."""
    out = []
    for line in FIXTURE.read_text().splitlines():
        if line and not line.startswith("#"):
            names, hint = line.split("\t")
            out += [(name, hint) for name in names.split(",")]
    return out


def argv_for(flag: str, hint: str) -> list[str]:
    if hint == "-":
        return [flag]
    value = BY_FLAG.get(flag, BY_HINT.get(hint, "1"))
    return [flag, *value.split(" ")] if hint == "START END" else [flag, value]


def parse(capsys, *argv: str) -> tuple[int | None, str]:
    """``specstack serve ARGV`` parsed (not run): the exit status (None: parsed) and stderr."""
    try:
        build_parser().parse_args(["serve", *argv])
        code = None
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.skipif(not ARG_CPP.is_file(), reason="the llama-cpp-python sdist's llama.cpp is not unpacked here")
def test_the_fixture_is_the_flag_list_of_the_vendored_arg_cpp():
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "llama_server_flags.py"), str(ARG_CPP)],
                          capture_output=True, text=True, check=True).stdout
    assert made == FIXTURE.read_text()


def test_the_fixture_holds_llama_servers_flags_and_none_of_the_cli_ones():
    flags = {flag for flag, _ in fixture_flags()}
    assert {"--offline", "-tb", "--override-kv", "-np", "--rope-scaling", "--metrics", "--rpc", "-md"} <= flags
    assert not {"-p", "--prompt", "-cnv", "--image"} & flags  # llama-cli's and mtmd's, not llama-server's


@pytest.mark.parametrize("flag,hint", [
    pytest.param(flag, hint, marks=pytest.mark.xfail(strict=True, reason="sampling flags: the lead's"))
    if flag in LEFT_TO_LEAD else (flag, hint) for flag, hint in fixture_flags()])
def test_every_llama_server_flag_parses_or_is_refused_in_one_line(capsys, flag, hint):
    code, err = parse(capsys, *argv_for(flag, hint))
    if code in (None, 0):  # parsed, or printed what it was asked for (--help, --version) and exited
        return
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "unrecognized arguments" not in err and f"{flag} cannot apply to specstack serve: " in lines[0]
    assert ":" in lines[0].split("cannot apply to specstack serve: ", 1)[1]  # why, then what to use


def test_every_accepted_no_op_says_so_in_help(capsys):
    from specstack.commands.llama_server_flags import ACCEPTED, CPU

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = "".join(capsys.readouterr().out.split())  # as wrapped: argparse breaks lines at spaces and hyphens
    for flags, _, note in ACCEPTED:
        assert flags[0] in text and "".join(note.split()) in text
    assert text.count("".join(CPU.split())) >= 10  # the device flags: -dev, -sm, -ts, -mg, --fit, -ot, -cmoe, -nkvo, ...


def serve_role(*argv: str):
    from specstack.commands.serve import build_roles

    return build_roles(build_parser().parse_args(["serve", *argv]))[0]


def test_honoured_loading_flags_reach_the_roles_target_spec():
    spec = serve_role("-tb", "2", "--override-kv", "tokenizer.ggml.add_bos_token=bool:false,x.n=int:3",
                      "--override-kv", "x.f=float:0.5,x.s=str:hi", "--rope-scaling", "yarn", "--rope-scale", "4",
                      "--yarn-orig-ctx", "512", "--rope-freq-base", "10000", "-lm", "mlock", "-lzm", "on",
                      "--check-tensors", "-nr", "--special").spec()
    assert spec.threads_batch == 2 and spec.special and not spec.repack
    assert spec.kv_overrides == (("tokenizer.ggml.add_bos_token", False), ("x.n", 3), ("x.f", 0.5), ("x.s", "hi"))
    assert dict(spec.context_params) == {"rope_scaling_type": 2, "rope_freq_scale": 0.25, "yarn_orig_ctx": 512,
                                         "rope_freq_base": 10000.0}
    assert dict(spec.model_params) == {"lazy_mode": 2, "check_tensors": True}
    config = spec.model_config()
    assert (config.use_mmap, config.use_mlock, config.load_mode()) == (False, True, 2)  # LLAMA_LOAD_MODE_MLOCK
    assert serve_role("--direct-io").spec().model_config().load_mode() == 4  # LLAMA_LOAD_MODE_DIRECT_IO
    assert serve_role("--no-mmap").spec().model_config().load_mode() == 0  # it set a field llama.cpp no longer has
    assert serve_role().spec().model_config().load_mode() == 1  # mmap, llama.cpp's auto on a CPU


def test_np_minus_one_is_llama_servers_auto_four_slots_on_one_unified_cache():
    role = serve_role("-np", "-1", "-c", "8192")
    assert role.parallel == 4 and role.ctx == 8192  # unified: each slot may use all of -c, as -kvu
    assert serve_role("-np", "4", "-c", "8192").ctx == 2048


def test_a_roles_file_takes_the_same_options(tmp_path):
    from specstack.server.roles import load_roles

    path = tmp_path / "roles.toml"
    path.write_text('[roles.a]\nthreads_batch = 2\nspecial = true\nkv_overrides = {"x.n" = 3, "x.b" = false}\n'
                    'context_params = {rope_freq_base = 20000.0}\n')
    spec = load_roles(path)[0].spec()
    assert spec.threads_batch == 2 and spec.special and spec.kv_overrides == (("x.b", False), ("x.n", 3))
    assert spec.context_params == (("rope_freq_base", 20000.0),)
    path.write_text('[roles.a]\ncontext_params = {rope_freq = 1.0}\n')
    with pytest.raises(Exception, match="context_params has unknown names rope_freq"):
        load_roles(path)


@pytest.mark.parametrize("argv,message", [
    (["--override-kv", "x=int:abc"], "TYPE must be int, float, bool (true/false) or str"),
    (["--override-kv", "noequals"], "is not KEY=TYPE:VALUE"),
    (["-lm", "mmap", "--mlock"], "--load-mode mmap and --mlock each say how the weights are read"),
    (["--rope-scale", "2", "--rope-freq-scale", "0.5"], "--rope-scale and --rope-freq-scale each give the RoPE scale"),
    (["-np", "0"], "-1 for llama-server's auto"),
    (["--ssl-key-file", "k.pem"], "--ssl-key-file and --ssl-cert-file go together"),
    (["-tb", "2", "--config", "roles.toml"], "-tb would be ignored: set threads_batch"),
])
def test_bad_values_are_refused_naming_the_flag(capsys, tmp_path, argv, message):
    argv = [str(tmp_path / a) if a == "roles.toml" else a for a in argv]
    (tmp_path / "roles.toml").write_text("[roles.a]\n")
    try:
        code = main(["serve", "--port", "0", *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "unrecognized arguments" not in err


def test_lv_shows_llama_cpps_log_up_to_its_level():
    from specstack.llama import backend

    try:
        backend.set_verbose(False, 2)  # errors and warnings
        assert [backend._shown(level) for level in (1, 2, 3, 5, 4)] == [False, False, True, True, True]
        assert not backend._shown(2) and not backend._shown(5)  # a continuation follows its line
        backend.set_verbose(True)
        assert backend._shown(1)
    finally:
        backend.set_verbose(False)


def test_log_file_gets_what_serve_writes_to_stderr(tmp_path, monkeypatch):
    from specstack.commands import serve

    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after the tee replaces it
    serve.tee_stderr(tmp_path / "serve.log")
    print("specstack serve: a line", file=sys.stderr, flush=True)
    assert (tmp_path / "serve.log").read_text() == "specstack serve: a line\n"


# -- what reaches llama.cpp, on the bundled 6M model ----------------------------------------------------------------

def loaded(**config):
    from specstack.llama import LlamaModel, ModelConfig

    return LlamaModel(ModelConfig(path=DEFAULT_TARGET, n_ctx=64, n_threads=1, **config))


def test_threads_batch_reaches_the_context():
    with loaded(n_threads_batch=2) as model:
        lc = model._lc
        assert (lc.llama_n_threads(model._ctx), lc.llama_n_threads_batch(model._ctx)) == (1, min(2, len(os.sched_getaffinity(0))))
    with loaded() as model:
        assert model._lc.llama_n_threads_batch(model._ctx) == 1  # as -t, without -tb


def test_override_kv_changes_what_llama_cpp_reads():
    with loaded() as model:
        bos, ctx_train = model.add_bos, model.n_ctx_train
    with loaded(kv_overrides=(("tokenizer.ggml.add_bos_token", not bos),
                              (f"{model.meta.architecture}.context_length", ctx_train // 2))) as model:
        assert model.add_bos is (not bos) and model.n_ctx_train == ctx_train // 2


def test_rope_settings_change_the_logits_and_special_spells_tokens_out():
    import numpy as np

    with loaded() as model:
        tokens = model.tokenize("def add(a, b):\n    return a + b\n")
        plain = model.eval(tokens).copy()
        eos_text = model.token_bytes(model.eos_id)
    with loaded(context_params=(("rope_freq_base", 100.0),), special=True) as model:
        assert not np.allclose(model.eval(tokens), plain)
        assert eos_text == b"" and model.token_bytes(model.eos_id) == model.special_text(model.eos_id).encode()
