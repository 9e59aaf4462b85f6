"""Reasoning parsed as llama-server's (issue 41 item 3): a thinking model's ``<think>`` block split off into
``reasoning_content`` by ``reasoning_format`` (request) or ``--reasoning-format`` (server, role key), thinking
"forced open" by a template whose generation prompt opens the block, and tool calls read from the content only.

The pure splitter and streams on texts first; then over HTTP on the real Gemma 3 270M served with DeepSeek-R1's
template (its generation prompt ends ``<｜Assistant｜><think>\\n``), the output forced by a ``grammar`` so that the
thinking and the answer are known exactly; speculation stays lossless (the same tokens as plain decoding).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from specstack.server.tools import Reasoning, ToolStream, forced_opening, plan, template_tags

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
R1 = FIXTURES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
QWEN3 = FIXTURES / "Qwen-Qwen3-0.6B.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _stream(stream: ToolStream, text: str, step: int = 3) -> list[dict]:
    """Feed ``text`` in pieces of ``step`` characters, then finish: every delta sent."""
    out = []
    for i in range(step, len(text) + step, step):
        out += stream.update(text[:i])
    return out + stream.update(text, final=True)


def _joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key, "") for d in deltas)


# -- the splitter -------------------------------------------------------------------------------------------

def test_templates_show_their_tags_and_whether_they_open_the_block():
    assert template_tags(R1.read_text()) == ("<think>", "</think>")
    assert template_tags(QWEN3.read_text()) == ("<think>", "</think>")
    assert template_tags((FIXTURES / "google-gemma-2-2b-it.jinja").read_text()) is None
    assert template_tags("{{ '[THINK]' }}...{{ '[/THINK]' }}") == ("[THINK]", "[/THINK]")
    assert forced_opening("<｜User｜>hi<｜Assistant｜><think>\n", "<think>") == "<think>\n"
    # Qwen3 with enable_thinking false closes the block in the prompt: the output is the answer
    assert forced_opening("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>") == ""
    assert forced_opening("<|im_start|>assistant\n", "<think>") == ""


@pytest.mark.parametrize("opening", ["", "<think>\n"])
def test_each_format_returns_the_block_as_llama_server_does(opening):
    text = ("" if opening else "<think>\n") + "Two and two make four.\n</think>\n\nIt is 4."
    whole = opening + text
    deepseek = Reasoning("<think>", "</think>", "deepseek", opening).split(text)
    assert (deepseek.reasoning, deepseek.content) == ("Two and two make four.", "It is 4.")
    assert Reasoning("<think>", "</think>", "auto", opening).split(text) == deepseek
    legacy = Reasoning("<think>", "</think>", "deepseek-legacy", opening).split(text)
    assert legacy.reasoning == deepseek.reasoning and legacy.head + legacy.content == whole
    none = Reasoning("<think>", "</think>", "none", opening).split(text)
    assert (none.reasoning, none.content) == ("", whole)  # left whole, the prompt's <think> with it


def test_a_block_never_closed_is_thinking_and_text_without_one_is_content():
    r = Reasoning("<think>", "</think>", "auto", "<think>\n")
    assert (r.split("cut short by max_tok").reasoning, r.split("cut short by max_tok").content) == \
        ("cut short by max_tok", "")
    free = Reasoning("<think>", "</think>", "auto")
    assert free.split("Just the answer.").content == "Just the answer."
    assert free.split("  <think>a</think> b").content == "b"
    # while the text may still open a block, nothing is content yet
    assert free.split("<thi", partial=True).content == "" and free.split("<thi").content == "<thi"
    assert free.split("<think>x</thi", partial=True).reasoning == "x"  # the tail that may be </think> waits


def test_a_stream_sends_reasoning_deltas_then_content_and_the_same_message():
    text = "Two and two\nmake four.</think>\n\nIt is 4."
    s = ToolStream(None, reasoning=Reasoning("<think>", "</think>", "deepseek", "<think>\n", stream=True))
    deltas = _stream(s, text)
    assert _joined(deltas, "reasoning_content") == "Two and two\nmake four."
    assert _joined(deltas, "content") == "It is 4."
    assert not any("</" in d.get("reasoning_content", "") for d in deltas)
    assert s.message() == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two and two\nmake four."}
    # deepseek-legacy streams keep the thinking inline (llama-server's reasoning_in_content)
    legacy = ToolStream(None, reasoning=Reasoning("<think>", "</think>", "deepseek-legacy", "<think>\n", stream=True))
    deltas = _stream(legacy, text)
    assert not _joined(deltas, "reasoning_content") and _joined(deltas, "content") == "<think>\n" + text


def test_a_call_written_while_thinking_is_not_a_call():
    """Hermes calls (Qwen3): the call in the think block stays reasoning; the one after it is the call."""
    p = plan(TOOLS, "auto", None, QWEN3.read_text())
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    text = f"<think>\nMaybe {call % 'Oslo'}? No, Paris.\n</think>\n\n{call % 'Paris'}"
    for stream in (False, True):
        s = ToolStream(p, reasoning=Reasoning("<think>", "</think>", "auto", stream=stream))
        deltas = _stream(s, text) if stream else s.update(text, final=True)
        msg = s.message()
        assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris"}]
        assert "Oslo" in msg["reasoning_content"] and msg["content"] is None
        assert "Oslo" not in json.dumps([d.get("tool_calls") for d in deltas])
    # without the split (reasoning_format none) the call in the thinking is the one read
    s = ToolStream(p)
    s.update(text, final=True)
    assert json.loads(s.message()["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_roles_take_the_reasoning_keys(tmp_path):
    from specstack.errors import InvalidParameterError
    from specstack.server.jobs import template_kwargs
    from specstack.server.roles import Role, load_roles

    roles = tmp_path / "roles.toml"
    roles.write_text('[roles.a]\nreasoning_format = "deepseek-legacy"\nreasoning = "off"\n')
    role = load_roles(roles)[0]
    assert (role.reasoning_format, role.reasoning) == ("deepseek-legacy", "off")

    class Body:
        chat_template_kwargs = None
        reasoning_effort = None

    assert template_kwargs(Body(), role) == {"enable_thinking": False}
    Body.chat_template_kwargs = {"enable_thinking": True}  # the request's own wins
    assert template_kwargs(Body(), role) == {"enable_thinking": True}
    with pytest.raises(InvalidParameterError, match="reasoning_format must be one of none, auto, deepseek"):
        Role(name="b", reasoning_format="r1")


def test_serve_flags_set_the_role_s_reasoning():
    from test_cli_hardening import serve_roles

    role = serve_roles("--reasoning-format", "none", "-rea", "off", "--reasoning-budget", "-1")[0]
    assert (role.reasoning_format, role.reasoning) == ("none", "off")
    assert serve_roles("--reasoning", "on")[0].reasoning == "on"
    assert serve_roles()[0].reasoning_format is None


# -- over HTTP ----------------------------------------------------------------------------------------------

THOUGHT, ANSWER = "Two and two make four.", "It is 4."
GRAMMAR = f'root ::= "{THOUGHT}" "</think>" "\\n\\n" "{ANSWER}"'
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def r1():
    from test_gemma import _gemma_path
    from test_serve import Server

    from specstack.server.app import Limits, create_app
    from specstack.server.roles import Role

    thinking = Role(name="r1", model=_gemma_path(), ctx=1024, parallel=1, chat_template=str(R1), exact="on",
                    threads=1)
    legacy = Role(name="legacy", model=_gemma_path(), ctx=1024, parallel=1, chat_template=str(R1), exact="on",
                  threads=1, reasoning_format="deepseek-legacy")
    with Server(create_app([thinking, legacy], Limits(max_tokens=64))) as s:
        yield s


def _ask(server, **fields) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "r1", "messages": ASK, "max_tokens": 32, "temperature": 0, "grammar": GRAMMAR,
                         **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_r1_template_forces_thinking_open_and_each_format_answers_as_llama_server(r1):
    auto = _ask(r1)["choices"][0]["message"]
    assert auto == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    assert _ask(r1, reasoning_format="deepseek")["choices"][0]["message"] == auto
    none = _ask(r1, reasoning_format="none")["choices"][0]["message"]
    assert none == {"role": "assistant", "content": f"<think>\n{THOUGHT}</think>\n\n{ANSWER}"}
    legacy = _ask(r1, reasoning_format="deepseek-legacy")["choices"][0]["message"]
    assert legacy == {**none, "reasoning_content": THOUGHT}
    # the role's reasoning_format (serve --reasoning-format) where the request gives none; the request's wins
    assert _ask(r1, model="legacy")["choices"][0]["message"] == legacy
    assert _ask(r1, model="legacy", reasoning_format="auto")["choices"][0]["message"] == auto
    # /completion is not parsed, as llama-server's
    raw = httpx.post(r1.url + "/completion", json={"prompt": "Q: 2+2?", "n_predict": 32, "grammar": GRAMMAR,
                                                   "reasoning_format": "deepseek"}, timeout=120).json()
    assert raw["content"] == f"{THOUGHT}</think>\n\n{ANSWER}"


def test_a_model_that_never_closes_the_block_thinks_all_of_it(r1):
    """Free output (Gemma never writes </think>): everything is reasoning, the content empty."""
    r = _ask(r1, grammar=None, max_tokens=12)
    msg = r["choices"][0]["message"]
    assert msg["content"] == "" and msg["reasoning_content"] and r["choices"][0]["finish_reason"] == "length"
    plain = _ask(r1, grammar=None, max_tokens=12, reasoning_format="none")["choices"][0]["message"]["content"]
    assert plain.startswith("<think>\n") and plain[len("<think>\n"):].strip() == msg["reasoning_content"]


def test_streams_send_reasoning_deltas_and_speculation_stays_lossless(r1):
    client = openai.OpenAI(base_url=r1.url + "/v1", api_key="none", max_retries=0)

    def stream(drafter: str, **extra) -> tuple[str, str]:
        chunks = client.chat.completions.create(model="r1", messages=ASK, max_tokens=32, temperature=0, stream=True,
                                                extra_body={"grammar": GRAMMAR, "speculative": {"drafter": drafter},
                                                            **extra})
        reasoning, content = "", ""
        for chunk in chunks:
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
        return reasoning, content

    assert stream("none") == stream("prompt-lookup") == (THOUGHT, ANSWER)
    assert stream("none", reasoning_format="deepseek-legacy") == ("", f"<think>\n{THOUGHT}</think>\n\n{ANSWER}")

    def tokens(drafter: str, grammar: str | None) -> tuple[list[str], dict, dict]:
        # fixed k: every step drafts, whatever the cost policy learnt earlier in the session would decline (on the
        # AVX2 build, after other tests' generations, it drafted none of these 24 tokens in one suite run of three)
        speculative = {"drafter": drafter} if drafter == "none" else {"drafter": drafter, "k_policy": "fixed", "k": 4}
        r = _ask(r1, grammar=grammar, logprobs=True, max_tokens=24, speculative=speculative)
        return [t["token"] for t in r["choices"][0]["logprobs"]["content"]], r["choices"][0]["message"], \
            r["speculative"]

    for grammar in (GRAMMAR, None):  # the split reshapes the text only: the tokens are plain decoding's
        plain = tokens("none", grammar)
        for drafter in ("prompt-lookup", "suffix"):
            spec = tokens(drafter, grammar)
            assert spec[:2] == plain[:2], (drafter, grammar)
    assert tokens("prompt-lookup", GRAMMAR)[2]["n_accepted"] > 0


def test_enable_thinking_and_reasoning_off_reach_the_template():
    """Qwen3's template closes the block in the prompt when enable_thinking is false: a role's reasoning off
    (serve --reasoning off) renders it so; a request's chat_template_kwargs wins."""
    from specstack.server.chat import load_template
    from specstack.server.jobs import chat_prompt
    from specstack.server.roles import Role
    from specstack.server.schema import ChatRequest

    class Backend:
        def __init__(self, role):
            self.role, self.template = role, load_template(None, str(QWEN3))

    body = ChatRequest.model_validate({"messages": ASK})
    off = Backend(Role(name="q", chat_template=str(QWEN3), reasoning="off"))
    assert chat_prompt(body, off).text.endswith("<think>\n\n</think>\n\n")
    assert not chat_prompt(body, Backend(Role(name="q", chat_template=str(QWEN3)))).text.endswith("</think>\n\n")
    on = ChatRequest.model_validate({"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}})
    assert not chat_prompt(on, off).text.endswith("</think>\n\n")
