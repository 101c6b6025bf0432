"""Tool calls read from replies in each template format, whole and streamed, and requests' tools checked."""

import json

import pytest

from adaspark_core.serve.tool_calls import (
    AUTO,
    FORMATS,
    NONE,
    REQUIRED,
    ToolStream,
    format_of,
    openai_calls,
    prepare,
    read_tools,
    split_reply,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HERMES, MISTRAL, LLAMA3 = FORMATS["hermes"], FORMATS["mistral"], FORMATS["llama3"]


def test_the_template_tells_the_format():
    assert format_of('... <tool_call>\n{"name": <function-name>, ...') is HERMES
    assert format_of("{%- if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]") is MISTRAL
    assert format_of('... {"name": function name, "parameters": dictionary of argument name ...') is LLAMA3
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None


@pytest.mark.parametrize("fmt, text", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    (MISTRAL, 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_calls_after_text_are_read_and_the_text_is_the_content(fmt, text):
    content, calls = split_reply(text, fmt)
    assert content == "Let me look."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                     {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    out = openai_calls(calls)
    assert [c["type"] for c in out] == ["function", "function"] and len({c["id"] for c in out}) == 2
    assert json.loads(out[1]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("text", [
    '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```',  # Qwen2.5-Coder-1.5B's way
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '<function_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </function_call>',
])
def test_a_hermes_call_may_stand_bare_fenced_or_in_another_tag(text):
    assert split_reply("Sure.\n" + text, HERMES) == ("Sure.", [{"name": "get_weather", "arguments": {"city": "Paris"}}])


def test_a_llama3_reply_is_one_json_call():
    assert split_reply('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', LLAMA3) == (
        "", [{"name": "get_weather", "arguments": {"city": "Rome"}}])


@pytest.mark.parametrize("text", [
    "Paris is sunny today.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by the token budget
    '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> and then some text',
    '<tool_call>{"name": "get_weather", "arguments": {}, "extra": 1}</tool_call>',
    '```json\n{"name": "get_weather", "arguments": {}}\n',  # a fence never closed
    '```python\nprint({"name": 1})\n```',
])
def test_what_is_not_all_calls_is_content(text):
    assert split_reply(text, HERMES) == (text, [])


@pytest.mark.parametrize("fmt, text", [
    (HERMES, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (HERMES, "No call here, only a < sign and <tool_ and <tool_cal."),
    (HERMES, 'Code:\n```python\nx = {"a": 1}\n```\nDone.'),
    (HERMES, 'As JSON:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": '),
    (MISTRAL, 'On it [TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'),
])
def test_a_stream_lets_out_the_content_the_whole_reply_has_and_never_a_call(fmt, text):
    for size in (1, 2, 3, 7, len(text)):
        stream, out = ToolStream(fmt), ""
        for i in range(0, len(text), size):
            piece = stream.feed(text[i:i + size])
            assert fmt.call_start(out + piece) < 0 or fmt.parse((out + piece)[fmt.call_start(out + piece):]) is None
            out += piece
        rest, calls = stream.finish()
        assert (out + rest, calls) == split_reply(text, fmt) or (out + rest).rstrip() == split_reply(text, fmt)[0]
        assert calls == split_reply(text, fmt)[1]


class _Model:
    """What ``prepare`` asks of a model: its template (Hermes calls) and whether it takes tools."""

    chat_template = "{{ '<tool_call>' }}"

    def takes_tools(self):
        return True


def test_a_required_call_opens_the_reply_and_is_one_call_under_its_grammar():
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    plan = prepare(read_tools([WEATHER, other], REQUIRED), _Model())
    assert plan.reply_start == "<tool_call>\n" and plan.reply.suffix == "\n</tool_call>"
    assert [c["properties"]["name"] for c in plan.call_schema["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    named = prepare(read_tools([WEATHER, other], {"type": "function", "function": {"name": "get_time"}}), _Model())
    assert named.call_schema["properties"]["arguments"] == other["function"]["parameters"]
    auto = prepare(read_tools([WEATHER, other], AUTO), _Model())  # the model chooses; a call it opens is held
    assert auto.reply_start == "" and auto.call_schema == plan.call_schema and plan.opens is named.opens is None
    text = 'Let me check.\n```json\n{\n  "name": "get_time"'  # held from the call's brace on
    assert auto.opens(text) == text.index("{") and auto.opens('Let me check.\n```json\n{\n  "na') is None
    assert MISTRAL.value_start("[TOOL_CALLS]") == 12 and LLAMA3.value_start('<|python_tag|>{"name"') == 14
    assert MISTRAL.calls_schema([WEATHER["function"]])["type"] == "array"
    # the grammar takes a call of one of them and nothing else; the server closes it
    from conftest import SIM

    from adaspark_core.decode.grammar import Grammar
    from adaspark_core.engine.simlm import SimModel

    sim = SimModel(SIM)
    for text, ok in [('{"name":"get_time","arguments":{"zone":"CET"}}', True),
                     ('{"name":"get_time","arguments":{"zone":"PST"}}', False),
                     ('{"name":"get_time","arguments":{}}', False), ('{"name":"get_date","arguments":{}}', False)]:
        g = Grammar.for_schema(sim, plan.call_schema)
        assert g.matcher.validate_tokens(sim.tokenize(text)) == len(text) if ok else g.matcher.validate_tokens(
            sim.tokenize(text)) < len(text)
    stream = plan.reply.stream()
    assert stream.feed('{"name":"get_time","arguments":{"zone":"CET"}}') == ""
    assert stream.finish() == ("", [{"name": "get_time", "arguments": {"zone": "CET"}}])
    assert plan.reply.split('{"name":"get_time","arguments":{"zone":"CET"}}')[1] == stream.finish()[1]
    assert MISTRAL.opening + MISTRAL.closing == "[TOOL_CALLS][]" and LLAMA3.call_schema(
        [WEATHER["function"]])["required"] == ["name", "parameters"]


def test_tools_and_the_choice_are_checked():
    assert read_tools(None, None).choice == NONE and not read_tools([], "auto").on
    assert read_tools([WEATHER], None).choice == AUTO and read_tools([WEATHER], None).on
    assert read_tools([WEATHER], REQUIRED).forced is None
    named = read_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.forced == "get_weather" and named.on
    assert not read_tools([WEATHER], "none").on
    auto = {"type": "function", "function": {"name": "auto"}}  # a function may be named as a choice is
    assert read_tools([auto], {"type": "function", "function": {"name": "auto"}}).forced == "auto"
    bad = [
        ("x", None, "tools must be a list"),
        ([{"type": "function"}], None, "tools.0 must be"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "letters, digits"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "JSON schema object"),
        ([{"type": "function", "function": {"name": "f", "returns": {}}}], None, "not a field"),
        ([WEATHER, WEATHER], None, "a second function"),
        ([WEATHER], "always", "tool_choice must be"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, "not one of the tools"),
        (None, "required", "has no tools"),
    ]
    for tools, choice, message in bad:
        with pytest.raises(ValueError, match=message):
            read_tools(tools, choice)
