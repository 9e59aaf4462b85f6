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
    escaping, ``{% break %}``/``{% continue %}``, ``{% generation %}`` blocks, ``strftime_now``."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
