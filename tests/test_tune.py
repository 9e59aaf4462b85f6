"""specstack tune writes a profile that generate applies; explicit flags still win."""

from __future__ import annotations

import json

import pytest

from specstack.cli import main
from specstack.errors import InvalidParameterError
from specstack.profiles import load_profile


def test_tune_writes_a_profile_that_generate_uses(tmp_path, capsys):
    out = tmp_path / "p.toml"
    code = main(["tune", "--prompts", "1", "--sources", "prompt-lookup", "--policies", "fixed", "--k", "2,3", "-n", "12", "-o", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "prompt-lookup / fixed k=2" in table and "prompt-lookup / fixed k=3" in table
    settings = load_profile(out)
    # the faster of plain decoding and the two settings as measured here (tune never writes one slower than plain):
    # which one wins is this machine's timing, what the profile then does is not
    assert settings["drafter"] in ("prompt-lookup", "none")
    main(["generate", "-p", "def f(x):\n", "-n", "8", "--json", "--profile", str(out)])
    data = json.loads(capsys.readouterr().out)
    assert data["drafter"] == settings["drafter"]
    if settings["drafter"] == "prompt-lookup":
        assert settings["k"] in (2, 3) and data["k_policy"] == "fixed" and data["k"] == settings["k"]
    else:
        assert "plain decoding is best here" in table
    main(["generate", "-p", "def f(x):\n", "-n", "8", "--json", "--profile", str(out), "--drafter", "none"])
    assert json.loads(capsys.readouterr().out)["drafter"] == "none"  # the explicit flag wins


def test_bad_profiles_are_reported(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[default\n")
    with pytest.raises(InvalidParameterError, match="not valid TOML"):
        load_profile(bad)
    with pytest.raises(InvalidParameterError, match="cannot read profile"):
        load_profile(tmp_path / "missing.toml")
    ok = tmp_path / "ok.toml"
    ok.write_text('[default]\ndrafter = "none"\n')
    with pytest.raises(InvalidParameterError, match="no category 'prose'"):
        load_profile(ok, "prose")


def test_profile_strings_are_escaped(tmp_path):
    """Category names and drafter specs with quotes, backslashes, newlines, DEL or non-BMP characters survive a write and read."""
    from specstack.profiles import load_profile, write_profile

    odd = 'code "with" \\\\ quotes\nand a newline, py\U0001f40d, \x7f and \u00e9'
    path = tmp_path / "p.toml"
    write_profile(path, {odd: {"drafter": 'cascade:suffix,"x"', "k_policy": "fixed", "k": 6}},
                  {"drafter": "prompt-lookup", "k_policy": "cost", "k": 4}, "a header")
    assert load_profile(path, odd) == {"drafter": 'cascade:suffix,"x"', "k_policy": "fixed", "k": 6}


def _row(method, k, cat, speedup):
    return {"method": method, "k": k, "category": cat, "speedup": speedup}


def test_choose_ranks_by_the_bench_speedup_per_category():
    from specstack.commands.tune import Setting, choose

    rows = [_row("none", 0, c, 1.0) for c in ("all", "a", "b")] + [
        _row("prompt-lookup", 2, "all", 1.5), _row("prompt-lookup", 2, "a", 2.0), _row("prompt-lookup", 2, "b", 1.1),
        _row("draft-model@cost", 16, "all", 1.4), _row("draft-model@cost", 16, "a", 1.2),
        _row("draft-model@cost", 16, "b", 1.7)]
    best, overall, text = choose(rows, ["a", "b"])
    assert best == {"a": Setting("prompt-lookup", "fixed", 2), "b": Setting("draft-model", "cost", None)}
    assert overall == Setting("prompt-lookup", "fixed", 2)
    lines = text.splitlines()
    assert lines[2].split() == ["a", "prompt-lookup", "/", "fixed", "k=2", "2.00x", "*"]
    assert lines[4].split() == ["a", "none", "(plain", "decoding)", "1.00x"]  # plain decoding is ranked too
    assert lines[5].split() == ["b", "draft-model", "/", "cost", "1.70x", "*"]


def test_choose_never_picks_a_setting_slower_than_plain_decoding():
    """Issue 55: tune wrote a setting measured at 0.98x plain as the best; plain decoding (1.00x, winning ties)
    is now a candidate of every category, and the profile it writes runs plain decoding."""
    from specstack.commands.tune import PLAIN_SETTING, Setting, choose, vars_of

    rows = [_row("none", 0, c, 1.0) for c in ("all", "a", "b")] + [
        _row("suffix@cost", 16, "all", 0.98), _row("suffix@cost", 16, "a", 0.97), _row("suffix@cost", 16, "b", 1.0),
        _row("prompt-lookup", 4, "all", 0.9), _row("prompt-lookup", 4, "a", 1.2), _row("prompt-lookup", 4, "b", 0.8)]
    best, overall, _ = choose(rows, ["a", "b"])
    assert overall == PLAIN_SETTING and best == {"a": Setting("prompt-lookup", "fixed", 4), "b": PLAIN_SETTING}
    assert vars_of(PLAIN_SETTING) == {"drafter": "none", "k_policy": "fixed"}


def test_choose_with_one_category_reads_the_all_rows():
    from specstack.commands.tune import Setting, choose

    rows = [_row("none", 0, "all", 1.0), _row("suffix", 4, "all", 1.3), _row("suffix", 8, "all", 1.6)]
    best, overall, _ = choose(rows, ["code"])
    assert best == {"code": Setting("suffix", "fixed", 8)} and overall == Setting("suffix", "fixed", 8)


def test_tune_samples_per_category_and_maps_policies_to_bench_methods():
    import argparse

    from specstack.bench.workloads import load
    from specstack.commands.tune import methods, sample

    wl = load("code-grounded")
    picked = sample(wl, 1, 7)
    assert [r.category for r in picked.requests] == wl.categories
    assert all(r.max_tokens == 7 for r in picked.requests)
    ns = argparse.Namespace(sources="prompt-lookup,suffix", policies="fixed,cost")
    assert methods(ns) == ["prompt-lookup", "prompt-lookup@cost", "suffix", "suffix@cost"]
    with pytest.raises(InvalidParameterError, match="unknown k policy 'nope'"):
        methods(argparse.Namespace(sources="suffix", policies="nope"))


def test_tune_weighs_mtp_by_default_on_a_model_with_a_nextn_head(tmp_path, capsys):
    """Without --sources, a model whose NextN head this llama.cpp drafts from gets mtp among the sources (as
    generate names it there); a model without one does not, and an mtp source on it is one line before any load."""
    import argparse

    from specstack.commands.tune import DEFAULT_SOURCES, sources_for
    from specstack.paths import DEFAULT_TARGET, MODELS_DIR

    mtp_model = MODELS_DIR / "pycoder-6m-mtp.gguf"
    assert sources_for(argparse.Namespace(sources=None, model=DEFAULT_TARGET)) == list(DEFAULT_SOURCES)
    assert sources_for(argparse.Namespace(sources=None, model=mtp_model)) == [*DEFAULT_SOURCES, "mtp"]
    code = main(["tune", "-m", str(mtp_model), "--prompts", "1", "--policies", "fixed", "--k", "2", "-n", "12",
                 "-t", "1", "--exact", "on", "-o", str(tmp_path / "p.toml")])
    assert code == 0
    table = capsys.readouterr().out
    assert all(f"{s} / fixed k=2" in table for s in ("prompt-lookup", "draft-model", "mtp")), table
    assert main(["tune", "--sources", "suffix,mtp", "-o", str(tmp_path / "q.toml")]) == 2
    err = capsys.readouterr().err
    assert "--sources mtp: pycoder-6m.gguf" in err and "NextN" in err and "loaded" not in err
