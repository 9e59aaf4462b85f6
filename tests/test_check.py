"""Vocabulary compatibility: specstack.modelfile.compat and `specstack check`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from specstack.modelfile.compat import check_pair, require_draftable
from specstack.cli import main
from specstack.errors import ModelLoadError
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VOCAB = SHARED / "vocab"
MODELS = SHARED / "models"
needs_shared = pytest.mark.skipif(not VOCAB.is_dir(), reason="../shared/vocab not present")


def v(name: str) -> Path:
    return VOCAB / f"ggml-vocab-{name}.gguf"


# --- real tokenizers ---------------------------------------------------------------------
def test_bundled_pair_identical():
    rep = check_pair(DEFAULT_TARGET, DEFAULT_DRAFT)
    assert rep.verdict == "identical"
    assert rep.n_differing == 0 and not rep.special_differences and rep.reasons == []
    assert rep.exit_code == 0


@needs_shared
@pytest.mark.parametrize("a,b", [("llama-spm", "phi-3"), ("phi-3", "llama-spm")])
def test_llama_spm_phi3_superset_compatible(a, b):
    rep = check_pair(v(a), v(b))
    assert rep.verdict == "compatible"
    assert rep.n_common == 32000 and rep.n_differing == 0
    assert rep.extra["count"] == 64 and rep.extra["side"] == ("draft" if b == "phi-3" else "target")
    assert "eos" in rep.special_differences
    text = rep.explain()
    assert "32000 tokens" in text and "32064 tokens" in text
    assert "special eos" in text and "'<|endoftext|>'" in text


@needs_shared
def test_neox_mpt_only_pre_label_differs():
    rep = check_pair(v("gpt-neox"), v("mpt"))
    assert rep.verdict == "compatible"
    assert rep.merges["identical"] and rep.n_differing == 0 and rep.extra is None
    assert len(rep.reasons) == 1 and "pre-tokenizer" in rep.reasons[0]


@needs_shared
@pytest.mark.parametrize("a,b,n_same", [
    ("gpt-2", "gpt-neox", 63), ("starcoder", "refact", 455), ("deepseek-coder", "deepseek-llm", 743),
])
def test_other_families_are_translatable(a, b, n_same):
    rep = check_pair(v(a), v(b))
    assert rep.verdict == "translatable" and rep.exit_code == 3
    assert 0 < rep.scores["text_overlap"] <= 1 and "translated" in rep.explain()
    assert rep.n_common - rep.n_differing == n_same          # README's "same position, same text" counts
    first = rep.first_differences[0]
    assert rep.explain().count(f"first differing id {first['id']}:") == 1


@needs_shared
def test_dbrx_vs_stablelm_translatable_with_reader_warning():
    rep = check_pair(v("dbrx"), v("stablelm"))
    assert rep.verdict == "translatable"
    assert rep.n_differing == 28 and rep.merges["identical"]
    assert any("general.file_type" in w for w in rep.target["warnings"])


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/models not present")
def test_spm_draft_is_translatable_for_the_bundled_target():
    rep = check_pair(DEFAULT_TARGET, MODELS / "pycoder-1m-spm.gguf")
    assert rep.verdict == "translatable"
    assert any("tokenizer models differ" in r for r in rep.reasons)
    assert 0.8 < rep.scores["text_overlap"] < 0.9  # measured: 82.5% of the target's tokens exist in the draft


@needs_shared
def test_same_big_file_identical():
    assert check_pair(v("deepseek-llm"), v("deepseek-llm")).verdict == "identical"


# --- the API the drafter uses ------------------------------------------------------------------
def test_require_draftable_returns_report():
    assert require_draftable(DEFAULT_TARGET, DEFAULT_DRAFT).verdict == "identical"


@needs_shared
def test_require_draftable_explains_a_translatable_pair():
    msg = require_draftable(v("gpt-2"), v("gpt-neox")).explain() + "\nrun `specstack check TARGET DRAFT` for the full report"
    assert "50257 tokens" in msg and "50432 tokens" in msg
    assert "first differing id 0: target '!' vs draft '<|endoftext|>'" in msg
    assert "special bos: target 50256" in msg
    assert msg.rstrip().endswith("run `specstack check TARGET DRAFT` for the full report")


@needs_shared
def test_require_draftable_accepts_compatible():
    assert require_draftable(v("phi-3"), v("llama-spm")).verdict == "compatible"


def test_report_to_dict_is_json():
    d = check_pair(DEFAULT_TARGET, DEFAULT_DRAFT).to_dict()
    assert json.loads(json.dumps(d))["verdict"] == "identical"
    assert d["target"]["n_vocab"] == 4096


def test_bad_files_raise_model_load_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello world")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        check_pair(DEFAULT_TARGET, junk)
    with pytest.raises(ModelLoadError, match="no such file"):
        check_pair(tmp_path / "missing.gguf", DEFAULT_DRAFT)


# --- synthetic vocabularies for the rules ----------------------------------------------------------
def _s(b: str) -> bytes:
    e = b.encode()
    return struct.pack("<Q", len(e)) + e


def _gguf(path: Path, tokens, types=None, merges=None, pre="gpt-2", bos=0, eos=0, model="gpt2"):
    kvs = [_s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
           _s("tokenizer.ggml.model") + struct.pack("<I", 8) + _s(model),
           _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(tokens)) + b"".join(_s(t) for t in tokens),
           _s("tokenizer.ggml.bos_token_id") + struct.pack("<II", 4, bos),
           _s("tokenizer.ggml.eos_token_id") + struct.pack("<II", 4, eos)]
    if pre is not None:
        kvs.append(_s("tokenizer.ggml.pre") + struct.pack("<I", 8) + _s(pre))
    if types is not None:
        kvs.append(_s("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, len(types))
                   + struct.pack(f"<{len(types)}i", *types))
    if merges is not None:
        kvs.append(_s("tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, len(merges))
                   + b"".join(_s(m) for m in merges))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    return path


BASE = ["<eos>", "a", "b", "ab"]


def test_extra_ordinary_tokens_are_translatable(tmp_path):
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"])
    d = _gguf(tmp_path / "d.gguf", BASE + ["ba"], [3, 1, 1, 1, 1], ["a b", "b a"])
    rep = check_pair(t, d)
    assert rep.verdict == "translatable"
    assert rep.extra["ordinary"] == 1


def test_extra_control_tokens_are_compatible(tmp_path):
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"])
    d = _gguf(tmp_path / "d.gguf", BASE + ["<pad>"], [3, 1, 1, 1, 3], ["a b"])
    rep = check_pair(t, d)
    assert rep.verdict == "compatible"
    assert any("mask draft ids >= 4" in n for n in rep.notes)


def test_different_merges_same_tokens_translatable(tmp_path):
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"])
    d = _gguf(tmp_path / "d.gguf", BASE, [3, 1, 1, 1], ["b a"])
    rep = check_pair(t, d)
    assert rep.verdict == "translatable"
    assert rep.merges["first_difference"]["index"] == 0


def test_special_token_difference_only_is_compatible(tmp_path):
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"], eos=0)
    d = _gguf(tmp_path / "d.gguf", BASE, [3, 1, 1, 1], ["a b"], eos=3)
    rep = check_pair(t, d)
    assert rep.verdict == "compatible"
    assert rep.special_differences["eos"] == {"target": 0, "draft": 3, "target_text": "<eos>", "draft_text": "ab"}


def test_same_size_one_token_differs(tmp_path):
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"])
    d = _gguf(tmp_path / "d.gguf", ["<eos>", "a", "c", "ab"], [3, 1, 1, 1], ["a b"])
    rep = check_pair(t, d)
    assert rep.verdict == "translatable"
    assert rep.first_differences == [{"id": 2, "target": "b", "draft": "c"}]
    assert "first differing id 2: target 'b' vs draft 'c'" in rep.explain()


def test_no_vocabulary_is_incompatible(tmp_path):
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"])
    empty = tmp_path / "novocab.gguf"
    empty.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    assert check_pair(t, empty).verdict == "incompatible"


# --- the CLI -----------------------------------------------------------------------------------------
def test_cli_defaults_identical(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict: identical")


@needs_shared
@pytest.mark.parametrize("a,b,code", [
    ("llama-spm", "phi-3", 1), ("gpt-neox", "mpt", 1), ("gpt-2", "gpt-neox", 3), ("dbrx", "stablelm", 3),
])
def test_cli_exit_codes(capsys, a, b, code):
    assert main(["check", str(v(a)), str(v(b))]) == code
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    assert cap.out.startswith("verdict: " + ("compatible" if code == 1 else "translatable"))


@needs_shared
def test_cli_json(capsys):
    assert main(["check", str(v("llama-spm")), str(v("phi-3")), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "compatible" and d["exit_code"] == 1
    assert d["special_differences"]["eos"]["draft"] == 32000
    assert d["extra"]["count"] == 64


@pytest.mark.parametrize("kind", ["missing", "text", "truncated", "folder"])
def test_cli_bad_input_one_line_no_traceback(tmp_path, capsys, kind):
    p = tmp_path / "bad.gguf"
    if kind == "text":
        p.write_text("import os\n")
    elif kind == "truncated":
        p.write_bytes(Path(DEFAULT_TARGET).read_bytes()[:3000])
    elif kind == "folder":
        p.mkdir()
    assert main(["check", str(DEFAULT_TARGET), str(p)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("specstack check: error: ") and err.count("\n") == 1
    assert str(p) in err


@needs_shared
def test_cli_dbrx_readable(capsys):
    assert main(["check", str(v("dbrx")), str(v("dbrx"))]) == 0
    out = capsys.readouterr().out
    assert "duplicate metadata key 'general.file_type'" in out


def test_extra_user_defined_tokens_count_as_reachable(tmp_path):
    # llama.cpp matches user-defined tokens (e.g. gpt-neox's runs of spaces) in plain text
    t = _gguf(tmp_path / "t.gguf", BASE, [3, 1, 1, 1], ["a b"])
    d = _gguf(tmp_path / "d.gguf", BASE + ["    "], [3, 1, 1, 1, 4], ["a b"])
    rep = check_pair(t, d)
    assert rep.verdict == "translatable" and rep.extra["ordinary"] == 1
