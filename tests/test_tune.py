"""specstack tune writes a profile that generate applies; explicit flags still win."""

from __future__ import annotations

import json

import pytest

from specstack.cli import main
from specstack.errors import InvalidParameterError
from specstack.profile import load_profile


def test_tune_writes_a_profile_that_generate_uses(tmp_path, capsys):
    out = tmp_path / "p.toml"
    code = main(["tune", "--prompts", "1", "--sources", "prompt-lookup", "--policies", "fixed", "--k", "2,3", "-n", "12", "-o", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "prompt-lookup / fixed k=2" in table and "prompt-lookup / fixed k=3" in table
    settings = load_profile(out)
    assert settings["drafter"] == "prompt-lookup" and settings["k"] in (2, 3)
    main(["generate", "-p", "def f(x):\n", "-n", "8", "--json", "--profile", str(out)])
    data = json.loads(capsys.readouterr().out)
    assert data["drafter"] == "prompt-lookup" and data["k_policy"] == "fixed" and data["k"] == settings["k"]
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
    """Category names and drafter specs with quotes, backslashes or newlines survive a write and read."""
    from specstack.profile import load_profile, write_profile

    odd = 'code "with" \\\\ quotes\nand a newline'
    path = tmp_path / "p.toml"
    write_profile(path, {odd: {"drafter": 'cascade:suffix,"x"', "k_policy": "fixed", "k": 6}},
                  {"drafter": "prompt-lookup", "k_policy": "cost", "k": 4}, "a header")
    assert load_profile(path, odd) == {"drafter": 'cascade:suffix,"x"', "k_policy": "fixed", "k": 6}
