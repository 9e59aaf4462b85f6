"""The REST datastore (specstack.retrieval.datastore), its CLI and the rest drafter, against brute force."""

from __future__ import annotations

from specstack.drafters.base import propose_one

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack.cli import main
from specstack.retrieval.datastore import SENTINEL, Datastore, build_suffix_array, collect_files, write_store
from specstack.drafters.base import BuildContext, create
from specstack.drafters.rest import RestConfig, RestDrafter
from specstack.errors import InvalidParameterError, SpecstackError, VocabMismatchError
from specstack.paths import DEFAULT_TARGET

V = 4  # a tiny vocabulary: matches and ties everywhere

docs_st = st.lists(st.lists(st.integers(0, V - 1), min_size=0, max_size=25), min_size=1, max_size=4)


def joined(docs):
    out = []
    for d in docs:
        out += list(d) + [SENTINEL]
    return out


def store_of(tmp_path_factory, docs, n_vocab=V) -> Datastore:
    path = tmp_path_factory.mktemp("ds") / "store"
    write_store(path, docs, n_vocab=n_vocab)
    return Datastore(path)


def occurrences(docs, pattern):
    """Start positions (in the joined array) where ``pattern`` occurs."""
    toks, n = joined(docs), len(pattern)
    return [i for i in range(len(toks) - n + 1) if toks[i : i + n] == list(pattern)]


def ref_match(docs, context, max_match, min_match):
    for m in range(min(max_match, len(context)), min_match - 1, -1):
        occ = occurrences(docs, context[len(context) - m :])
        if occ:
            return m, occ
    return 0, []


def ref_rows(docs, occ, m, k):
    toks = joined(docs)
    rows = []
    for p in occ:
        row = toks[p + m : p + m + k]
        row += [SENTINEL] * (k - len(row))
        if SENTINEL in row:
            row = row[: row.index(SENTINEL)] + [SENTINEL] * (k - row.index(SENTINEL))
        rows.append(row)
    return rows


# --- the suffix array ----------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(docs_st, st.sampled_from([1, 2, 3, 64]))
def test_suffix_array_equals_sorting_by_definition(docs, depth):
    # Positions of real tokens, ordered by their next `depth` tokens (the
    # sentinel smallest, the array end smaller still), ties by position; prefix
    # doubling rounds the depth up to a power of two.
    toks = np.array(joined(docs), dtype=np.int32)
    sa = build_suffix_array(toks, depth)
    key_len = 1 << (depth - 1).bit_length()
    ref = sorted((i for i in range(len(toks)) if toks[i] != SENTINEL), key=lambda i: (toks[i : i + key_len].tolist(), i))
    assert sa.tolist() == ref


def test_suffix_array_of_a_million_tokens_is_quick():
    # The build must scale (the demo store has ~2M tokens): 1M tokens, half of
    # them one block repeated 1000 times (deep ties), well under the 30 s bound.
    import time

    rng = np.random.default_rng(0)
    body = [rng.integers(0, 4096, 500_000), np.tile(rng.integers(0, 4096, 500), 1000), [SENTINEL]]
    toks = np.concatenate(body).astype(np.int32)
    t0 = time.perf_counter()
    sa = build_suffix_array(toks)
    assert time.perf_counter() - t0 < 30
    assert sorted(sa.tolist()) == list(range(len(toks) - 1))
    first, second = toks[sa], toks[sa + 1]
    assert ((first[1:] > first[:-1]) | ((first[1:] == first[:-1]) & (second[1:] >= second[:-1]))).all()


# --- retrieval against brute force ---------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(docs_st, st.lists(st.integers(0, V - 1), min_size=1, max_size=5))
def test_find_returns_exactly_the_occurrences(tmp_path_factory, docs, pattern):
    store = store_of(tmp_path_factory, docs)
    lo, hi = store.find(pattern)
    assert sorted(store.sa[lo:hi].tolist()) == occurrences(docs, pattern)


