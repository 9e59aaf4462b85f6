"""JSON schemas as untrusted input: every keyword is enforced or refused, and a schema no value satisfies is refused.

llama.cpp's schema converter (``llama.schema_gbnf.schema_to_gbnf``) reads each schema node by the first of its forms
that matches (a ``$ref``, a union, an enum, an object with properties, an array with items, a string with a
pattern, ...) and silently ignores every other keyword on that node: ``{"type": "integer", "maximum": 120}``
becomes any integer, and ``allOf`` of a string and an integer becomes ``{}``.  Output that breaks the schema the
client asked for, with finish ``stop``, is worse than a refusal, so ``check_schema`` walks the schema first and
raises ``SchemaError`` (an ``InvalidParameterError``) naming the keyword and where it sits when

- the converter would ignore a validation keyword (``multipleOf``, ``minimum`` on a number, ``minItems`` on a
  tuple, ``properties`` beside ``anyOf``, ...): "cannot be enforced";
- no value satisfies the node (``minItems`` above ``maxItems``, an empty ``enum``, ``false``, a required property
  that ``additionalProperties: false`` forbids): "no value satisfies it";
- a length or count bound is over ``gbnf.MAX_REPEAT`` (the converter writes ``maxItems: n`` as n nested groups).

Integer bounds are enforced: ``integer_range`` writes the integers of a range as a grammar, which the converter in
``llama.schema_gbnf`` uses for integer nodes with ``minimum``/``maximum``.  Keywords JSON Schema calls annotations
(``title``, ``description``, ``default``, ``examples``, an unknown ``format``) and unknown vendor keywords are
ignored, as the JSON Schema specification says they may be.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterator

from .errors import InvalidParameterError
from .gbnf import MAX_REPEAT

MAX_DEPTH = 64  # schema nodes inside nodes
MAX_DIGITS = 16  # the converter's JSON integer has at most 16 digits
INT_BOUND = 10 ** MAX_DIGITS - 1
KNOWN_FORMATS = ("uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5", "date", "time", "date-time")

VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "items", "prefixItems", "additionalItems", "maxItems", "minItems",
    "uniqueItems", "contains", "maxContains", "minContains", "properties", "patternProperties",
    "additionalProperties", "required", "maxProperties", "minProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "propertyNames", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
    "unevaluatedItems", "unevaluatedProperties", "format"})
INT_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class SchemaError(InvalidParameterError):
    """A JSON schema that cannot be enforced as given, or that no value satisfies; ``path`` is where in it."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(f"{message} (at {path or 'the top of the schema'})" if path is not None else message)
        self.path = path


