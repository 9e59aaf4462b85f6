"""Trained draft heads' GGUFs (EAGLE-3, DFlash: issue 59, docs/design-eagle3-dflash.md step 2), from metadata only:

- ``read_gguf`` reads what a head says of its target: target layers, target hidden size, block size, mask token,
  a reduced vocabulary (``d2t``), DSpark's Markov tensors;
- a head fits a target when the tokenizers compare equal, the hidden sizes match, every layer id is below the
  target's block count, the target's architecture exports layer inputs and (dflash) the mask token exists; each
  refusal is one line naming the mismatch and the fix;
- ``specstack check``, ``models scan`` and ``doctor`` report heads where they report MTP heads and draft models.

The heads are written here with the installed ``gguf`` package (it has no eagle3/dflash constants: the key names
are llama.cpp's, gguf-py/gguf/constants.py), the bundled target's tokenizer copied in, and a few tiny tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from specstack.cli import main
from specstack.host import doctor
from specstack.modelfile import archs
from specstack.modelfile import scan as models_scan
from specstack.modelfile.compat import HeadTarget, check_pair, head_problems
from specstack.modelfile.meta import read_gguf
from specstack.modelfile.standin.mtp import copy_tokenizer
from specstack.paths import DEFAULT_TARGET, MODELS_DIR

SPM = MODELS_DIR / "pycoder-1m-spm.gguf"  # another tokenizer (SentencePiece) of the same size


def write_gguf(path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, np.ndarray] | None = None,
               tokenizer: Path = DEFAULT_TARGET) -> Path:
    """A GGUF of ``arch`` with ``tokenizer``'s ``tokenizer.*`` keys, ``keys`` (ints as u32, lists as INT32 arrays,
    bools, floats) and ``tensors`` (default: one small ``fc.weight``, so it is not a vocabulary-only file)."""
    w = GGUFWriter(str(path), arch)
    copy_tokenizer(GGUFReader(str(tokenizer)), w)
    for key, value in keys.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    for name, data in (tensors if tensors is not None else {"fc.weight": np.zeros((4, 12), np.float32)}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def eagle3(path: Path, *, layers=(1, 3, 5), hidden: int | None = 256, n_embd: int = 256, d2t: bool = True,
           tokenizer: Path = DEFAULT_TARGET) -> Path:
    """An EAGLE-3 head for pycoder-6m as the design note's section 5 describes it (metadata and tiny tensors)."""
    keys: dict[str, Any] = {"eagle3.context_length": 512, "eagle3.embedding_length": n_embd, "eagle3.block_count": 1,
                            "eagle3.attention.layer_norm_rms_epsilon": 1e-5, "eagle3.target_layers": layers}
    if hidden is not None:
        keys["eagle3.target_hidden_size"] = hidden
    tensors = {"fc.weight": np.zeros((4, 12), np.float32)}
    if d2t:
        tensors["d2t"] = np.arange(8, dtype=np.int64)
    return write_gguf(path, "eagle3", keys, tensors, tokenizer)