@settings(max_examples=150, deadline=None)
@given(docs_st, st.lists(st.integers(0, V - 1), min_size=1, max_size=10), st.integers(1, 3), st.integers(1, 8))
def test_retrieve_equals_most_frequent_chain(tmp_path_factory, docs, context, min_match, k):
    # Longest matching suffix (min_match..6), then at each step the most frequent
    # next token among occurrences agreeing so far (smallest id on ties), with the
    # fraction of occurrences as its probability.
    store = store_of(tmp_path_factory, docs)
    r = store.propose(context, k, max_match=6, min_match=min_match)
    m, occ = ref_match(docs, context, 6, min_match)
    assert r.match_len == m and r.n_matches == len(occ)
    if m == 0:
        assert r.token_ids == ()
        return
    rows = ref_rows(docs, occ, m, k)
    toks, probs = [], []
    for j in range(k):
        c = Counter(row[j] for row in rows if row[j] != SENTINEL)
        if not c:
            break
        t = min(c, key=lambda t: (-c[t], t))
        toks.append(t)
        probs.append(c[t] / len(occ))
        rows = [row for row in rows if row[j] == t]
    assert r.token_ids == tuple(toks)
    assert r.probs == pytest.approx(probs)
    # And the draft really follows the match somewhere in the corpus.
    assert occurrences(docs, list(context[-m:]) + toks)


@settings(max_examples=150, deadline=None)
@given(docs_st, st.lists(st.integers(0, V - 1), min_size=1, max_size=10), st.integers(1, 12))
def test_propose_tree_equals_heaviest_prefixes(tmp_path_factory, docs, context, budget):
    # REST's candidate trie: the `budget` most shared continuation prefixes, each
    # after its parent, with parent indices pointing at the prefix minus one token.
    store = store_of(tmp_path_factory, docs)
    r = store.propose_tree(context, 4, budget, max_match=6, min_match=1)
    m, occ = ref_match(docs, context, 6, 1)
    if m == 0:
        assert r.token_ids == ()
        return
    counts = Counter()
    for row in ref_rows(docs, occ, m, 4):
        for j in range(4):
            if row[j] == SENTINEL:
                break
            counts[tuple(row[: j + 1])] += 1
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    assert r.token_ids == tuple(p[-1] for p in ranked)
    assert r.parents == tuple(ranked.index(p[:-1]) if len(p) > 1 else -1 for p in ranked)
    assert r.probs == pytest.approx([counts[p] / len(occ) for p in ranked])


def test_docstring_example():
    # The Datastore docstring: [5, 6] matches twice; 7 and 8 tie, 7 is smaller.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_store(Path(d) / "s", [[5, 6, 7, 5, 6, 8]], n_vocab=10)
        r = Datastore(Path(d) / "s").propose([1, 5, 6], 2)
    assert (r.token_ids, r.probs, r.match_len) == ((7, 5), (0.5, 0.5), 2)


def test_min_match_refuses_short_matches(tmp_path):
    # A single shared token is too weak a match when min_match=2.
    write_store(tmp_path / "s", [[1, 2, 3]], n_vocab=V)
    store = Datastore(tmp_path / "s")
    assert store.propose([0, 2], 2, min_match=2).token_ids == ()
    assert store.propose([0, 2], 2, min_match=1).token_ids == (3,)


def test_many_matches_are_sampled_but_still_real(tmp_path):
    # 300 occurrences, 64 read: the sample is capped and the draft still valid.
    docs = [[1, 2, 3 if i % 3 else 0] for i in range(300)]
    write_store(tmp_path / "s", docs, n_vocab=V)
    r = Datastore(tmp_path / "s").propose([1, 2], 1, max_candidates=64, min_match=1)
    assert r.n_matches == 300 and r.n_sampled == 64
    assert r.token_ids == (3,) and r.probs[0] == pytest.approx(2 / 3, abs=0.05)


def test_min_token_prob_cuts_the_chain(tmp_path):
    # After [1] come 2 and 3 equally: a 0.6 floor drafts nothing.
    write_store(tmp_path / "s", [[1, 2], [1, 3]], n_vocab=V)
    store = Datastore(tmp_path / "s")
    assert store.propose([1], 2, min_match=1, min_token_prob=0.6).token_ids == ()
    assert store.propose([1], 2, min_match=1, min_token_prob=0.5).token_ids == (2,)


