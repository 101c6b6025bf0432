"""Structured output through ``adaspark serve``: ``response_format`` json_schema and json_object,
plain and streamed (the simulated model); OpenAI's own structured-output example,
``chat.completions.parse`` and ``stream`` with a pydantic model, unchanged against the default
model, two requests decoded together; and every malformed response_format one 400 naming it."""

import json
import signal

import jsonschema
import pytest
from conftest import SIM
from helpers import Server, chat_body, stream_events

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 16},
                         "days": {"type": "array", "maxItems": 2, "items": {"type": "string", "enum": ["mon", "tue"]}},
                         "sunny": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def sim_server():
    srv = Server("--model", SIM)
    yield srv
    assert srv.stop() == 128 + signal.SIGTERM and "Traceback" not in srv.stderr, srv.stderr


def _streamed_text(srv, body) -> tuple[str, str]:
    text, finish = "", None
    with srv.http.stream("POST", "/v1/chat/completions", content=json.dumps({**body, "stream": True})) as r:
        assert r.status_code == 200
        for data in stream_events(r.iter_lines()):
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish


def test_a_json_schema_reply_follows_the_schema_plain_and_streamed(sim_server):
    body = chat_body("The weather, please.", response_format=FORMAT, max_tokens=200)
    r = sim_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    assert _streamed_text(sim_server, body) == (choice["message"]["content"], "stop")


def test_a_json_object_reply_is_an_object_or_cut_by_its_cap(sim_server):
    r = sim_server.post("/v1/chat/completions", chat_body("Anything.", response_format={"type": "json_object"},
                                                           max_tokens=30))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].startswith("{")  # any object: the sim model writes one long key
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, "must be"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA, "extra": 1}}, "no field extra"),
    ({"type": "json_schema", "json_schema": {"name": "f", "schema": [1]}}, "schema must be a JSON object"),
    ({"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": "no-such-type"}}}, "cannot be compiled"),
    ({"type": "json_object", "schema": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
])
def test_a_malformed_response_format_is_one_400_naming_it(sim_server, fmt, words):
    r = sim_server.post("/v1/chat/completions", chat_body("x", response_format=fmt))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert words in r.json()["error"]["message"]
    assert sim_server.post("/v1/chat/completions", chat_body("x", max_tokens=2)).status_code == 200  # still serving


def test_json_and_tools_together_are_refused(sim_server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = sim_server.post("/v1/chat/completions", chat_body("x", response_format=FORMAT, tools=[tool]))
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]


@pytest.mark.model
def test_openai_structured_output_example_works_unchanged_plain_and_streamed(tmp_path):
    """OpenAI's documented example: a pydantic model as response_format, ``parse`` and ``stream``,
    sent at once to a server decoding two requests together."""
    from concurrent.futures import ThreadPoolExecutor

    from pydantic import BaseModel

    class CalendarEvent(BaseModel):
        name: str
        date: str
        participants: list[str]

    messages = [{"role": "system", "content": "Extract the event information."},
                {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."}]
    srv = Server("--store", tmp_path / "store.json", "--log", tmp_path / "rounds.jsonl", "--parallel", 2)
    client = srv.client()

    def parse():
        return client.chat.completions.parse(model="m", messages=messages, response_format=CalendarEvent,
                                             max_tokens=120)

    def stream():
        with client.chat.completions.stream(model="m", messages=messages, response_format=CalendarEvent,
                                            max_tokens=120) as events:
            for _ in events:
                pass
            return events.get_final_completion()

    try:
        with ThreadPoolExecutor(2) as pool:
            done, final = (f.result() for f in [pool.submit(parse), pool.submit(stream)])
        event = done.choices[0].message.parsed
        assert isinstance(event, CalendarEvent) and done.choices[0].finish_reason == "stop"
        assert final.choices[0].message.parsed == event
    finally:
        assert srv.stop() == 128 + signal.SIGTERM and "Traceback" not in srv.stderr, srv.stderr
    from adaspark_core.store.record import read_log

    records = list(read_log(tmp_path / "rounds.jsonl"))
    assert all(r.constrained for r in records) and any(r.step is not None for r in records)  # together
