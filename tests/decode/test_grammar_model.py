"""Decoding under a grammar on the real default model: every emitted token is the target's argmax
over the tokens the grammar allows, checked against a re-score of the reply (near ties aside), for
every arm; and the structured-output fuzz: replies to 200 seeded schemas (tests/schema_fuzz.py)
all parse and validate."""

import json

import numpy as np
import pytest
from helpers import NEAR_TIE
from schema_fuzz import max_chars, schemas, validate

from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.grammar import Grammar
from adaspark_core.engine.llama_sequence import score

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
