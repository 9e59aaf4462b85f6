"""The tool-call formats, one module each; importing this package registers them all (``base.register``).

A new format is one module here, a ``ToolFormat`` subclass decorated ``@register`` with its ``detects`` test
and ``detect_order``, and its line below (the order here is the order ``get_format``'s error lists them in).
"""

from ..base import FORMATS, ToolFormat, detect_format, get_format
from . import hermes, llama3, mistral, mistral_v11, deepseek, deepseek_v3_1, glm45, gemma, generic  # noqa: F401

__all__ = ["FORMATS", "ToolFormat", "detect_format", "get_format"]
