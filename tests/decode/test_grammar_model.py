"""Decoding under a grammar on the real default model: every emitted token is the target's argmax
over the tokens the grammar allows, checked against a re-score of the reply (near ties aside), for
every arm, under a lazy grammar (a tool call under ``auto``) too; and the structured-output fuzz: replies to 200 seeded schemas (tests/schema_fuzz.py)
all parse and validate."""

import json

import numpy as np
import pytest
from helpers import NEAR_TIE
from schema_fuzz import max_chars, schemas, validate

from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.grammar import Grammar, LazyGrammar
from adaspark_core.engine.llama_sequence import score
from adaspark_core.serve.tool_calls import FORMATS

pytestmark = pytest.mark.model

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}}}}


def _ask(lm, schema: dict, text: str) -> list[int]:
    return lm.chat_prompt([{"role": "user", "content": f"{text}\nReply with JSON matching this schema: "
                                                       f"{json.dumps(schema)}"}])


def _check_constrained(lm, schema, prompt, reply, finish) -> int:
    """Every token of ``reply`` is the argmax of a re-score over the tokens the grammar allows after
    the reply before it, except near ties (counted, returned); a stopped reply's end is allowed and
    the argmax there."""
    logits = score(lm, prompt + reply)
    g = Grammar.for_schema(lm, schema)
    near = 0
    for i, tok in enumerate(reply + ([None] if finish == "stop" else [])):
        g.compute_mask()
        allowed = g.allowed()
        row = np.where(allowed, logits[len(prompt) + i - 1], -np.inf)
        best = int(np.argmax(row))
        if tok is None:
            assert lm.is_eog(best) or row[best] - max(row[t] for t in g.ends) < NEAR_TIE, "stopped off the argmax"
            break
        assert allowed[tok], f"token {i} ({lm.piece(tok)!r}) is not allowed by the grammar"
        if tok != best:
            assert row[best] - row[tok] < NEAR_TIE, f"token {i}: emitted {tok}, constrained argmax {best}"
            near += 1
        g.commit([tok])
    return near


@pytest.mark.parametrize("arm", ["ar", "chain:3", "tree:16", "adaspark"])
def test_every_emitted_token_is_the_constrained_argmax(lm, target, arm):
    prompt = _ask(lm, PERSON, "John Smith is 42, lives in Paris and likes chess, cycling and jazz.")
    gen = Generation(target, prompt, parse_arm(arm), 120, grammar=Grammar.for_schema(lm, PERSON))
    for _ in gen:
        pass
    assert gen.finish == "stop"
    reply = b"".join(map(lm.piece, gen.tokens)).decode()
    validate(json.loads(reply), PERSON)
    assert _check_constrained(lm, PERSON, prompt, gen.tokens, gen.finish) <= 1


def test_structured_output_fuzz_every_reply_parses_and_validates(lm, target):
    """200 seeded schemas, each asked once (greedy, adaspark, one learner set across them as a
    server has): 100% of the replies are JSON that follows the schema."""
    from adaspark_core.learn.learned import Learners

    learners, failures, forced = Learners(), [], 0
    for i, schema in enumerate(schemas(200)):
        prompt = _ask(lm, schema, "Make up an example.")
        gen = Generation(target, prompt, parse_arm("adaspark"), 4 * max_chars(schema) + 16, request_id=f"s{i}",
                         learners=learners, grammar=Grammar.for_schema(lm, schema))
        for _ in gen:
            forced += sum(c["source"] == "forced" for c in gen.last_record.candidates)
        text = b"".join(map(lm.piece, gen.tokens)).decode("utf-8", "replace")
        try:
            assert gen.finish == "stop", f"finish {gen.finish}"
            validate(json.loads(text), schema)
        except (AssertionError, ValueError) as e:
            failures.append(f"schema {i}: {e}: {text[:200]}")
    assert not failures, "\n".join(failures[:5])
    assert forced > 0


# --- a lazy grammar (tool calls under tool_choice auto) on the real vocabulary -------------------

WEATHER_CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": "get_weather"},
                               "arguments": {"type": "object", "additionalProperties": False, "required": ["city"],
                                             "properties": {"city": {"type": "string", "maxLength": 30}}}}}


def _earlier_calls(cities):
    """Turns in which the assistant called the tool (in the text, as the small model echoes them)."""
    out = []
    for i, city in enumerate(cities):
        out += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": f'<tool_response>\n{{"name": "get_weather", "arguments": '
                                                 f'"{{\\"city\\": \\"{city}\\"}}"}}\n</tool_response>'},
                {"role": "user", "content": f"It is {10 + i} degrees."},
                {"role": "assistant", "content": f"It is {10 + i} degrees in {city}."}]
    return out


@pytest.mark.parametrize("arm", ["ar", "chain:3", "adaspark"])
def test_a_lazy_grammar_holds_only_the_call_and_every_token_is_the_argmax_where_it_stands(lm, target, arm):
    """The small model writes ``<tool_response>`` and then a call whose arguments are a string. Under
    the lazy grammar of Hermes calls (a call's JSON held from its ``{"name"`` on, which the model
    writes before it is found), the call object follows the call's schema, and every token is the
    target's argmax: free before and after the call, under the grammar within it."""
    opens = FORMATS["hermes"].value_start
    prompt = lm.chat_prompt(_earlier_calls(["Paris", "Oslo", "Bern"]) + [
        {"role": "user", "content": "What is the weather in Rome?"}])
    gen = Generation(target, prompt, parse_arm(arm), 48, grammar=LazyGrammar(lm, opens, WEATHER_CALL))
    for _ in gen:
        pass
    text = b"".join(map(lm.piece, gen.tokens)).decode()
    assert text.startswith("<tool_response>\n{")
    value, end = json.JSONDecoder().raw_decode(text, opens(text))
    validate(value, WEATHER_CALL)
    assert text[end:].strip() == "</tool_response>" and gen.finish == "stop"
    # the re-score: the lazy grammar stepped token by token, as a reply of one-token rounds would
    logits, lazy, held, near = score(lm, prompt + gen.tokens), LazyGrammar(lm, opens, WEATHER_CALL), None, 0
    for i, tok in enumerate(gen.tokens):
        row = logits[len(prompt) + i - 1]
        if held is not None:
            held.compute_mask()
            row = np.where(held.allowed(), row, -np.inf)
        best = int(np.argmax(row))
        if tok != best:
            assert row[best] - row[tok] < NEAR_TIE, f"token {i}: emitted {tok}, argmax {best}"
            near += 1
        if held is not None:
            held.commit([tok])
        held = lazy.after([tok], held)
    assert near <= 1


def test_an_opening_that_ends_inside_a_token_hands_the_rest_of_it_to_the_grammar(lm):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    tokens = lm.tokenize('call {"city":"Rome"}', special=False, add_bos=False)
    assert [lm.piece(t) for t in tokens[:2]] == [b"call", b' {"']  # the value begins inside the second
    lazy = LazyGrammar(lm, lambda text: 5 if text.startswith("call {") else None, schema)
    assert lazy.cut(tokens, None) == tokens[:2]  # a free round ends with the token that completes the opening
    held = lazy.after(tokens[:2], None)
    assert held is not None and held.complete_after(tokens[2:]) == len(tokens) - 2  # '{"' was read: the value ends
    broken = LazyGrammar(lm, lambda text: 4 if text.startswith("call ") else None, schema)  # " {" is no JSON value
    assert broken.cut(tokens, None) == tokens[:2] and broken.after(tokens[:2], None) is None  # the reply stays free