def eagle3_weights(path: Path, *, layers=(1, 3, 5), seed: int = 0, n_draft_vocab: int | None = 512,
                   n_ff: int = 512, scale: float = 0.05) -> Path:
    """A runnable EAGLE-3 head for pycoder-6m with random weights: every tensor of the design note's eagle3 table
    at its shape (n_embd 256 = the target's, 1 layer, 8 query / 4 KV heads of 32, F16 matrices, F32 norms), its own
    ``output`` over ``n_draft_vocab`` ids with ``d2t`` (None: neither, the target's output borrowed), the target's
    token embeddings borrowed. numpy shapes are ggml's ``ne`` reversed (gguf-py writes them so)."""
    n_embd, n_vocab, n_head, n_kv, hd = 256, 4096, 8, 4, 32
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float16)

    keys: dict[str, Any] = {"eagle3.context_length": 512, "eagle3.embedding_length": n_embd, "eagle3.block_count": 1,
                            "eagle3.feed_forward_length": n_ff, "eagle3.attention.head_count": n_head,
                            "eagle3.attention.head_count_kv": n_kv, "eagle3.rope.freq_base": 10000.0,
                            "eagle3.rope.dimension_count": hd, "eagle3.attention.layer_norm_rms_epsilon": 1e-5,
                            "eagle3.target_layers": layers, "eagle3.target_hidden_size": n_embd}
    ones = np.ones(n_embd, np.float32)
    tensors = {"fc.weight": mat(n_embd, 3 * n_embd), "output_norm.weight": ones,
               "blk.0.attn_norm.weight": ones, "blk.0.attn_norm_2.weight": ones.copy(),
               "blk.0.attn_q.weight": mat(n_head * hd, 2 * n_embd), "blk.0.attn_k.weight": mat(n_kv * hd, 2 * n_embd),
               "blk.0.attn_v.weight": mat(n_kv * hd, 2 * n_embd), "blk.0.attn_output.weight": mat(n_embd, n_head * hd),
               "blk.0.ffn_norm.weight": ones.copy(), "blk.0.ffn_gate.weight": mat(n_ff, n_embd),
               "blk.0.ffn_up.weight": mat(n_ff, n_embd), "blk.0.ffn_down.weight": mat(n_embd, n_ff)}
    if n_draft_vocab is not None:
        tensors["output.weight"] = mat(n_draft_vocab, n_embd)
        tensors["d2t"] = np.sort(rng.choice(n_vocab, n_draft_vocab, replace=False)).astype(np.int64)
    return write_gguf(path, "eagle3", keys, tensors)


def dflash(path: Path, *, layers=(1, 3, 5), n_embd: int = 256, mask: int | None = 0, markov: bool = False) -> Path:
    keys: dict[str, Any] = {"dflash.context_length": 512, "dflash.embedding_length": n_embd, "dflash.block_count": 2,
                            "dflash.attention.layer_norm_rms_epsilon": 1e-5, "dflash.target_layers": layers,
                            "dflash.block_size": 8}
    if mask is not None:
        keys["tokenizer.ggml.mask_token_id"] = mask
    tensors = {"fc.weight": np.zeros((4, 12), np.float32)}
    if markov:
        tensors["markov_w1.weight"] = np.zeros((4, 2), np.float32)
    return write_gguf(path, "dflash", keys, tensors)


def gemma3_like(path: Path) -> Path:
    """A target whose architecture (gemma3) exports no layer inputs in this llama.cpp, with pycoder's tokenizer."""
    return write_gguf(path, "gemma3", {"gemma3.context_length": 512, "gemma3.embedding_length": 256,
                                       "gemma3.block_count": 6})


# --- the architecture tables --------------------------------------------------------------------------------------
def test_layer_input_archs():
    assert archs.exports_layer_inputs("llama") and archs.exports_layer_inputs("qwen3")
    assert not archs.exports_layer_inputs("gemma3") and not archs.exports_layer_inputs(None)
    assert archs.is_head("eagle3") and archs.is_head("dflash") and not archs.is_head("llama")
    assert not set(archs.HEAD_ARCHS) & set(archs.LAYER_INPUT_ARCHS)


# --- metadata -----------------------------------------------------------------------------------------------------
def test_meta_reads_an_eagle3_head(tmp_path):
    info = read_gguf(eagle3(tmp_path / "e.gguf"))
    assert info.is_head and info.architecture == "eagle3"
    assert info.target_layers == (1, 3, 5) and info.target_hidden_size == 256
    assert info.has_d2t and not info.is_dspark and info.block_size is None
    head = info.head
    assert head is not None and head.kind == "eagle3" and head.borrows_embeddings and head.borrows_output
    assert head.n_vocab == 4096 and head.n_embd == 256


def test_meta_reads_dflash_and_dspark_heads(tmp_path):
    info = read_gguf(dflash(tmp_path / "d.gguf"))
    assert info.head is not None and info.head.kind == "dflash"
    assert info.target_layers == (1, 3, 5) and info.block_size == 8 and info.mask_token_id == 0
    assert not info.has_d2t and not info.is_dspark
    spark = read_gguf(dflash(tmp_path / "s.gguf", markov=True))
    assert spark.is_dspark and spark.head is not None and spark.head.kind == "dspark"


