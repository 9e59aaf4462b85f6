"""The suffix cache file (--suffix-cache): refused for another vocabulary, never half-written."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specstack.retrieval import suffix_tree_file
from specstack.drafters.base import BuildContext, create
from specstack.drafters.suffix import SuffixConfig, SuffixDrafter, target_vocab
from specstack.errors import VocabMismatchError
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET
from specstack.retrieval.suffix_tree import SuffixTree
from specstack.retrieval.suffix_tree_file import Vocab

A = Vocab("a" * 64, 4096)
B = Vocab("b" * 64, 4096)  # same size, other tokens: only the fingerprint tells them apart


def tree(*seqs: list[int]) -> SuffixTree:
    t = SuffixTree(8)
    for i, s in enumerate(seqs):
        t.extend(i, s)
        t.close(i)
    return t


def test_cache_from_another_vocabulary_is_refused(tmp_path):
    # Same n_vocab, other fingerprint: the ids would mean other text, so the load stops and says how to fix it.
    path = tmp_path / "suffix.npz"
    tree([1, 2, 3]).save(path, A)
    with pytest.raises(VocabMismatchError, match=r"suffix\.npz.*another model's vocabulary.*delete"):
        SuffixTree.load(path, vocab=B)
    assert SuffixTree.load(path, vocab=A).structure() == tree([1, 2, 3]).structure()


def test_cache_for_another_vocabulary_size_is_refused(tmp_path):
    # Without fingerprints (a target with no GGUF path), n_vocab decides.
    path = tmp_path / "suffix.npz"
    tree([1, 2, 3]).save(path, Vocab(None, 4096))
    with pytest.raises(VocabMismatchError, match="4096 tokens.*32000.*delete"):
        SuffixTree.load(path, vocab=Vocab(None, 32000))
    SuffixTree.load(path, vocab=Vocab(None, 4096))


def test_drafter_built_for_a_target_refuses_another_targets_cache(tmp_path):
    # Through the registry, as --suffix-cache does: the drafter records the target's vocabulary.
    path = str(tmp_path / "suffix.npz")
    real = SimpleNamespace(path=DEFAULT_TARGET, n_vocab=4096)
    d = create("suffix", BuildContext(target=real, options={"cache_path": path}))
    d.begin([5, 6])
    d.advance([7, 8], 0)
    d.end()
    assert d.vocab.fingerprint == target_vocab(real).fingerprint and d.vocab.fingerprint
    # The bundled draft shares the target's tokenizer: its cache is the same.
    create("suffix", BuildContext(target=SimpleNamespace(path=DEFAULT_DRAFT, n_vocab=4096), options={"cache_path": path}))
    other = SimpleNamespace(path=None, n_vocab=32000)
    with pytest.raises(VocabMismatchError, match="delete"):
        create("suffix", BuildContext(target=other, options={"cache_path": path}))


def test_cache_without_vocabulary_field_still_loads(tmp_path):
    # Files written before the field existed load as before, unless a token id cannot be the target's.
    path = tmp_path / "suffix.npz"
    tree([1, 2, 3], [4000, 2]).save(path)
    z = dict(np.load(path))
    del z["vocab_fingerprint"], z["n_vocab"]
    np.savez(path, **z)
    assert len(SuffixTree.load(path, vocab=A)) == 2
    with pytest.raises(VocabMismatchError, match="token id 4000.*1000 tokens.*delete"):
        SuffixTree.load(path, vocab=Vocab("c" * 64, 1000))


def test_interrupted_save_keeps_the_previous_cache(tmp_path, monkeypatch):
    # The process dies mid-write (here: an exception after part of the file is out): the old cache survives.
    path = tmp_path / "suffix.npz"
    cfg = SuffixConfig(cache_path=str(path))
    d = SuffixDrafter(cfg, A)
    d.begin([1, 2])
    d.advance([3, 4], 0)
    d.end()
    before = path.read_bytes()
    saved = SuffixTree.load(path, vocab=A).structure()

    def dies_midway(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(suffix_tree_file.np, "savez_compressed", dies_midway)
    d.begin([9, 9])
    d.advance([8, 7], 0)
    with pytest.raises(KeyboardInterrupt):
        d.end()
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert SuffixTree.load(path, vocab=A).structure() == saved
    assert not (tmp_path / "suffix.npz.tmp").exists()
    e = SuffixDrafter(cfg, A)
    e.begin([0, 1, 2])
    assert e.global_tree.n_tokens == 4


def test_a_cache_that_can_no_longer_be_saved_warns_once_and_keeps_drafting(tmp_path, capsys):
    """The folder went away after start-up (a full or unmounted disk): the output is already out, so
    end() warns once instead of raising, and the global tree keeps growing in memory."""
    folder = tmp_path / "cache"
    folder.mkdir()
    d = SuffixDrafter(SuffixConfig(cache_path=str(folder / "suffix.npz")), A)
    folder.joinpath("suffix.npz").unlink(missing_ok=True)
    folder.rmdir()
    for first in (1, 5):
        d.begin([first, 2])
        d.advance([3, 4], 0)
        d.end()
    err = capsys.readouterr().err
    assert err.count("cannot save the suffix cache") == 1
    assert d.global_tree.n_tokens > 0