def test_out_of_vocabulary_tokens_are_rejected(tmp_path):
    with pytest.raises(SpecstackError, match=r"\[0, 4\)"):
        write_store(tmp_path / "s", [[1, 9]], n_vocab=V)


# --- errors --------------------------------------------------------------------------------
def test_missing_store_says_how_to_build_one(tmp_path):
    with pytest.raises(SpecstackError, match="does not exist.*specstack datastore build"):
        Datastore(tmp_path / "nope")


def test_incomplete_store_is_named(tmp_path):
    write_store(tmp_path / "s", [[1, 2]], n_vocab=V)
    (tmp_path / "s" / "sa.npy").unlink()
    with pytest.raises(SpecstackError, match="incomplete.*sa.npy.*rebuild"):
        Datastore(tmp_path / "s")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "meta.json").write_text("{not json"), "meta.json is unreadable"),
        (lambda p: (p / "sa.npy").write_bytes(b"\x93NUMPY garbage"), "corrupt"),
        (lambda p: np.save(p / "sa.npy", np.zeros(1, np.int32)), "sizes disagree"),
        (lambda p: np.save(p / "tokens.npy", np.zeros(3, np.float32)), "corrupt"),
        (lambda p: _edit_meta(p, version=99), "version 99"),
        (lambda p: _edit_meta(p, format="other"), "not a specstack datastore"),
    ],
)
def test_corrupt_store_is_a_clear_error(tmp_path, damage, message):
    # Each kind of damage is caught at open, names the store and the rebuild command.
    write_store(tmp_path / "s", [[1, 2, 3], [3, 2]], n_vocab=V)
    damage(tmp_path / "s")
    with pytest.raises(SpecstackError, match=message) as e:
        Datastore(tmp_path / "s")
    assert str(tmp_path / "s") in str(e.value)


def _edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def test_write_store_never_replaces_a_foreign_folder(tmp_path):
    # -o pointing at someone's folder must not delete it.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SpecstackError, match="not a specstack datastore"):
        write_store(tmp_path / "mine", [[1]], n_vocab=V)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# --- files and the CLI ---------------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "a.py").write_text("def add(x, y):\n    return x + y\n\n\ndef add3(x, y, z):\n    return add(add(x, y), z)\n")
    (root / "pkg" / "b.py").write_text("import os\nprint(os.getcwd())\n")
    (root / "pkg" / "notes.txt").write_text("plain text is indexed too\n")
    (root / "pkg" / "blob.bin").write_bytes(bytes(range(256)))
    (root / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\x00compiled")
    return root


def test_collect_files_walks_and_excludes_by_relative_path(corpus):
    # Relative names let a held-out list (paths under the corpus root) exclude exactly.
    names = [n for _, n in collect_files([corpus], exclude=["pkg/b.py"])]
    assert names == ["a.py", "pkg/blob.bin", "pkg/notes.txt"]
    assert [n for _, n in collect_files([corpus], include=["*.py"])] == ["a.py", "pkg/b.py"]


def _tokenize(text: str) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(DEFAULT_TARGET), vocab_only=True, verbose=False)
    return llm.tokenize(text.encode(), add_bos=False, special=False)


def test_cli_build_tokenizes_with_the_target_and_is_idempotent(corpus, tmp_path, capsys):
    # The store holds the target's tokens for every text file (binary skipped);
    # a second run with the same inputs does nothing and says so; a changed file rebuilds.
    store_path = tmp_path / "store"
    assert main(["datastore", "build", str(corpus), "-o", str(store_path)]) == 0
    store = Datastore(store_path)
    assert store.n_docs == 3
    names = [s["name"] for s in store.meta["sources"]]
    assert names == ["a.py", "pkg/b.py", "pkg/notes.txt"]
    first_doc = store.tokens[: store.meta["sources"][0]["tokens"]].tolist()
    assert first_doc == _tokenize((corpus / "a.py").read_text())
    assert store.meta["tokenizer"]["fingerprint"]
    assert "skipped 1 binary" in capsys.readouterr().err

    mtime = (store_path / "sa.npy").stat().st_mtime_ns
    assert main(["datastore", "build", str(corpus), "-o", str(store_path)]) == 0
    assert "up to date" in capsys.readouterr().err
    assert (store_path / "sa.npy").stat().st_mtime_ns == mtime

    (corpus / "a.py").write_text("x = 1\n")
    assert main(["datastore", "build", str(corpus), "-o", str(store_path)]) == 0
    assert "up to date" not in capsys.readouterr().err
    assert Datastore(store_path).meta["sources"][0]["tokens"] == len(_tokenize("x = 1\n"))