def test_a_target_is_no_head():
    info = read_gguf(DEFAULT_TARGET)
    assert not info.is_head and info.head is None and info.target_layers == ()
    assert info.block_count == 6 and info.embedding_length == 256 and info.mask_token_id is None


# --- fit rules ----------------------------------------------------------------------------------------------------
def test_heads_fit_the_bundled_target(tmp_path):
    for path in (eagle3(tmp_path / "e.gguf"), dflash(tmp_path / "d.gguf"), dflash(tmp_path / "s.gguf", markov=True)):
        rep = check_pair(DEFAULT_TARGET, path)
        assert rep.head is not None and rep.head["fits"], rep.head
        assert rep.head["problems"] == [] and rep.exit_code == 0 and rep.ok


def _refusal(target: Path, head: Path) -> str:
    rep = check_pair(target, head)
    assert rep.head is not None and not rep.head["fits"] and rep.exit_code == 2 and not rep.ok
    assert len(rep.head["problems"]) == 1, rep.head["problems"]
    line = rep.head["problems"][0]
    assert "\n" not in line
    return line


def test_a_layer_past_the_target_is_refused(tmp_path):
    line = _refusal(DEFAULT_TARGET, eagle3(tmp_path / "e.gguf", layers=(2, 4, 6)))
    assert "reads target layer 6 but pycoder-6m.gguf has 6 layers (ids 0..5)" in line
    assert "use the target it was trained for" in line


def test_eagle3_needs_three_layers(tmp_path):
    assert "names 2 target layers; an eagle3 head reads exactly 3" in _refusal(
        DEFAULT_TARGET, eagle3(tmp_path / "e.gguf", layers=(1, 3)))


def test_hidden_size_mismatch_is_refused(tmp_path):
    line = _refusal(DEFAULT_TARGET, eagle3(tmp_path / "e.gguf", hidden=512))
    assert "trained on a target of hidden size 512, pycoder-6m.gguf's is 256" in line
    line = _refusal(DEFAULT_TARGET, dflash(tmp_path / "d.gguf", n_embd=128))
    assert "width 128 is not pycoder-6m.gguf's 256" in line


def test_a_head_borrowing_the_targets_output_runs_at_its_width(tmp_path):
    line = _refusal(DEFAULT_TARGET, eagle3(tmp_path / "e.gguf", n_embd=128))
    assert "borrows pycoder-6m.gguf's token embeddings and output but its width 128" in line


def test_missing_target_hidden_size_is_refused(tmp_path):
    assert "has no eagle3.target_hidden_size" in _refusal(DEFAULT_TARGET, eagle3(tmp_path / "e.gguf", hidden=None))


def test_dflash_without_a_mask_token_is_refused(tmp_path):
    line = _refusal(DEFAULT_TARGET, dflash(tmp_path / "d.gguf", mask=None))
    assert "has no tokenizer.ggml.mask_token_id" in line and "add the key" in line
    assert "outside pycoder-6m.gguf's 4096 tokens" in _refusal(DEFAULT_TARGET, dflash(tmp_path / "m.gguf", mask=5000))


def test_a_target_without_layer_inputs_is_refused(tmp_path):
    line = _refusal(gemma3_like(tmp_path / "g.gguf"), eagle3(tmp_path / "e.gguf"))
    assert "g.gguf is gemma3, whose graph in this llama.cpp exports no layer inputs" in line
    assert "--drafter mtp / draft-model" in line


def test_another_tokenizer_is_refused(tmp_path):
    line = _refusal(DEFAULT_TARGET, eagle3(tmp_path / "e.gguf", tokenizer=SPM))
    assert "e.gguf's tokenizer is not pycoder-6m.gguf's (translatable)" in line


