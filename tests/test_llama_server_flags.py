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
           **dict.fromkeys(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"), "0"),
           # the sampling flags: a chain applied here (llama.cpp's default one), a bias, and the samplers not
           # implemented here at llama.cpp's defaults (any other value is refused: test_default_only_sampling_flags_...)
           "--samplers": "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature",
           "--sampler-seq": "edskypmxt", "--sampling-seq": "ekpmt", "-l": "15+1", "--logit-bias": "15-inf",
           "--top-nsigma": "-1", "--top-n-sigma": "-1", "--xtc-probability": "0", "--xtc-threshold": "0.1",
           "--dry-multiplier": "0", "--dry-base": "1.75", "--dry-allowed-length": "2", "--dry-penalty-last-n": "64",
           "--dry-sequence-breaker": "\n", "--adaptive-target": "-1", "--adaptive-decay": "0.9",
           "--dynatemp-range": "0", "--dynatemp-exp": "1", "--mirostat": "0", "--mirostat-lr": "0.1",
           "--mirostat-ent": "5"}


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


@pytest.mark.parametrize("flag,hint", fixture_flags())
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
    (["--ignore-eos", "--config", "roles.toml"], "--ignore-eos would be ignored: set ignore_eos"),
    (["-l", "4096+1"], "-l/--logit-bias: token id 4096 is outside the vocabulary of pycoder-6m.gguf (0..4095)"),
    (["--dry-sequence-breaker", "\n"], "so its sequence breakers stay llama.cpp's defaults"),
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


# -- llama-server's sampling flags ---------------------------------------------------------------------------------

# llama.cpp's sampling flags of samplers not implemented here, each with a value other than llama.cpp's default
NOT_DEFAULT = {"--top-nsigma": "1.5", "--top-n-sigma": "0", "--xtc-probability": "0.5", "--xtc-threshold": "0.2",
               "--dry-multiplier": "0.8", "--dry-base": "2", "--dry-allowed-length": "3", "--dry-penalty-last-n": "32",
               "--dry-sequence-breaker": "none", "--adaptive-target": "0.5", "--adaptive-decay": "0.5",
               "--dynatemp-range": "0.5", "--dynatemp-exp": "2", "--mirostat": "2", "--mirostat-lr": "0.2",
               "--mirostat-ent": "3"}


@pytest.mark.parametrize("flag,value", NOT_DEFAULT.items())
def test_samplers_not_implemented_take_llamas_default_and_refuse_the_rest_in_one_line(capsys, flag, value):
    assert parse(capsys, flag, BY_FLAG[flag])[0] is None  # llama.cpp's default: parsed
    code, err = parse(capsys, flag, value)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "usage" not in err, err
    assert f"{flag} {value}: " in lines[0] and "not implemented here" in lines[0]
    assert "distribution that speculation verifies drafts against" in lines[0] and "leave" in lines[0]


def test_logit_bias_flag_reads_llamas_syntax_and_refuses_the_rest_in_one_line(capsys):
    role = serve_role("-l", "15+1", "--logit-bias", "16-inf", "-l", "17-2.5", "-l", "15-0.5")
    assert role.logit_bias == ((15, -0.5), (16, float("-inf")), (17, -2.5))  # a token named twice: its last bias
    assert role.controls().logit_bias == role.logit_bias and serve_role().logit_bias == ()
    for value, message in (("15", "must be TOKEN_ID(+/-)BIAS"), ("x+1", "must be TOKEN_ID(+/-)BIAS"),
                           ("15*2", "must be TOKEN_ID(+/-)BIAS"), ("15+200", "a bias must be in [-100, 100]"),
                           ("15+inf", "a bias must be in [-100, 100]")):
        code, err = parse(capsys, "-l", value)
        assert code == 2 and err.strip().splitlines() == [err.strip()] and f"-l {value}: {message}" in err, err


def test_samplers_flags_are_the_roles_chain_in_names_or_letters(capsys):
    assert serve_role("--samplers", "Top_K;top-p;minp;temperature").samplers == ("top_k", "top_p", "min_p",
                                                                                 "temperature")
    assert serve_role("--sampler-seq", "edkt").samplers == ("penalties", "dry", "top_k", "temperature")
    assert serve_role().samplers is None  # every sampler, as before
    for flag, value, message in (("--samplers", "temperature;top_k", "the chain applied here is penalties, top_k"),
                                 ("--samplers", "top_k;magic", "unknown sampler 'magic'"),
                                 ("--sampling-seq", "kpmti", "the chain applied here is")):
        code, err = parse(capsys, flag, value)
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"{flag} {value}: {message}" in err, err


def test_a_roles_file_takes_ignore_eos_logit_bias_and_samplers(tmp_path):
    from specstack.server.roles import load_roles

    path = tmp_path / "roles.toml"
    path.write_text('[roles.a]\nignore_eos = true\nlogit_bias = {"15" = 2.5, "16" = false}\nsamplers = "kt"\n'
                    '[roles.b]\nlogit_bias = [[15, -inf], [16, -1]]\nsamplers = ["penalties", "temperature"]\n')
    a, b = load_roles(path)
    assert a.ignore_eos and a.logit_bias == ((15, 2.5), (16, float("-inf"))) and a.samplers == ("top_k", "temperature")
    assert b.logit_bias == ((15, float("-inf")), (16, -1.0)) and b.samplers == ("penalties", "temperature")
    for bad, message in (('logit_bias = {"def" = 1}', "'def' is not a token id"),
                         ('samplers = ["temperature", "top_k"]', "samplers: the chain applied here"),
                         ("ignore_eos = 1", "ignore_eos must be true or false")):
        path.write_text(f"[roles.a]\n{bad}\n")
        with pytest.raises(Exception, match=message):
            load_roles(path)


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


