"""What tool calling speaks in: a request's tool, a call the model made, a parsed message, and the error
that names the request field it is about.  Every other module of the package shares these."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidParameterError

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (dots too, as llama.cpp accepts)


class ToolRequestError(InvalidParameterError):
    """A request's tools or tool_choice that cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None



@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text of an object (OpenAI's shape)."""

    name: str
    arguments: str
    done: bool = True  # False: a streamed parse caught it midway (arguments may still grow)


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ToolCall, ...] = ()
