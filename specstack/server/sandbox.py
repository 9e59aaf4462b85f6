"""The Jinja sandbox chat templates render in (``chat``), set up as transformers and llama.cpp set theirs up.

Here alone what a template may call (filters, globals, extra tags: Jinja's extension points); ``chat`` decides
where a template comes from, what messages it is given and how its output splits into message text and markup.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> Any:
    """A template's compiled form, kept: checked once at load, then rendered for every request."""
    return environment().from_string(text)


@functools.lru_cache(maxsize=1)
def environment() -> Any:
    """The sandbox templates render in, as transformers and llama.cpp set it up: ``tojson`` without HTML
    escaping, ``{% break %}``/``{% continue %}``, ``{% generation %}`` blocks, ``strftime_now``, and a string
    plus an undefined or null value being that string (``concat_null``)."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            joined = concat_null(left, right) if operator == "+" else None
            return joined if joined is not None else super().call_binop(context, operator, left, right)

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def concat_null(left: Any, right: Any) -> str | None:
    """``left + right`` where one is a string and the other undefined or null: the string (None: not such a sum).

    llama.cpp's template engine reads it so (its "concat null with string" workaround), and templates rely on it:
    firefunction-v2 adds ``functions`` to its system prompt whether or not a request has tools, which plain Jinja
    refuses ("'functions' is undefined"), so every chat through it was a 400."""
    from jinja2 import Undefined

    def null(x: Any) -> bool:
        return x is None or isinstance(x, Undefined)

    if isinstance(left, str) and null(right):
        return left
    if null(left) and isinstance(right, str):
        return right
    return None
