"""OpenAI's API as ``adaspark serve`` reads and writes it (adaspark_core/serve/openai_api.py), and the
stop-string cut every served reply goes through (adaspark_core/serve/service.py)."""

from collections import Counter

import orjson
import pytest

from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.generation import Stats
from adaspark_core.serve import openai_api as api
from adaspark_core.serve.service import Reply, StopStrings
from adaspark_core.serve.stdin_api import RequestError, parse_request


def parse(chat=True, **body):
    return api.parse(orjson.dumps(body), chat)


USER = [{"role": "user", "content": "hi"}]


def test_a_chat_request_as_clients_send_it():
    r = parse(model="anything", messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "h"},
                                                                       {"type": "text", "text": "i"}]}],
              max_tokens=20, stop="\n", seed=3, temperature=0, top_p=0.9, n=1, stream=True,
              stream_options={"include_usage": True}, user="u1", presence_penalty=0)
    assert r.chat and r.prompt is None and r.max_tokens == 20 and r.stops == ("\n",)
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert r.sampling is None  # temperature 0: greedy, the top_p and seed change nothing
    assert r.stream and r.include_usage
    assert parse(messages=USER).max_tokens is None  # a chat reply runs to its end token
    assert parse(messages=USER, max_completion_tokens=7).max_tokens == 7


def test_a_sampled_request_carries_its_sampler_settings():
    r = parse(messages=USER, temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, seed=11)
    assert r.sampling == Sampling(0.7, 0.95, 40, 0.05, 11)
    assert "temperature 0.7" in r.sampling.describe() and "top_k 40" in r.sampling.describe()
    # the server's default temperature applies to a request that sets none
    assert api.parse(orjson.dumps({"messages": USER}), True, default_temperature=0.8).sampling.temperature == 0.8
    assert api.parse(orjson.dumps({"messages": USER, "temperature": 0}), True, 0.8).sampling is None