# -- the honoured sampling flags change what a request gets, over HTTP on the bundled model -----------------------

# A prompt the bundled model continues with repeats: a repeat penalty changes its text.
REPEATS = 'RECORD = {"name": "alpha", "size": 12, "ok": true}\nRECORD = {"name": "beta", "size": 7, "ok": false}\nRECORD = '


def plain(target, prompt: str, n: int, **controls):
    """Plain decoding (greedy, no drafts) of ``prompt`` under these logit controls: what a request must get."""
    from specstack.constraints import Constraints
    from specstack.draft_length import FixedK
    from specstack.drafters import BuildContext, create
    from specstack.engine import Engine
    from specstack.generation import GenerationConfig

    engine = Engine(target, create("none", BuildContext(target)), FixedK(1))
    return engine.generate(prompt, GenerationConfig(max_tokens=n, constraints=Constraints(**controls))).run()


@pytest.fixture(scope="module")
def flagged(target):
    """A server of two roles, each built from llama-server's flags as `specstack serve` builds it: "eos" with
    --ignore-eos and -l banning the first token plain decoding of PROMPT picks; "chain" with --repeat-penalty and a
    --samplers chain without penalties.  --exact on: outputs are compared with plain decoding token for token."""
    import httpx

    from specstack.server.app import Limits, create_app
    from test_serve import PROMPT, Server

    first = plain(target, PROMPT, 1).output_ids[0]
    eos = serve_role("-a", "eos", "-np", "1", "--exact", "on", "--ignore-eos", "-l", f"{first}-inf")
    chain = serve_role("-a", "chain", "-np", "1", "--exact", "on", "--repeat-penalty", "1.3", "--samplers",
                       "top_k;top_p;min_p;temperature")
    with Server(create_app([eos, chain], Limits(max_tokens=64))) as server:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            yield http, PROMPT, first


def test_ignore_eos_flag_runs_a_request_that_sends_none_past_the_end_of_text(flagged, target):
    """The bundled model seldom ends a text, so each request raises the end-of-text token to +100: a request
    that sends no ignore_eos runs on past it all the same; one that sends ignore_eos false ends at once."""
    http, prompt, first = flagged
    push = {str(target.eos_id): 100}
    r = http.post("/completion", json={"model": "eos", "prompt": prompt, "n_predict": 16, "temperature": 0,
                                       "logit_bias": push}).json()
    assert r["tokens_predicted"] == 16 and target.eos_id not in r["tokens"]
    assert r["tokens"] == plain(target, prompt, 16, ignore_eos=True, logit_bias=((target.eos_id, 100.0),)).output_ids
    assert r["generation_settings"]["ignore_eos"] is True
    own = http.post("/completion", json={"model": "eos", "prompt": prompt, "n_predict": 16, "temperature": 0,
                                         "logit_bias": push, "ignore_eos": False}).json()
    assert own["stop_type"] == "eos" and own["tokens_predicted"] <= 1


def test_logit_bias_flag_bans_its_token_for_a_request_that_sends_no_logit_bias(flagged, target):
    http, prompt, first = flagged
    r = http.post("/completion", json={"model": "eos", "prompt": prompt, "n_predict": 12, "temperature": 0}).json()
    assert first not in r["tokens"]
    assert r["tokens"] == plain(target, prompt, 12, ignore_eos=True, logit_bias=((first, float("-inf")),)).output_ids
    # a request's own list replaces the role's, as llama-server's does: the token is free again
    own = http.post("/v1/completions", json={"model": "eos", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                             "logit_bias": {}}).json()
    assert own["choices"][0]["text"] == plain(target, prompt, 12, ignore_eos=True).text
    assert plain(target, prompt, 12).output_ids[0] == first


def test_samplers_flag_is_the_chain_of_a_request_that_sends_none(flagged, target):
    """Role "chain" has --repeat-penalty 1.3 and a chain without penalties: a bare request gets no penalty (as
    llama-server builds its chain from that list alone); a request whose own chain has penalties gets 1.3."""
    http, _, _ = flagged
    free = plain(target, REPEATS, 24).output_ids
    penalized = plain(target, REPEATS, 24, repeat_penalty=1.3).output_ids
    assert free != penalized
    r = http.post("/completion", json={"model": "chain", "prompt": REPEATS, "n_predict": 24, "temperature": 0}).json()
    assert r["tokens"] == free
    own = http.post("/completion", json={"model": "chain", "prompt": REPEATS, "n_predict": 24, "temperature": 0,
                                         "samplers": ["penalties", "top_k", "temperature"]}).json()
    assert own["tokens"] == penalized


def test_props_shows_the_sampling_flags_as_llama_server_does(flagged, target):
    http, _, first = flagged
    eos = http.get("/props", params={"model": "eos"}).json()["default_generation_settings"]["params"]
    assert eos["ignore_eos"] is True
    assert {"bias": None, "token": first} in eos["logit_bias"]  # the ban, -inf shown as null
    assert {e["token"] for e in eos["logit_bias"]} == {first, *target.eog_ids()}  # --ignore-eos's bans among them
    chain = http.get("/props", params={"model": "chain"}).json()["default_generation_settings"]["params"]
    assert chain["samplers"] == ["top_k", "top_p", "min_p", "temperature"] and chain["repeat_penalty"] == 1.3
    assert chain["ignore_eos"] is False and chain["logit_bias"] == [] and eos["mirostat"] == 0