def check_schema(schema: Any) -> None:
    """Raise ``SchemaError`` unless the converter enforces every keyword of ``schema`` and some value satisfies it."""
    checker = _Checker(schema)
    checker.node(schema, "", 0)
    checker.no_ref_cycle()


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def node(self, schema: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests more than {MAX_DEPTH} levels deep; flatten it", path)
        if schema is True:
            return
        if schema is False:
            raise SchemaError("the schema false allows no value, so no output could satisfy it", path)
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or a boolean, not {type(schema).__name__}", path)
        used = self._form(schema, path)
        for key in sorted(set(schema) & VALIDATION - used):
            if key == "format" or (key == "uniqueItems" and schema[key] is False):
                continue  # an unknown format is an annotation; uniqueItems false asks nothing
            if key == "additionalProperties" and schema[key] is True:
                continue
            if key == "required" and schema[key] == []:
                continue
            raise SchemaError(f"the keyword {key!r} cannot be enforced here ({_why(key, schema)}); remove it or "
                              "restate the schema", _join(path, key))
        for sub, where in _children(schema, path):
            self.node(sub, where, depth + 1)

    def _form(self, schema: dict, path: str) -> set[str]:
        """The keywords the converter enforces on this node (its first matching form), checking their values."""
        kind = schema.get("type")
        if "$ref" in schema:
            self._ref(schema["$ref"], path)
            return {"$ref"}
        for union in ("oneOf", "anyOf"):
            if union in schema:
                branches = schema[union]
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"{union} must be a non-empty list of schemas", _join(path, union))
                return {union}
        if isinstance(kind, list):
            if not kind:
                raise SchemaError("an empty type list allows no value", _join(path, "type"))
            return {"type"}
        if "const" in schema:
            return {"const", "type"}
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError("enum is empty, so no value satisfies it; give at least one value", _join(path, "enum"))
            return {"enum", "type"}
        if kind in (None, "object") and ("properties" in schema or schema.get("required") or
                                         schema.get("additionalProperties", True) is not True):
            self._object(schema, path)
            return {"type", "properties", "required", "additionalProperties"}
        if kind in (None, "object") and "allOf" in schema:
            self._all_of(schema["allOf"], _join(path, "allOf"))
            return {"type", "allOf"}
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            items = schema.get("items") or schema.get("prefixItems")
            if isinstance(items, list):
                return {"type", "items", "prefixItems"}  # a tuple: its length is its items'
            self._bounds(schema, "minItems", "maxItems", path)
            return {"type", "items", "minItems", "maxItems"}
        if kind in (None, "string") and "pattern" in schema:
            check_pattern(schema["pattern"], _join(path, "pattern"))
            return {"type", "pattern"}
        if kind in (None, "string") and schema.get("format") in KNOWN_FORMATS:
            return {"type", "format"}
        if kind == "string" and ("minLength" in schema or "maxLength" in schema):
            self._bounds(schema, "minLength", "maxLength", path)
            return {"type", "minLength", "maxLength"}
        if kind == "integer" and any(k in schema for k in INT_BOUNDS):
            integer_bounds(schema, path)
            return {"type", *INT_BOUNDS}
        if kind not in (None, "object", "array", "string", "number", "integer", "boolean", "null"):
            raise SchemaError(f"type {kind!r} is not a JSON schema type", _join(path, "type"))
        return {"type"}

    def _ref(self, ref: Any, path: str) -> None:
        resolve_ref(self.root, ref, path)  # its target is checked where it stands (under $defs, say), once

    def no_ref_cycle(self) -> None:
        """Refuse refs that come back to where they started before any value is written: ``{"$ref": "#"}``, or refs
        (and ``anyOf``/``oneOf`` branches) that only point at each other.  The grammar would be a rule that begins
        with itself, which no grammar engine runs (llama.cpp's parser answered ``{"$ref": "#"}`` with a message
        about a rule named ``-``).  One depth-first walk over those edges, without recursion: a node met again while
        it is still on the walk's path closes such a cycle."""
        state: dict[int, bool] = {}  # True: on the current path; False: done, no cycle through it
        for start, start_path in _all_nodes(self.root):
            if id(start) in state:
                continue
            state[id(start)] = True
            path = [(start, iter(self._unconsumed(start, start_path)), None)]
            while path:
                node, edges, _ = path[-1]
                step = next(edges, None)
                if step is None:
                    state[id(node)] = False
                    path.pop()
                    continue
                child, where, ref, at_ref = step
                if state.get(id(child)) is True:
                    at = next(i for i, (n, _, _) in enumerate(path) if n is child)
                    refs = [r for _, _, r in path[at + 1:] if r is not None] + ([ref] if ref is not None else [])
                    raise SchemaError(f"$ref {' -> '.join(repr(r) for r in refs)} leads back to where it started "
                                      "before any value is written: its grammar rule would begin with itself, which "
                                      "no grammar can run; point the ref at a schema that says what the value is (a "
                                      "ref back inside properties or items, such as {\"properties\": {\"next\": "
                                      "{\"$ref\": \"#\"}}}, is fine)", at_ref)
                if id(child) not in state:
                    state[id(child)] = True
                    path.append((child, iter(self._unconsumed(child, where)), ref))

    def _unconsumed(self, node: Any, path: str) -> Iterator[tuple[Any, str, str | None, str]]:
        """Where a node's value may begin without writing anything first: its ``$ref``'s target and its union
        branches, each with its path, the ref followed (None for a branch) and where that step stands."""
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            target_path = ".".join(p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p)
            yield resolve_ref(self.root, ref, path), target_path, ref, _join(path, "$ref")
        for union in ("anyOf", "oneOf"):
            if isinstance(node.get(union), list):
                for i, branch in enumerate(node[union]):
                    where = f"{_join(path, union)}[{i}]"
                    yield branch, where, None, where

    def _object(self, schema: dict, path: str) -> None:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError("properties must be an object of schemas", _join(path, "properties"))
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("required must be a list of property names", _join(path, "required"))
        for name in required:
            if name in props:
                if props[name] is False:
                    raise SchemaError(f"property {name!r} is required but its schema is false, so no value "
                                      "satisfies it", _join(path, "required"))
                continue
            if schema.get("additionalProperties", True) is False:
                raise SchemaError(f"property {name!r} is required but additionalProperties false forbids it (it is "
                                  "not among properties), so no value satisfies it", _join(path, "required"))
            # otherwise it is enforced as a property of any value (``llama.schema_gbnf``'s converter adds it)

    def _all_of(self, parts: Any, path: str) -> None:
        if not isinstance(parts, list) or not parts:
            raise SchemaError("allOf must be a non-empty list of schemas", path)
        for i, part in enumerate(parts):
            where = f"{path}[{i}]"
            if isinstance(part, dict) and "$ref" in part:
                part = resolve_ref(self.root, part["$ref"], where)
            if isinstance(part, dict) and "anyOf" in part:
                continue  # the converter merges an anyOf's objects as optional properties
            ok = isinstance(part, dict) and part.get("type", "object") == "object" and \
                not (set(part) & VALIDATION - {"type", "properties", "required"})
            if not ok:
                raise SchemaError("allOf is enforced only as a merge of objects' properties; this part is not an "
                                  "object with properties alone (allOf of other types, such as a string and an "
                                  "integer, is refused: no value is both)", where)

    def _bounds(self, schema: dict, low_key: str, high_key: str, path: str) -> None:
        low, high = schema.get(low_key, 0), schema.get(high_key)
        for key, value in ((low_key, low), (high_key, high)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SchemaError(f"{key} must be a non-negative integer (got {value!r})", _join(path, key))
            if value > MAX_REPEAT:
                raise SchemaError(f"{key} {value} is over the limit of {MAX_REPEAT} (the grammar writes out every "
                                  "place up to the bound, and a larger one takes the server's memory); lower it",
                                  _join(path, key))
        if high is not None and low > high:
            raise SchemaError(f"{low_key} {low} is above {high_key} {high}, so no value satisfies it",
                              _join(path, low_key))


def check_pattern(pattern: Any, path: str) -> None:
    """A ``pattern`` that is a regular expression: the converter writes whatever it is given into the grammar, so
    ``^(a$`` (a group never closed) or ``^a{3,1}$`` (a maximum below its minimum) was accepted and then matched
    nothing, or something else.  Read with Python's ``re``, whose syntax the converter's (ECMA 262's) shares."""
    if not isinstance(pattern, str):
        raise SchemaError(f"pattern must be a string (got {type(pattern).__name__})", path)
    try:
        re.compile(pattern)
    except re.error as exc:
        where = f" at position {exc.pos}" if exc.pos is not None else ""
        raise SchemaError(f"pattern {_short(pattern)} is not a valid regular expression ({exc.msg}{where}), so no "
                          "string could be checked against it; fix the pattern", path) from None
    except (OverflowError, RecursionError):
        raise SchemaError(f"pattern {_short(pattern)} is not a regular expression this server can read (a repetition "
                          "count too large, or groups nested too deep); simplify it", path) from None


def _short(text: str, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit - 4] + "...'"


def integer_bounds(schema: dict, path: str = "") -> tuple[int, int]:
    """The inclusive range an integer node's ``minimum``/``maximum`` (and exclusive forms, drafts 4 and 6) allow,
    clipped to the 16 digits the grammar writes; ``SchemaError`` when no integer is in it."""
    lo, hi = -INT_BOUND, INT_BOUND
    for key in INT_BOUNDS:
        value = schema.get(key)
        if value is None or (isinstance(value, bool) and key.startswith("exclusive")):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SchemaError(f"{key} must be a finite number (got {value!r})", _join(path, key))
        exclusive = key.startswith("exclusive") or schema.get("exclusive" + key[0].upper() + key[1:]) is True
        if key.endswith("inimum"):
            lo = max(lo, math.floor(value) + 1 if exclusive else math.ceil(value))
        else:
            hi = min(hi, math.ceil(value) - 1 if exclusive else math.floor(value))
    if lo > hi:
        raise SchemaError(f"no integer of at most {MAX_DIGITS} digits is within minimum/maximum "
                          f"({_bounds_text(schema)}), so no value satisfies it", path)
    return lo, hi


def integer_range(lo: int, hi: int) -> str:
    """A GBNF expression matching exactly the decimal integers lo..hi (no leading zeros, no "-0")."""
    alternatives: list[str] = []
    if lo < 0:
        alternatives += ['"-" ' + a for a in _positive(max(1, -hi), -lo)]
    if hi >= 0:
        alternatives += _positive(max(lo, 0), hi)
    return "(" + " | ".join(alternatives) + ")"


def _positive(a: int, b: int) -> list[str]:
    """Alternatives for a..b, 0 <= a <= b, grouped by digit count."""
    out: list[str] = []
    for digits in range(len(str(a)), len(str(b)) + 1):
        low = max(a, 10 ** (digits - 1) if digits > 1 else 0)
        high = min(b, 10 ** digits - 1)
        if low <= high:
            out += _same_length(str(low), str(high))
    return out


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives for the numbers lo..hi, both of the same digit count."""
    n = len(lo)
    if n == 0:
        return [""]
    if lo == hi:
        return [f'"{lo}"']
    if lo[0] == hi[0]:
        return [f'"{lo[0]}" {rest}'.rstrip() for rest in _same_length(lo[1:], hi[1:])]
    if lo[1:] == "0" * (n - 1) and hi[1:] == "9" * (n - 1):
        return [(_digits(lo[0], hi[0]) + " " + _any(n - 1)).rstrip()]
    out = [f'"{lo[0]}" {rest}'.rstrip() for rest in _same_length(lo[1:], "9" * (n - 1))]
    if int(lo[0]) + 1 <= int(hi[0]) - 1:
        out.append((_digits(str(int(lo[0]) + 1), str(int(hi[0]) - 1)) + " " + _any(n - 1)).rstrip())
    out += [f'"{hi[0]}" {rest}'.rstrip() for rest in _same_length("0" * (n - 1), hi[1:])]
    return out


def _digits(a: str, b: str) -> str:
    return f'"{a}"' if a == b else f"[{a}-{b}]"


def _any(n: int) -> str:
    return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def resolve_ref(root: Any, ref: Any, path: str) -> Any:
    """The node a local ``$ref`` ("#/$defs/x") points at; ``SchemaError`` for one that points nowhere."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"$ref {ref!r} is not a local reference (only '#/...' into this schema is followed)",
                          _join(path, "$ref"))
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"$ref {ref!r} points at nothing in the schema", _join(path, "$ref"))
    return node


