"""Tool calls: the request's tools checked, the model's output parsed back into OpenAI ``tool_calls``, and the
grammars that force a call (``tool_choice: required`` or a named function).

Each model family writes its calls its own way, and the format is read from its chat template as llama.cpp's
``common/chat.cpp`` does (first match wins; ``detect_format``), or named (``get_format``: a role or flag can
set it):

==================  ==========================================================================================
``hermes``          Qwen 2.5/3, Hermes 2/3: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one
                    block a call (vLLM ``hermes``, llama.cpp ``hermes_2_pro``)
``llama3``          Llama 3.1-3.3: ``{"name": "f", "parameters": {...}}`` at the start of the answer, after an
                    optional ``<|python_tag|>``; several joined by ``;`` (vLLM ``llama3_json``)
``mistral``         Mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]`` (Nemo, Small 3.1); the parser
                    reads the v11 form too
``mistral_v11``     Mistral's v11 tokenizers: ``[TOOL_CALLS]f[ARGS]{...}`` (Small 3.2 with ``[CALL_ID]``,
                    Magistral, Devstral)
``deepseek``        DeepSeek V3/R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f`` then the
                    arguments in a json fence; V3.1's ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}`` is read too
``deepseek_v3_1``   DeepSeek V3.1 (the same parser; its grammar writes V3.1's form)
``glm45``           GLM 4.5/4.6: ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>``
                    (values are raw text for string parameters, JSON otherwise; vLLM ``glm4_moe``)
``gemma``           Gemma's prompt convention: a ``tool_code`` fence holding Python calls, ``f(a=1)``, or a
                    bare list ``[f(a=1), g(b="x")]`` (vLLM ``pythonic``)
``generic``         any other template (Gemma 3, whose GGUF has none): JSON, ``{"tool_call": {"name": "f",
                    "arguments": {...}}}``, ``{"tool_calls": [...]}`` or ``{"response": "..."}`` (llama.cpp's
                    Generic); the grammar enforces it for ``auto`` too, as llama.cpp does
==================  ==========================================================================================

Parsing is a pure function of the whole text so far (``ToolFormat.parse``); streaming re-parses the
accumulated text after each piece and sends the difference (``ToolStream``), as llama.cpp does: content only
grows, a call is sent with its id and name once its name is complete, and its arguments grow as the model
writes them (the arguments' JSON text as the model wrote it, so each delta extends the last; formats whose
arguments are not JSON text send them whole when the call is complete).  Text that may still become a call

The package, by layer: ``types`` (Tool, ToolCall, Parsed, the request error), ``scan`` (the partial-JSON
scanner) and ``pycalls`` (Python call syntax), ``rules`` (GBNF composition), ``base`` (the abstract
``ToolFormat`` and the registry), ``formats/`` (one module per format), ``plan`` (a request's tools and
tool_choice checked, its format chosen), ``reasoning`` (the ``<think>`` block split off first, as llama-server's
``reasoning_format``) and ``stream`` (a choice's deltas and message as it streams).
"""

from .base import FORMATS, ToolFormat, detect_format, get_format
from .plan import ToolPlan, check_tool_choice, check_tools, plan
from .reasoning import FORMATS as REASONING_FORMATS, Reasoning, forced_opening, template_tags
from .stream import ChoiceOutput, ToolStream, output_text, preserved_tokens
from .types import Parsed, Tool, ToolCall, ToolRequestError
from . import formats  # noqa: F401  (registers every format)

__all__ = ["FORMATS", "REASONING_FORMATS", "ChoiceOutput", "Parsed", "Reasoning", "Tool", "ToolCall", "ToolFormat",
           "ToolPlan", "ToolRequestError", "ToolStream", "check_tool_choice", "check_tools", "detect_format",
           "forced_opening", "get_format", "output_text", "plan", "preserved_tokens", "template_tags"]
