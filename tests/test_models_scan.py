"""`specstack models scan`: inventory, draft matrix, junk handling and the cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from specstack.modelfile import scan as models_scan
from specstack.cli import main
from specstack.errors import ModelLoadError
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VOCAB = SHARED / "vocab"
MODELS = SHARED / "models"


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(d))
    return d


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "models"
    (d / "sub").mkdir(parents=True)
    shutil.copy(DEFAULT_TARGET, d / "target.gguf")
    shutil.copy(DEFAULT_DRAFT, d / "sub" / "draft.gguf")
    if VOCAB.is_dir():
        for name in ("gpt-2", "phi-3"):
            shutil.copy(VOCAB / f"ggml-vocab-{name}.gguf", d)
    if MODELS.is_dir():
        shutil.copy(MODELS / "pycoder-1m-spm.gguf", d)
        shutil.copy(MODELS / "pycoder-moe.gguf", d)
    (d / "junk.gguf").write_text("import os\nprint('not a model')\n")
    (d / "notes.txt").write_text("ignored: not .gguf")
    return d


def _by_name(res):
    return {Path(e["path"]).name: e for e in res.entries}


def test_inventory_matrix_and_junk(folder, cache_env):
    res = models_scan.scan([folder])
    names = _by_name(res)
    assert "notes.txt" not in names
    assert names["junk.gguf"]["status"] == "error"
    assert "not a GGUF file" in names["junk.gguf"]["error"]
    t = names["target.gguf"]
    assert t["status"] == "ok" and t["architecture"] == "llama" and t["file_type"] == "F16"
    assert 5_700_000 < t["n_params"] < 5_850_000 and t["context_length"] == 512
    assert t["vocab_fingerprint"] == names["draft.gguf"]["vocab_fingerprint"]
    assert t["recurrence"] == "none" and t["expert_count"] is None

    rows = {Path(r["target"]).name: r for r in res.matrix}
    drafts = [d["name"] for d in rows["target.gguf"]["drafts"]]
    assert "draft.gguf" in drafts
    assert rows["target.gguf"]["drafts"][0]["name"] == "draft.gguf"     # largest ratio first
    ratios = [d["size_ratio"] for d in rows["target.gguf"]["drafts"]]
    assert ratios == sorted(ratios, reverse=True)
    assert rows["target.gguf"]["drafts"][0]["verdict"] == "identical"
    assert rows["draft.gguf"]["drafts"] == []
    if MODELS.is_dir():
        assert "pycoder-1m-spm.gguf" not in drafts                    # other tokenizer
        moe = names["pycoder-moe.gguf"]
        assert (moe["expert_count"], moe["expert_used_count"]) == (8, 2)
        assert moe["n_active_params"] < moe["n_params"]
    if VOCAB.is_dir():
        assert names["ggml-vocab-phi-3.gguf"]["vocab_only"]
        assert "ggml-vocab-phi-3.gguf" not in rows                    # no weights, no matrix row


def test_second_scan_is_served_from_cache(folder, cache_env, monkeypatch):
    first = models_scan.scan([folder])
    n = len(first.entries)
    assert first.files_read == n and first.cache_hits == 0
    assert (cache_env / models_scan.CACHE_NAME).is_file()

    def boom(*a, **k):
        raise AssertionError("read_gguf called on a cached scan")

    monkeypatch.setattr(models_scan, "read_gguf", boom)
    second = models_scan.scan([folder])
    assert second.files_read == 0 and second.cache_hits == n
    assert second.matrix == first.matrix
    assert [e["path"] for e in second.entries] == [e["path"] for e in first.entries]


def test_changed_file_is_read_again(folder, cache_env):
    models_scan.scan([folder])
    target = folder / "target.gguf"
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    res = models_scan.scan([folder])
    assert res.files_read == 1


def test_no_cache_reads_everything(folder, cache_env):
    models_scan.scan([folder])
    res = models_scan.scan([folder], use_cache=False)
    assert res.cache_hits == 0 and res.files_read == len(res.entries)


def test_corrupt_cache_is_ignored(folder, cache_env):
    cache_env.mkdir(parents=True)
    (cache_env / models_scan.CACHE_NAME).write_text("{not json")
    res = models_scan.scan([folder])
    assert res.files_read == len(res.entries)
    assert json.loads((cache_env / models_scan.CACHE_NAME).read_text())["version"] == models_scan.CACHE_VERSION


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECSTACK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models_scan.cache_dir() == tmp_path / "xdg" / "specstack"
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path / "mine"))
    assert models_scan.cache_dir() == tmp_path / "mine"


def test_missing_folder_is_an_error(tmp_path, cache_env):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        models_scan.scan([tmp_path / "nope"])


@pytest.mark.skipif(not VOCAB.is_dir(), reason="../shared/vocab not present")
def test_superset_pair_needs_a_real_compare_then_is_cached(tmp_path, cache_env, monkeypatch):
    # two vocab-only files never enter the matrix; give the compare path a direct test instead
    res = models_scan.ScanResult(entries=[], matrix=[], cache_path=None)
    cache = {"version": 1, "files": {}, "pairs": {}}
    import os as _os
    a, _ = models_scan._entry(VOCAB / "ggml-vocab-phi-3.gguf", _os.stat(VOCAB / "ggml-vocab-phi-3.gguf"))
    b, _ = models_scan._entry(VOCAB / "ggml-vocab-llama-spm.gguf", _os.stat(VOCAB / "ggml-vocab-llama-spm.gguf"))
    v, changed = models_scan._pair_verdict(a, b, cache, {}, res)
    assert v["verdict"] == "compatible" and changed and res.pairs_compared == 1
    v2, changed2 = models_scan._pair_verdict(a, b, cache, {}, res)
    assert v2 == v and not changed2 and res.pair_cache_hits == 1


def test_cli_table_and_json(folder, cache_env, capsys):
    assert main(["models", "scan", str(folder)]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    assert "target.gguf" in cap.out and "draft matrix" in cap.out
    assert "unreadable files (1, skipped)" in cap.out and "junk.gguf" in cap.out
    assert main(["models", "scan", str(folder), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cache"]["files_read"] == 0 and d["cache"]["file_hits"] == len(d["files"])
    assert [e["path"] for e in d["errors"]] == [str((folder / "junk.gguf").resolve())]
    row = next(r for r in d["draft_matrix"] if r["name"] == "target.gguf")
    assert row["drafts"][0]["name"] == "draft.gguf"


def test_cli_progress_for_many_files(tmp_path, cache_env, capsys, monkeypatch):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(25):
        (d / f"junk{i:02}.gguf").write_bytes(b"GGUF" + bytes(3))
    assert main(["models", "scan", str(d)]) == 1  # nothing readable: exit 1 (issue 22, item 14)
    cap = capsys.readouterr()
    assert "scanning 1/25" in cap.err and "scanning 25/25" in cap.err
    assert "unreadable files (25, skipped)" in cap.out


def test_cli_missing_folder(tmp_path, cache_env, capsys):
    assert main(["models", "scan", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no such file or folder" in err


def test_deleted_files_leave_the_cache(folder, cache_env):
    models_scan.scan([folder])
    (folder / "junk.gguf").unlink()
    shutil.copy(DEFAULT_DRAFT, folder / "draft2.gguf")             # something new, so the cache is rewritten
    res = models_scan.scan([folder])
    assert res.files_read == 1
    cached = json.loads((cache_env / models_scan.CACHE_NAME).read_text())["files"]
    assert str((folder / "junk.gguf").resolve()) not in cached
    assert str((folder / "draft2.gguf").resolve()) in cached
