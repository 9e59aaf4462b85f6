"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as llama-server offers it:
translated onto a chat request (``chat_body``, after llama-server's ``server_chat_convert_anthropic_to_oai``), so
it runs the same template, tools, reasoning split, grammar, limits and speculation as ``/v1/chat/completions``.
The answer is shaped back by ``anthropic_shape``.

Taken: ``system`` (a string or text blocks), ``messages`` (text, ``thinking``, ``tool_use`` and ``tool_result``
blocks, ``tool_result``'s ``is_error`` and ``cache_control`` accepted: the prefix cache is automatic here),
``max_tokens`` (4096 when left out, as llama-server), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``,
``stream``, ``tools`` (custom tools), ``tool_choice``, ``thinking``, ``metadata.user_id`` (the request's
``user``, which routes sessions) and, as the Responses API does, every chat field (``seed``, ``speculative``,
``chat_template_kwargs`` ...).  Images (``image`` blocks) are a 400 in llama-server's words, "image input is not
supported": this server serves text only.  Anything else is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from .responses import ApiError
from .schema import ChatRequest, field_path

# Anthropic fields turned into chat fields here; every other field goes to the chat request as it is
OWN = ("system", "messages", "max_tokens", "stop_sequences", "tools", "tool_choice", "thinking", "metadata",
       "service_tier")
# A chat field's error named as the Anthropic field it came from
RENAMED = {"stop": "stop_sequences", "user": "metadata.user_id", "messages": "messages"}
DEFAULT_MAX_TOKENS = 4096  # llama-server's when a request leaves max_tokens out (Anthropic requires it)
# llama-server's words (server-common.cpp), which its tests look for; as a 400, the request's fault (llama-server
# answers 500, which tells a client to retry what can never succeed; /v1/chat/completions refuses an image with 400)
NO_IMAGES = ("image input is not supported - hint: this server serves text only (no multimodal projector); "
             "send text blocks")


def _refuse(field: str, why: str) -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field)


def _no_image(where: str) -> ApiError:
    """An image block: a 400 naming where it is, in llama-server's words for a text model's image."""
    return ApiError(400, NO_IMAGES, param=where)


def billing_header(text: str) -> str:
    """Claude Code's ``x-anthropic-billing-header`` system prompt with its per-request ``cch=`` stamp as
    ``fffff``, as llama-server writes it: the stamp changes on every request and would stop prefix reuse at it."""
    prefix = "x-anthropic-billing-header:"
    if not text.startswith(prefix):
        return text
    at = text.find("cch=", len(prefix))
    if at < 0 or at + 9 >= len(text) or text[at + 9] != ";":
        return text
    return text[:at + 4] + "fffff" + text[at + 9:]


def _system(system: Any) -> str:
    if isinstance(system, str):
        return billing_header(system)
    if not isinstance(system, list):
        raise _refuse("system", "must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _refuse(f"system[{i}]", "must be a text block {\"type\": \"text\", \"text\": ...}")
        texts.append(billing_header(block["text"]))
    return "".join(texts)


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _refuse(f"{where}.text", "a text block needs its text (a string)")
    return block["text"]


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_result`` block as the tool message answering its call (text blocks joined, as llama-server)."""
    if not isinstance(block.get("tool_use_id"), str):
        raise _refuse(f"{where}.tool_use_id", "a tool_result needs the id of the tool_use it answers")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                raise _no_image(f"{where}.content[{j}]")
            if kind != "text":
                raise _refuse(f"{where}.content[{j}]", "a tool_result's content holds text blocks")
            parts.append(_text(part, f"{where}.content[{j}]"))
        text = "".join(parts)
    else:
        raise _refuse(f"{where}.content", "must be a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _refuse(where, "a tool_use block needs its id and name (strings)")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise _refuse(f"{where}.input", "must be an object (the tool's arguments)")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _blocks(role: str, content: list[Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message's blocks as chat messages: the tool results first (each its tool message, right after
    the assistant's calls as templates expect), then the turn's text, thinking and calls as one message."""
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking = ""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            raise _no_image(at)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thinking += block.get("thinking", "") if isinstance(block.get("thinking"), str) else ""
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        else:
            raise _refuse(at, f"a {role} message's block of type {kind!r} is not supported (text, image, and "
                          f"{'thinking and tool_use' if role == 'assistant' else 'tool_result'} are)")
    if not (texts or calls or thinking):
        return results
    msg: dict[str, Any] = {"role": role, "content": texts or ""}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = thinking
    return results + [msg]


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _refuse("messages", "must be a list of {\"role\": \"user\" or \"assistant\", \"content\": ...}")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise _refuse(f"{where}.role", "must be user or assistant (the system prompt goes in system)")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(msg["role"], content, where)
        else:
            raise _refuse(f"{where}.content", "must be a string or a list of content blocks")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _refuse("tools", "must be a list of tools {name, description, input_schema}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _refuse(f"tools[{i}].type", f"only custom tools (name, description, input_schema) exist here "
                          f"({kind!r} is a server tool this server does not have)")
        if not isinstance(tool.get("name"), str):
            raise _refuse(f"tools[{i}].name", "a tool needs its name")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    """Anthropic's ``tool_choice`` as chat's: auto, any (required), tool (that one), none; its
    ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise _refuse("tool_choice", "must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                      "{\"type\": \"tool\", \"name\": NAME}")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _thinking(thinking: Any, chat: dict[str, Any]) -> int | None:
    """``thinking`` as the template's ``enable_thinking`` (a template that has none ignores it); the budget is
    returned for ``check_budget``, which needs the role's template."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _refuse("thinking.type", "must be enabled, disabled or adaptive")
    kwargs = dict(chat.get("chat_template_kwargs") or {})
    if kind != "adaptive":
        kwargs.setdefault("enable_thinking", kind == "enabled")
    chat["chat_template_kwargs"] = kwargs
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                                                     or budget < 1):
        raise _refuse("thinking.budget_tokens", "must be a positive integer")
    return budget if kind == "enabled" else None


def check_budget(budget: int | None, max_tokens: int, thinks: bool) -> None:
    """A thinking budget is honoured where nothing can exceed it: a model whose template does not think, or a budget
    no smaller than max_tokens.  Otherwise a 400: no budget is enforced apart from max_tokens here."""
    if budget is not None and thinks and budget < max_tokens:
        raise _refuse("thinking.budget_tokens", f"a thinking budget below max_tokens ({budget} < {max_tokens}) is "
                      "not enforced by this server; bound the whole answer with max_tokens, or leave the budget out")


def _metadata(metadata: Any, chat: dict[str, Any]) -> None:
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise _refuse("metadata", "must be {\"user_id\": ...}")
    if metadata.get("user_id") is not None:
        chat["user"] = metadata["user_id"]


def chat_body(body: Any) -> tuple[dict[str, Any], int | None]:
    """An Anthropic request as the chat request that runs it, and its thinking budget (``check_budget``)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "messages" not in body:
        raise _refuse("messages", "is required")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _refuse("service_tier", "there is one tier here: send auto or standard_only, or leave it out")
    chat = {k: v for k, v in body.items() if k not in OWN}
    messages = _messages(body["messages"])
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _system(body["system"])})
    chat["messages"] = messages
    chat["max_tokens"] = body["max_tokens"] if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise _refuse("stop_sequences", "must be a list of strings")
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    budget = _thinking(body["thinking"], chat) if body.get("thinking") is not None else None
    if body.get("metadata") is not None:
        _metadata(body["metadata"], chat)
    if chat.get("n", 1) != 1 or chat.get("n_cmpl", 1) != 1:
        raise _refuse("n", "a message is one answer: send one request per answer")
    return chat, budget


def chat_request(body: Any) -> tuple[Any, int | None]:
    """``chat_body`` validated as a chat request (and the thinking budget); a schema error names the Anthropic field
    it came from.  No messages at all is taken, as llama-server takes it: the template renders an empty chat."""
    chat, budget = chat_body(body)
    empty = not chat["messages"]
    try:
        request = ChatRequest.model_validate({**chat, "messages": [{"role": "user", "content": ""}]} if empty else chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_path(tuple(first.get("loc", ()))) or "body"
        top = param.split(".")[0].split("[")[0]
        if top in RENAMED:
            param = RENAMED[top] if top != "messages" else "messages"
        if first.get("type") == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        raise ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param) from None
    if empty:
        request.messages = []  # validated with a stand-in: the schema's one-message minimum is OpenAI's
    return request, budget
