"""JSON schemas as GBNF grammars, with llama.cpp's converter (``json_schema_to_gbnf``'s Python port, in llama_cpp).

What the port lacks, llama.cpp's C++ converter has, and is added here: recursive local refs, boolean sub-schemas,
integer bounds, bounded arrays and strings written as ``x{m,n}``, enums as a trie, ``required`` names outside
``properties``.  The schema is checked first (``json_schema``) and the grammar after (``gbnf``), so what is wrong
is said in the schema's words.  The grammar is then run like any other (``grammar``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from ..errors import InvalidParameterError
from ..gbnf import check_gbnf
from ..json_schema import INT_BOUNDS, KNOWN_FORMATS, SchemaError, check_schema, integer_bounds, integer_range, resolve_ref
from .backend import llama_cpp_module

_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_to_gbnf(schema: dict[str, Any] | bool) -> str:
    """A JSON schema as a GBNF grammar, with llama.cpp's converter (``json_schema_to_gbnf``'s Python port).

    ``True`` or ``{}`` means any JSON value, as OpenAI's ``json_object`` mode.  The schema is checked first
    (``json_schema.check_schema``: every keyword enforced or refused, no unsatisfiable node, bounds within the
    limits), and the grammar after (``gbnf.check_gbnf``); what is wrong is an ``InvalidParameterError`` in the
    schema's words, never the converter's internals.
    """
    if schema is True or schema == {}:
        schema = {}
    check_schema(schema)
    try:
        converter = _Converter(schema)
        converter.visit(schema, "")
        gbnf = converter.format_grammar()
    except SchemaError:
        raise
    except Exception as exc:  # the port raises bare KeyError/AssertionError/ValueError on what it cannot read
        reason = exc.args[0] if isinstance(exc, AssertionError) and exc.args else str(exc) or type(exc).__name__
        raise InvalidParameterError(f"the JSON schema cannot be turned into a grammar: {reason}") from None
    # The Python port's string character admits raw control characters, which JSON forbids (llama.cpp's C++
    # converter excludes them): a newline inside a string would make the output unparseable.
    gbnf = gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)
    check_gbnf(gbnf)
    return gbnf


def _converter_class() -> type:
    """llama.cpp's converter with what its Python port lacks: recursive local refs, boolean sub-schemas, integer
    bounds (as llama.cpp's C++ converter has them)."""
    llama_cpp_module()  # our CPU backend first: importing llama_cpp loads its library
    from llama_cpp.llama_grammar import SchemaConverter

    class Converter(SchemaConverter):
        def __init__(self, root: Any) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self._root = root
            self._collect_refs(root)

        def _collect_refs(self, node: Any) -> None:
            """Every local ``$ref`` resolved up front, wherever it stands (the port skips a node's siblings of a
            ``$ref``, so a ref inside ``$defs`` beside a top-level ``$ref`` was never resolved)."""
            todo = [node]
            while todo:
                n = todo.pop()
                if isinstance(n, list):
                    todo.extend(n)
                elif isinstance(n, dict):
                    ref = n.get("$ref")
                    if isinstance(ref, str) and ref not in self._refs:
                        self._refs[ref] = resolve_ref(self._root, ref, "")
                    todo.extend(n.values())

        def _resolve_ref(self, ref: str) -> str:
            """The rule a local ``$ref`` names.  ``#`` (the whole schema, as a recursive schema's
            ``{"properties": {"child": {"$ref": "#"}}}`` has it) is the rule ``root``: the port named it by the
            ref's last segment, ``#``, which is no GBNF rule name, and the grammar it wrote did not parse."""
            if ref.strip("#/") == "":
                return "root"
            return super()._resolve_ref(ref)

        def visit(self, schema: Any, name: str) -> str:
            if schema is True:
                schema = {}
            schema = _required_as_properties(schema)
            if isinstance(schema, dict) and schema.get("type") == "integer" and not (
                    set(schema) & {"$ref", "anyOf", "oneOf", "const", "enum"}) and \
                    any(k in schema for k in INT_BOUNDS):
                lo, hi = integer_bounds(schema)
                rule_name = name + "-" if name in _reserved_names() else name or "root"
                return self._add_rule(rule_name, integer_range(lo, hi) + " space")
            if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"] and \
                    not (set(schema) & {"$ref", "anyOf", "oneOf", "const"}):
                rule_name = name + "-" if name in _reserved_names() else name or "root"
                values = [json.dumps(v) for v in schema["enum"]]
                return self._add_rule(rule_name, literal_trie(values, self._format_literal) + " space")
            if isinstance(schema, dict) and not (set(schema) & {"$ref", "anyOf", "oneOf", "const", "enum"}):
                rule = self._bounded(schema, name)
                if rule is not None:
                    return rule
            return super().visit(schema, name)

        def _bounded(self, schema: dict, name: str) -> str | None:
            """Arrays and strings with length bounds as llama.cpp's C++ converter writes them, ``x{m,n}``, which
            llama.cpp expands into a chain of rules; the port nests one group per optional place instead, which
            llama.cpp's recursive parser cannot read past about 1,000."""
            kind = schema.get("type")
            rule_name = name + "-" if name in _reserved_names() else name or "root"
            if kind in (None, "array") and isinstance(schema.get("items"), (dict, bool)) and \
                    ("minItems" in schema or "maxItems" in schema) and "prefixItems" not in schema:
                item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
                body = _repeat(item, schema.get("minItems", 0), schema.get("maxItems"), '"," space')
                return self._add_rule(rule_name, f'"[" space {body} "]" space')
            if kind == "string" and ("minLength" in schema or "maxLength" in schema) and "pattern" not in schema \
                    and schema.get("format") not in KNOWN_FORMATS:
                from llama_cpp.llama_grammar import PRIMITIVE_RULES

                char = self._add_primitive("char", PRIMITIVE_RULES["char"])
                body = _repeat(char, schema.get("minLength", 0), schema.get("maxLength"), None)
                return self._add_rule(rule_name, f'"\\"" {body} "\\"" space')
            return None

    return Converter


def literal_trie(values: Sequence[str], quote: Callable[[str], str]) -> str:
    """Alternative literals as one GBNF expression with their common prefixes shared.

    llama.cpp keeps one parse stack per alternative still alive, and every token check walks all of them: an enum
    of 2,000 strings written as 2,000 alternatives made each whole-vocabulary check take 7 s on Gemma 3, where a
    trie keeps only the alternatives that differ at the current character."""
    trie: dict = {}
    for value in dict.fromkeys(values):
        node = trie
        for ch in value:
            node = node.setdefault(ch, {})
        node[""] = {}  # a value ends here
    return _trie_gbnf(trie, quote)


def _trie_gbnf(root: dict, quote: Callable[[str], str]) -> str:
    """The trie below ``root`` as GBNF, built bottom-up without recursion (a long value must not exhaust Python's)."""
    order, todo = [], [root]
    while todo:
        node = todo.pop()
        order.append(node)
        todo.extend(child for key, child in node.items() if key)
    text: dict[int, str] = {}
    for node in reversed(order):
        parts = []
        for key, child in node.items():
            if not key:
                continue
            rest = text[id(child)]
            parts.append(quote(key) + (" " + rest if rest else ""))
        if "" in node and parts:
            parts.append("")
        text[id(node)] = parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")" if parts else ""
    return text[id(root)]


def _repeat(item: str, low: int, high: int | None, sep: str | None) -> str:
    """``item`` low..high times (high None: unbounded), separated by ``sep``, in GBNF's {m,n} form."""
    if high == 0:
        return ""
    if sep is None:
        return f"{item}{{{low},{'' if high is None else high}}}"
    rest = f"({sep} {item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
    # not (item rest)?: llama.cpp counts the group's rules against the ? and refuses past 2000 of them
    return f"{item} {rest}" if low > 0 else f"({item} {rest} | )"


ANY_VALUE = {"type": ["object", "array", "string", "number", "boolean", "null"]}  # the port reads {} as any object


def _required_as_properties(schema: Any) -> Any:
    """An object's required names that ``properties`` does not list, added there as any value: the port enforces
    ``required`` only among ``properties`` and would drop the rest."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or \
            set(schema) & {"$ref", "anyOf", "oneOf", "allOf", "const", "enum"}:
        return schema
    required, props = schema.get("required") or [], schema.get("properties") or {}
    missing = [n for n in required if isinstance(n, str) and n not in props]
    if not missing or not isinstance(props, dict):
        return schema
    return {**schema, "properties": {**props, **{n: ANY_VALUE for n in missing}}}


def _Converter(schema: Any) -> Any:
    global _CONVERTER
    if _CONVERTER is None:
        _CONVERTER = _converter_class()
    return _CONVERTER(schema)


_CONVERTER: type | None = None


def _reserved_names() -> Any:
    llama_cpp_module()  # our CPU backend first: importing llama_cpp loads its library
    from llama_cpp.llama_grammar import RESERVED_NAMES

    return RESERVED_NAMES