def embedded(schema: Any) -> Any:
    """``schema`` with each embedded document's local refs made absolute: a tool's parameters, placed inside a
    call's schema, keep their own ``$defs``, and their ``#/$defs/x`` meant the parameters, not the call.

    A node below the top that holds ``$defs`` or ``definitions`` is taken as such a document; every ``$ref`` under
    it gets the node's own pointer in front ("#/$defs/x" becomes "#/properties/arguments/$defs/x")."""
    def walk(node: Any, pointer: str, base: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{pointer}/{i}", base) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if pointer and ("$defs" in node or "definitions" in node):
            base = pointer  # a document of its own from here down
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#") and base:
                out[key] = "#" + base + value[1:]
            else:
                out[key] = walk(value, f"{pointer}/{key.replace('~', '~0').replace('/', '~1')}", base)
        return out

    return walk(schema, "", "")


def _children(schema: dict, path: str) -> Iterator[tuple[Any, str]]:
    """Each sub-schema of a node (definitions included: a definition is checked even where no ref uses it)."""
    for key in ("properties", "$defs", "definitions"):
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield sub, _join(path, f"{key}.{name}")
    for key in ("items", "additionalProperties"):
        value = schema.get(key)
        if isinstance(value, dict):
            yield value, _join(path, key)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield sub, f"{_join(path, key)}[{i}]"


def _all_nodes(schema: Any) -> Iterator[tuple[Any, str]]:
    """Every schema node with its path, the top first (without recursion; the depth was checked before)."""
    todo = [(schema, "")]
    while todo:
        node, path = todo.pop()
        yield node, path
        if isinstance(node, dict):
            todo.extend(_children(node, path))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _bounds_text(schema: dict) -> str:
    return ", ".join(f"{k} {schema[k]}" for k in INT_BOUNDS if k in schema)


def _why(key: str, schema: dict) -> str:
    """Why the converter would drop ``key`` on this node, in the user's words."""
    kind = schema.get("type")
    if key in INT_BOUNDS and kind != "integer":
        return "bounds are enforced on integers only"
    if key in ("minItems", "maxItems") and "items" not in schema:
        return "an array's length is enforced only beside a single items schema"
    if key in ("minLength", "maxLength") and ("pattern" in schema or schema.get("format") in KNOWN_FORMATS):
        return "a pattern or format fixes the string's form, and its length is not checked beside it"
    if "$ref" in schema or "anyOf" in schema or "oneOf" in schema or isinstance(kind, list):
        return "beside $ref, anyOf, oneOf or a list of types only those are enforced; move it into each branch"
    return "the grammar converter does not enforce it"