def test_a_head_given_as_target_is_refused(tmp_path):
    head = eagle3(tmp_path / "e.gguf")
    assert "e.gguf is a eagle3 head, not a model to draft for: give it second" in _refusal(head, DEFAULT_TARGET)
    assert "is itself a eagle3 head" in _refusal(head, dflash(tmp_path / "d.gguf"))


def test_head_problems_lists_every_mismatch(tmp_path):
    head = read_gguf(eagle3(tmp_path / "e.gguf", layers=(1, 3, 9), hidden=512)).head
    assert head is not None
    target = HeadTarget("gemma.gguf", "gemma3", 256, 6, 4096)
    problems = head_problems(target, head, "e.gguf", "identical")
    assert len(problems) == 3 and all("\n" not in p for p in problems)


# --- check, models scan, doctor -----------------------------------------------------------------------------------
def test_cli_check_reports_a_head(tmp_path, capsys):
    head = eagle3(tmp_path / "e.gguf")
    assert main(["check", str(DEFAULT_TARGET), str(head)]) == 0
    out = capsys.readouterr().out
    assert "head: eagle3 head reading target layers 1, 3, 5, target hidden size 256" in out
    assert "head fit: it fits TARGET" in out
    bad = eagle3(tmp_path / "bad.gguf", layers=(2, 4, 6))
    assert main(["check", str(DEFAULT_TARGET), str(bad)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("verdict: identical vocabulary, but the head cannot draft for TARGET")
    assert "head fit: it cannot draft for TARGET:" in out and "reads target layer 6" in out
    assert main(["check", str(DEFAULT_TARGET), str(bad), "--json"]) == 2
    d = json.loads(capsys.readouterr().out)
    assert d["head"]["fits"] is False and d["head"]["target_layers"] == [2, 4, 6] and d["draft"]["head"] == "eagle3"


def test_cli_check_of_a_plain_pair_has_no_head(capsys):
    assert main(["check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["head"] is None


def test_models_scan_lists_heads_with_their_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(DEFAULT_TARGET, d / "target.gguf")
    eagle3(d / "head-eagle3.gguf")
    dflash(d / "head-dflash.gguf", mask=None)
    gemma3_like(d / "gemma.gguf")
    res = models_scan.scan([d])
    rows = {row["name"]: row for row in res.matrix}
    assert "head-eagle3.gguf" not in rows and "head-dflash.gguf" not in rows  # a head is no target
    heads = {h["name"]: h for h in rows["target.gguf"]["heads"]}
    assert heads["head-eagle3.gguf"]["fits"] and not heads["head-dflash.gguf"]["fits"]
    assert all(not h["fits"] for h in rows["gemma.gguf"]["heads"])
    assert not any(x["name"].startswith("head-") for row in res.matrix for x in row["drafts"])
    text = models_scan.render(res)
    assert "eagle3 head (layers 1,3,5)" in text
    assert "head-eagle3.gguf: fits: eagle3 head reading target layers 1, 3, 5" in text
    assert "head-dflash.gguf: does not fit" in text and "has no tokenizer.ggml.mask_token_id" in text
    again = models_scan.scan([d])  # from the cache: the same verdicts
    assert again.files_read == 0 and again.matrix == res.matrix


def test_doctor_says_what_a_head_is_and_whether_a_target_takes_one(tmp_path):
    checks = {c.name: c for c in doctor._model(_facts(), eagle3(tmp_path / "e.gguf"))}
    assert checks["head"].status == "warn" and "a draft head, not a model to generate with" in checks["head"].message
    assert "specstack check TARGET e.gguf" in (checks["head"].fix or "")
    checks = {c.name: c for c in doctor._model(_facts(), DEFAULT_TARGET)}
    assert "llama exports layer inputs" in checks["head"].message
    checks = {c.name: c for c in doctor._model(_facts(), gemma3_like(tmp_path / "g.gguf"))}
    assert "gemma3 exports no layer inputs in this llama.cpp" in checks["head"].message


def _facts() -> dict[str, Any]:
    return {"mem_available": 1 << 40, "mem_total": 1 << 40, "cgroup_memory_limit": None}
