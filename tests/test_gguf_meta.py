"""The tolerant GGUF metadata reader (specstack.modelfile.read, interpreted by gguf_meta)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from specstack.errors import ModelLoadError
from specstack.modelfile.meta import read_gguf
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VOCAB = SHARED / "vocab"
MODELS = SHARED / "models"
needs_shared = pytest.mark.skipif(not VOCAB.is_dir(), reason="../shared/vocab not present")


# --- a minimal GGUF writer for hand-made files ---------------------------------------
def _s(b: str | bytes, e: str = "<") -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack(e + "Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes, e: str = "<") -> bytes:
    return _s(key, e) + struct.pack(e + "I", vtype) + payload


def make_gguf(kvs: list[bytes], *, version: int = 3, n_tensors: int = 0, tensors: bytes = b"",
              e: str = "<", magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack(e + "IQQ", version, n_tensors, len(kvs)) + b"".join(kvs) + tensors


def str_kv(key, val, e="<"):
    return _kv(key, 8, _s(val, e), e)


def u32_kv(key, val, e="<"):
    return _kv(key, 4, struct.pack(e + "I", val), e)


def str_array_kv(key, vals, e="<"):
    return _kv(key, 9, struct.pack(e + "IQ", 8, len(vals)) + b"".join(_s(v, e) for v in vals), e)


# --- real files ------------------------------------------------------------------------
def test_bundled_target_metadata_and_params():
    info = read_gguf(DEFAULT_TARGET)
    assert info.version == 3
    assert info.architecture == "llama"
    assert info.tokenizer_model == "gpt2" and info.pre == "gpt-2"
    assert info.n_vocab == 4096 and info.tokens[0] == "<|endoftext|>"
    assert info.bos_id == 0 and info.eos_id == 0 and info.add_bos is True
    assert info.context_length == 512
    assert info.file_type_name == "F16"
    assert 5_700_000 < info.n_params < 5_850_000          # README: 5.77M
    assert info.tensor_bytes <= info.file_size
    assert info.tensor_bytes > 0.9 * info.file_size      # F16 weights are most of the file
    assert len(info.merges) > 1000
    assert info.token_types is not None and len(info.token_types) == 4096
    assert info.is_recurrent is False and info.is_hybrid is False
    assert info.expert_count is None
    assert info.warnings == []


def test_fingerprint_same_for_shared_tokenizer_and_differs_otherwise():
    a, b = read_gguf(DEFAULT_TARGET), read_gguf(DEFAULT_DRAFT)
    assert a.vocab_fingerprint == b.vocab_fingerprint
    assert len(a.vocab_fingerprint) == 64
    assert a.n_params > 5 * b.n_params


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/models not present")
def test_moe_expert_counts_and_spm_draft():
    moe = read_gguf(MODELS / "pycoder-moe.gguf")
    assert (moe.expert_count, moe.expert_used_count) == (8, 2)
    spm = read_gguf(MODELS / "pycoder-1m-spm.gguf")
    assert spm.tokenizer_model == "llama" and spm.n_vocab == 4000
    assert spm.vocab_fingerprint != read_gguf(DEFAULT_TARGET).vocab_fingerprint


@needs_shared
@pytest.mark.parametrize("name,n_vocab,bos,eos", [
    ("llama-spm", 32000, 1, 2), ("phi-3", 32064, 1, 32000), ("gpt-2", 50257, 50256, 50256),
    ("deepseek-llm", 102400, 100000, 100001), ("stablelm", 100352, 100257, 100257),
])
def test_vocab_files_match_readme(name, n_vocab, bos, eos):
    info = read_gguf(VOCAB / f"ggml-vocab-{name}.gguf")
    assert (info.n_vocab, info.bos_id, info.eos_id) == (n_vocab, bos, eos)
    assert info.tensor_count == 0 and info.n_params == 0


@needs_shared
def test_agrees_with_gguf_package():
    gguf = pytest.importorskip("gguf")
    path = VOCAB / "ggml-vocab-phi-3.gguf"
    ref = gguf.GGUFReader(str(path))
    mine = read_gguf(path)
    assert {k for k in ref.fields if not k.startswith("GGUF.")} == set(mine.metadata)
    tok_field = ref.fields["tokenizer.ggml.tokens"]
    ref_tokens = [bytes(tok_field.parts[i]).decode("utf-8") for i in tok_field.data]
    assert ref_tokens == mine.tokens
    sc_field = ref.fields["tokenizer.ggml.scores"]
    ref_scores = np.array([sc_field.parts[i][0] for i in sc_field.data])
    assert np.array_equal(ref_scores, mine.scores)
    assert int(ref.fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == mine.eos_id


@needs_shared
def test_dbrx_duplicate_key_is_tolerated_with_warning():
    info = read_gguf(VOCAB / "ggml-vocab-dbrx.gguf")
    assert info.n_vocab == 100352
    assert (info.expert_count, info.expert_used_count) == (16, 4)
    assert any("general.file_type" in w and "duplicate" in w for w in info.warnings)


# --- bad input ---------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        read_gguf(tmp_path / "nope.gguf")


def test_text_file_named_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("import this\n")
    with pytest.raises(ModelLoadError, match=r"not a GGUF file \(magic b'impo'"):
        read_gguf(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        read_gguf(p)


@pytest.mark.parametrize("n_bytes", [6, 20, 30, 300, 5000, 40000])
def test_truncated_metadata(tmp_path, n_bytes):
    p = tmp_path / "cut.gguf"
    p.write_bytes(Path(DEFAULT_TARGET).read_bytes()[:n_bytes])
    with pytest.raises(ModelLoadError, match="truncated") as exc:
        read_gguf(p)
    assert str(p) in str(exc.value)
    assert "re-download" in str(exc.value)


@needs_shared
def test_vocab_cut_inside_the_token_array(tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes((VOCAB / "ggml-vocab-gpt-2.gguf").read_bytes()[:50000])
    with pytest.raises(ModelLoadError, match=r"truncated while reading key #\d+ \('tokenizer.ggml.tokens'\)"):
        read_gguf(p)


def test_truncated_names_the_key(tmp_path):
    data = make_gguf([str_kv("general.architecture", "llama"),
                      str_array_kv("tokenizer.ggml.tokens", ["a", "b", "c"])])
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:-2])
    with pytest.raises(ModelLoadError, match=r"key #1 \('tokenizer.ggml.tokens'\)"):
        read_gguf(p)


def test_truncated_tensor_data_is_a_warning(tmp_path):
    p = tmp_path / "short.gguf"
    p.write_bytes(Path(DEFAULT_DRAFT).read_bytes()[:-1000])
    info = read_gguf(p)
    assert info.n_vocab == 4096
    assert any("tensor data is truncated" in w for w in info.warnings)


def test_garbage_after_magic(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**60) + b"x" * 100)
    with pytest.raises(ModelLoadError, match="malformed metadata at key #0"):
        read_gguf(p)


def test_unknown_value_type(tmp_path):
    p = tmp_path / "badtype.gguf"
    p.write_bytes(make_gguf([_kv("general.thing", 77, b"\0" * 8)]))
    with pytest.raises(ModelLoadError, match="unknown value type 77"):
        read_gguf(p)


def test_absurd_counts_in_header(tmp_path):
    p = tmp_path / "huge.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40))
    with pytest.raises(ModelLoadError, match="malformed header"):
        read_gguf(p)


def test_unsupported_version(tmp_path):
    p = tmp_path / "v9.gguf"
    p.write_bytes(make_gguf([], version=9))
    with pytest.raises(ModelLoadError, match="unsupported GGUF version 9"):
        read_gguf(p)


# --- hand-made files ---------------------------------------------------------------------
def test_duplicate_key_last_wins(tmp_path):
    p = tmp_path / "dup.gguf"
    p.write_bytes(make_gguf([u32_kv("general.file_type", 1), str_kv("general.architecture", "mamba"),
                             u32_kv("general.file_type", 15)]))
    info = read_gguf(p)
    assert info.file_type == 15 and info.file_type_name == "Q4_K_M"
    assert len(info.warnings) == 1 and "general.file_type" in info.warnings[0]
    assert info.is_recurrent and not info.is_hybrid


@pytest.mark.parametrize("arch,recurrent,hybrid", [
    ("rwkv7", True, False), ("mamba2", True, False), ("jamba", False, True),
    ("qwen3next", False, True), ("nemotron_h", False, True), ("llama", False, False),
])
def test_recurrent_and_hybrid_guess(tmp_path, arch, recurrent, hybrid):
    p = tmp_path / "a.gguf"
    p.write_bytes(make_gguf([str_kv("general.architecture", arch)]))
    info = read_gguf(p)
    assert (info.is_recurrent, info.is_hybrid) == (recurrent, hybrid)


def test_big_endian_and_all_scalar_types(tmp_path):
    e = ">"
    kvs = [
        str_kv("general.architecture", "llama", e),
        _kv("a.u8", 0, struct.pack(e + "B", 200), e), _kv("a.i8", 1, struct.pack(e + "b", -3), e),
        _kv("a.u16", 2, struct.pack(e + "H", 60000), e), _kv("a.i16", 3, struct.pack(e + "h", -2), e),
        u32_kv("llama.context_length", 4096, e), _kv("a.i32", 5, struct.pack(e + "i", -7), e),
        _kv("a.f32", 6, struct.pack(e + "f", 0.5), e), _kv("a.bool", 7, struct.pack(e + "?", True), e),
        _kv("a.u64", 10, struct.pack(e + "Q", 2**40), e), _kv("a.i64", 11, struct.pack(e + "q", -2**40), e),
        _kv("a.f64", 12, struct.pack(e + "d", 1.25), e),
        _kv("a.ints", 9, struct.pack(e + "IQ", 5, 3) + struct.pack(e + "3i", 1, -2, 3), e),
        _kv("a.nested", 9, struct.pack(e + "IQ", 9, 2)
            + struct.pack(e + "IQ", 8, 1) + _s("x", e) + struct.pack(e + "IQ", 4, 1) + struct.pack(e + "I", 9), e),
        str_array_kv("tokenizer.ggml.tokens", ["<s>", "héllo", ""], e),
    ]
    p = tmp_path / "be.gguf"
    p.write_bytes(make_gguf(kvs, e=e))
    info = read_gguf(p)
    m = info.metadata
    assert info.byte_order == "big"
    assert (m["a.u8"], m["a.i8"], m["a.u16"], m["a.i16"], m["a.i32"]) == (200, -3, 60000, -2, -7)
    assert (m["a.f32"], m["a.bool"], m["a.u64"], m["a.i64"], m["a.f64"]) == (0.5, True, 2**40, -2**40, 1.25)
    assert m["a.ints"].tolist() == [1, -2, 3]
    assert m["a.nested"][0] == ["x"] and m["a.nested"][1].tolist() == [9]
    assert info.context_length == 4096
    assert info.tokens == ["<s>", "héllo", ""]


def test_tensor_infos_counted_not_read(tmp_path):
    # two tensors: F32 [4, 3] and Q8_0 [64]; the data section is left out entirely
    t = (_s("a.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 4, 3) + struct.pack("<IQ", 0, 0)
         + _s("b.weight") + struct.pack("<I", 1) + struct.pack("<Q", 64) + struct.pack("<IQ", 8, 64))
    p = tmp_path / "t.gguf"
    p.write_bytes(make_gguf([str_kv("general.architecture", "llama")], n_tensors=2, tensors=t))
    info = read_gguf(p)
    assert info.tensor_count == 2
    assert info.n_params == 12 + 64
    assert info.tensor_bytes == 48 + 2 * 34
    assert info.file_type_name == "F32 (guessed)"   # the only 2-D tensor decides
    assert any("truncated" in w for w in info.warnings)


@needs_shared
def test_large_vocab_is_complete():
    info = read_gguf(VOCAB / "ggml-vocab-deepseek-llm.gguf")
    assert info.n_vocab == 102400 == len(info.token_types)
    assert len(info.merges) == 99757


def test_fingerprint_from_raw_bytes_equals_recomputed():
    info = read_gguf(DEFAULT_TARGET)
    fp = info.vocab_fingerprint
    raw = info.raw_arrays["tokenizer.ggml.tokens"]
    again = read_gguf(DEFAULT_TARGET)
    again.raw_arrays.clear()                       # forces the slow path (as for big-endian files)
    assert again.string_array_bytes("tokenizer.ggml.tokens") == raw
    assert again.vocab_fingerprint == fp


def test_big_endian_fingerprint_matches_little_endian(tmp_path):
    toks = ["<s>", "a", "é"]
    for e, name in (("<", "le.gguf"), (">", "be.gguf")):
        (tmp_path / name).write_bytes(make_gguf([str_array_kv("tokenizer.ggml.tokens", toks, e),
                                                 u32_kv("tokenizer.ggml.bos_token_id", 0, e)], e=e))
    le, be = read_gguf(tmp_path / "le.gguf"), read_gguf(tmp_path / "be.gguf")
    assert "tokenizer.ggml.tokens" in le.raw_arrays and not be.raw_arrays
    assert le.vocab_fingerprint == be.vocab_fingerprint


# --- a truncated file that llama.cpp still loads -------------------------------------------
def _rewrite(src: Path, out: Path, alignment: int, last: str) -> None:
    """Copy a GGUF (with gguf-py) at another data alignment, with tensor ``last`` moved to the end."""
    import gguf
    from gguf import GGUFValueType as VT

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    writer.add_custom_alignment(alignment)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.alignment"):
            continue
        vtype, sub = f.types[0], f.types[-1]
        if vtype == VT.ARRAY:
            value = [bytes(f.parts[i]) for i in f.data] if sub == VT.STRING else f.contents()
            writer.add_key_value(f.name, value, vtype, sub_type=sub)
        else:
            writer.add_key_value(f.name, bytes(f.parts[-1]) if vtype == VT.STRING else f.contents(), vtype)
    for t in sorted(reader.tensors, key=lambda t: t.name == last):
        writer.add_tensor(t.name, np.array(t.data), raw_shape=tuple(int(d) for d in reversed(t.shape)),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def padded_draft(tmp_path_factory) -> Path:
    """The bundled draft model ending in 512 bytes of padding, the bytes a truncation can lose unnoticed.

    GGUF pads each tensor's data to the alignment, the last one included, but llama.cpp checks only
    that every tensor's own bytes are in the file.  The bundled files have no trailing padding (their
    tensors are multiples of 32 bytes), so this copy uses a 1 KiB alignment and puts a 512-byte
    tensor (output_norm.weight, 128 floats) last.
    """
    out = tmp_path_factory.mktemp("padded") / "padded.gguf"
    _rewrite(Path(DEFAULT_DRAFT), out, 1024, "output_norm.weight")
    return out


def _cut(src: Path, tmp_path: Path, n_bytes: int) -> Path:
    p = tmp_path / f"cut{n_bytes}.gguf"
    p.write_bytes(src.read_bytes()[:-n_bytes])
    return p


def _generate(capsys, model: Path) -> tuple[int, str, str]:
    from specstack.cli import main

    code = main(["generate", "-m", str(model), "-p", "def add(a, b):", "-n", "12", "--json", "--k-policy", "fixed"])
    out, err = capsys.readouterr()
    return code, out, err


def test_padding_cut_from_the_end_reads_and_runs_like_the_whole_file(capsys, tmp_path, padded_draft):
    whole = read_gguf(padded_draft)
    assert [(t.name, t.shape) for t in sorted(whole.tensors, key=lambda t: t.name)] == \
        [(t.name, t.shape) for t in sorted(read_gguf(DEFAULT_DRAFT).tensors, key=lambda t: t.name)]
    cut = read_gguf(_cut(padded_draft, tmp_path, 512))
    assert cut.warnings == [] and cut.file_size == whole.file_size - 512
    assert (cut.n_params, cut.tensor_bytes, cut.vocab_fingerprint) == (whole.n_params, whole.tensor_bytes, whole.vocab_fingerprint)
    code_whole, out_whole, _ = _generate(capsys, padded_draft)
    code_cut, out_cut, err = _generate(capsys, tmp_path / "cut512.gguf")  # llama.cpp loads it, and so does specstack
    assert code_whole == code_cut == 0 and "Traceback" not in err
    assert json.loads(out_cut)["text"] == json.loads(out_whole)["text"]


def test_one_byte_into_the_last_tensor_is_refused_clearly(capsys, tmp_path, padded_draft):
    p = _cut(padded_draft, tmp_path, 513)
    assert any("tensor data is truncated" in w for w in read_gguf(p).warnings)
    code, out, err = _generate(capsys, p)
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"could not load target {p}" in err and "not within the file bounds" in err