def test_cli_exclude_from_a_list(corpus, tmp_path):
    # The demo script's guard: listed files never enter the store.
    held = tmp_path / "held_out.txt"
    held.write_text("pkg/b.py\n# comment\n\npkg/notes.txt\n")
    out = tmp_path / "store"
    assert main(["datastore", "build", str(corpus), "-o", str(out), "--exclude-from", str(held)]) == 0
    assert [s["name"] for s in Datastore(out).meta["sources"]] == ["a.py"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    # A missing corpus path is a user error: exit 2, no traceback.
    assert main(["datastore", "build", str(tmp_path / "nothing"), "-o", str(tmp_path / "s")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_info(corpus, tmp_path, capsys):
    main(["datastore", "build", str(corpus), "-o", str(tmp_path / "s")])
    capsys.readouterr()
    assert main(["datastore", "info", str(tmp_path / "s")]) == 0
    assert "tokens" in capsys.readouterr().out


# --- the rest drafter ----------------------------------------------------------------------
def test_rest_without_a_datastore_says_how_to_build_one():
    with pytest.raises(InvalidParameterError, match="specstack datastore build"):
        RestConfig()


def test_rest_drafter_docstring_example(tmp_path):
    # [5, 6] occurs 3 times, followed by 7 twice: the draft starts with 7, and
    # after `5 6 7` come `5` once and a document end once, so 5 follows.
    write_store(tmp_path / "s", [[5, 6, 7, 5, 6, 8, 5, 6, 7]], n_vocab=10)
    d = RestDrafter(RestConfig(datastore=str(tmp_path / "s")))
    d.begin([4, 5, 6])
    draft = propose_one(d, [4, 5, 6], 2)
    assert draft.token_ids == (7, 5) and draft.source == "rest" and draft.q is None
    d.advance([7], 1)
    d.end()


def test_rest_propose_tree_has_parents(tmp_path):
    write_store(tmp_path / "s", [[5, 6, 7, 5, 6, 8, 5, 6, 7]], n_vocab=10)
    d = RestDrafter(RestConfig(datastore=str(tmp_path / "s")))
    t = d.propose_tree([4, 5, 6], 3, depth=2)
    assert t.token_ids == (7, 8, 5) and t.parents == (-1, -1, 0)


def test_rest_registered_and_checks_the_vocabulary(tmp_path):
    # Built by name from options; a target with another vocabulary is refused
    # (its token ids would mean other text).
    write_store(tmp_path / "s", [[1, 2, 3]], n_vocab=V)
    opts = {"datastore": str(tmp_path / "s"), "max_match": 8}
    d = create("rest", BuildContext(target=None, options=opts))
    assert isinstance(d, RestDrafter) and d.config.max_match == 8

    class OtherTarget:
        n_vocab = 32000

    with pytest.raises(VocabMismatchError, match="rebuild"):
        create("rest", BuildContext(target=OtherTarget(), options=opts))


def test_rest_refuses_a_store_from_another_tokenizer(tmp_path):
    # A store built for another GGUF (different vocabulary fingerprint) must not serve this target.
    write_store(tmp_path / "s", [[1, 2, 3]], n_vocab=4096, tokenizer={"model": "other.gguf", "fingerprint": "0" * 64})

    class Target:
        path = DEFAULT_TARGET
        n_vocab = 4096

    with pytest.raises(VocabMismatchError, match="other.gguf"):
        create("rest", BuildContext(target=Target(), options={"datastore": str(tmp_path / "s")}))


def test_rest_missing_store_path(tmp_path):
    with pytest.raises(SpecstackError, match="specstack datastore build"):
        RestDrafter(RestConfig(datastore=str(tmp_path / "absent")))