def test_a_completion_request_takes_text_or_token_ids():
    assert parse(False, prompt="Once").prompt == "Once"
    assert parse(False, prompt=["Once"]).prompt == "Once"
    assert parse(False, prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert parse(False, prompt=[[1, 2]]).prompt == [1, 2]
    assert parse(False, prompt="x").max_tokens == api.COMPLETION_DEFAULT_MAX_TOKENS
    assert parse(False, prompt="x", stop=["a", "bc"]).stops == ("a", "bc")


@pytest.mark.parametrize("chat, body, param, words", [
    (True, b"{not json", None, "not valid JSON"),
    (True, b"[1]", None, "must be a JSON object"),
    (True, {"messages": USER, "temprature": 0.5}, "temprature", "unknown field temprature"),
    (True, {"messages": USER, "prompt": "x"}, "prompt", "unknown field prompt"),
    (False, {"prompt": "x", "messages": USER}, "messages", "unknown field messages"),
    (True, {}, "messages", "non-empty list"),
    (True, {"messages": "hi"}, "messages", "non-empty list"),
    (True, {"messages": [{"role": "robot", "content": "x"}]}, "messages", "role must be"),
    (True, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "content must be text"),
    (True, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "tool_calls"),
    (True, {"messages": USER, "max_tokens": 0}, "max_tokens", "must be at least 1"),
    (True, {"messages": USER, "max_tokens": "5"}, "max_tokens", "integer from 1 to"),
    (True, {"messages": USER, "max_tokens": True}, "max_tokens", "integer from 1 to"),
    (True, {"messages": USER, "max_tokens": 2.5}, "max_tokens", "integer from 1 to"),
    # too large is said so: past 2^31, and past 64 bits, where JSON's integer arrives as a float
    (True, {"messages": USER, "max_tokens": 2 ** 31}, "max_tokens", "must be at most 2147483647"),
    (True, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %d}' % 2 ** 70, "max_tokens",
     "must be at most 2147483647"),
    (True, {"messages": USER, "max_completion_tokens": 2 ** 40}, "max_completion_tokens", "must be at most"),
    (False, {"prompt": "x", "max_tokens": -3}, "max_tokens", "must be at least 1"),
    (True, {"messages": USER, "temperature": 3}, "temperature", "from 0 to 2"),
    (True, {"messages": USER, "temperature": "hot"}, "temperature", "number"),
    (True, {"messages": USER, "top_p": 1.5}, "top_p", "from 0 to 1"),
    (True, {"messages": USER, "seed": 1.5}, "seed", "integer"),
    (True, {"messages": USER, "stream": "yes"}, "stream", "true or false"),
    (True, {"messages": USER, "stop": ""}, "stop", "non-empty string"),
    (True, {"messages": USER, "stop": [1]}, "stop", "non-empty string"),
    (True, {"messages": USER, "n": 2}, "n", "one choice"),
    (True, {"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty", "penalties"),
    (True, {"messages": USER, "logprobs": True}, "logprobs", "log probabilities"),
    (True, {"messages": USER, "tools": [{"type": "function"}]}, "tools", "tools.0 must be"),
    (True, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    (True, {"messages": USER, "model": 3}, "model", "model must be text"),
    (False, {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    (False, {"prompt": ""}, "prompt", "non-empty text"),
    (False, {"prompt": [-1]}, "prompt", "token ids"),
    (False, {"prompt": "x", "echo": True}, "echo", "reply alone"),
    (False, {"prompt": "x", "best_of": 3}, "best_of", "one candidate"),
])
def test_bad_requests_are_refused_naming_the_field(chat, body, param, words):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(api.APIError, match=words) as e:
        api.parse(raw, chat)
    assert e.value.status == 400 and e.value.param == param
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def reply(text="Hello", finish="stop", generated=3, sampling=None):
    st = Stats(rounds=2, widths=Counter({1: 1, 3: 1}), accepted=Counter({0: 1, 1: 1}), deltas=[(generated, 0.5)])
    return Reply(text, finish, 10, 4, st, "adaspark" if sampling is None else "ar", sampling)


def test_responses_and_chunks_are_shaped_as_openai_shapes_them():
    env = api.Envelope.new("m.gguf", chat=True)
    r = env.response(reply())
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") and r["model"] == "m.gguf"
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}]
    assert r["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    ext = r[api.EXTENSION]
    assert ext["prompt_reused"] == 4 and ext["widths"] == {"1": 1, "3": 1} and ext["tokens_per_round"] == 1.5
    assert ext["decoding"].startswith("greedy")
    assert env.chunk("He", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert env.chunk("llo")["choices"][0]["delta"] == {"content": "llo"}
    last = env.last_chunk(reply(finish="interrupted"))
    assert last["object"] == "chat.completion.chunk" and last["choices"][0]["finish_reason"] == "interrupted"
    assert env.usage_chunk(reply())["choices"] == [] and env.usage_chunk(reply())["usage"]["total_tokens"] == 13
    text = api.Envelope.new("m.gguf", chat=False)
    t = text.response(reply(finish="context", sampling=Sampling(0.7)))
    assert t["object"] == "text_completion" and t["id"].startswith("cmpl-")
    assert t["choices"][0]["text"] == "Hello" and t["choices"][0]["finish_reason"] == "length"
    assert t[api.EXTENSION]["finish"] == "context" and "sampled (temperature 0.7)" in t[api.EXTENSION]["decoding"]
    assert text.chunk("x")["choices"][0]["text"] == "x"


def feed_all(stops, pieces):
    scan = StopStrings(stops)
    out = [scan.feed(p) for p in pieces]
    return out, scan.flush(), scan.hit, scan.text


def test_a_stop_string_cuts_the_reply_even_across_pieces_and_is_never_shown():
    out, rest, hit, text = feed_all(["END"], ["Hello E", "N", "D and more"])
    assert out == ["Hello ", "", ""] and rest == "" and hit and text == "Hello "
    out, rest, hit, text = feed_all(["\n\n", "###"], ["a\n", "b##", "c"])
    assert "".join(out) + rest == "a\nb##c" and not hit
    assert out[1] == "\nb"  # "\n" was held until "b" showed it begins no stop string
    out, rest, hit, text = feed_all(["xyz"], ["ab x"])
    assert out == ["ab "] and rest == "x" and not hit  # held to the end, then given back
    assert feed_all([], ["a", "b"])[0] == ["a", "b"]
    out, rest, hit, text = feed_all(["b", "abc"], ["zab"])
    assert text == "za" and hit  # the earliest stop string wins


def test_serve_stdin_says_which_bound_a_reply_cap_breaks():
    with pytest.raises(RequestError, match="max_tokens must be at most 2147483647"):
        parse_request(b'{"prompt": "a", "max_tokens": %d}' % 2 ** 70, 64, 1)
    with pytest.raises(RequestError, match="max_tokens must be at least 1"):
        parse_request(b'{"prompt": "a", "max_tokens": -1}', 64, 1)
