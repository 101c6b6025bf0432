"""The structured-output fuzz's schemas (tests/schema_fuzz.py): distinct, valid, compiled by llguidance,
covering every feature, and judged alike by llguidance's grammar and by jsonschema on valid and broken
instances. No model: the grammar is fed the instances' bytes through a tokenizer of single bytes."""

import json
import random
import re
from collections import Counter

import pytest
from jsonschema import Draft202012Validator
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from schema_fuzz import FEATURES, MAX_CHARS, example, features, max_chars, schemas, validate

N = 240
SCHEMAS = schemas(N)


class _ByteTokenizer:
    """Tokens 0-255 are the single bytes and 256 is the end: a text's tokens are its bytes, so the
    grammar sees exactly the characters an instance is written with."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


TOKENIZER = LLTokenizer(TokenizerWrapper(_ByteTokenizer()))


def grammar(schema: dict) -> str:
    """The grammar the server decodes a response_format json_schema under."""
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


def compact(instance) -> str:
    """An instance as the grammar lets a model write it: no whitespace, non-ASCII characters raw
    (llguidance rejects a \\u escape of a printable character)."""
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


def accepts(matcher: LLMatcher, instance) -> bool:
    """Whether the grammar lets a model write this instance and stop there, fed byte by byte."""
    matcher = matcher.deep_copy()  # a fresh start: a matcher that rejected a byte stays in error
    return all(matcher.consume_token(b) for b in compact(instance).encode()) and matcher.is_accepting()


def corruptions(schema: dict, instance: dict, rng: random.Random) -> list[tuple[str, dict]]:
    """Broken copies of a valid instance, each wrong in one way at the root, where the schema allows it."""
    props = schema["properties"]
    bad = []
    if schema["required"]:
        name = rng.choice(schema["required"])
        bad.append(("missing required key", {k: v for k, v in instance.items() if k != name}))
    name = rng.choice(list(instance)) if instance else None
    if name is not None:  # a value of another JSON type, which the property's schema does not allow
        wrong = next(v for v in [True, 7, "x", None, [], {}] if type(v) is not type(instance[name])
                     and not Draft202012Validator(props[name]).is_valid(v))
        bad.append(("wrong type", {**instance, name: wrong}))
    strings = [name for name, value in props.items() if "maxLength" in value]
    if strings:
        name = rng.choice(strings)
        bad.append(("string too long", {**instance, name: "x" * (props[name]["maxLength"] + 1)}))
    arrays = [name for name, value in props.items() if value.get("type") == "array"]
    if arrays:
        name = rng.choice(arrays)
        items = [example(props[name]["items"], rng) for _ in range(props[name]["maxItems"] + 1)]
        bad.append(("too many items", {**instance, name: items}))
    bad.append(("extra key", {**instance, "extra": 1}))
    return bad


def test_the_schemas_are_distinct_seeded_and_compile_cleanly():
    assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == N
    assert schemas(N) == SCHEMAS and schemas(10) == SCHEMAS[:10]  # the model test may take a prefix
    assert schemas(10, seed=1) != SCHEMAS[:10]
    for schema in SCHEMAS:  # no error, and no warning such as a keyword llguidance ignores
        assert LLMatcher.validate_grammar_with_warnings(grammar(schema), TOKENIZER) == (False, []), schema


def test_the_schemas_are_valid_json_schemas_of_bounded_objects():
    for schema in SCHEMAS:
        Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and max_chars(schema) <= MAX_CHARS, schema


def test_every_feature_is_in_several_schemas():
    counts = Counter(feature for schema in SCHEMAS for feature in features(schema))
    assert set(counts) == set(FEATURES)
    assert min(counts.values()) >= 5, sorted(counts.items(), key=lambda kv: kv[1])


def test_every_kind_of_corruption_is_tried_often():
    rng = random.Random(0)
    counts = Counter(kind for schema in SCHEMAS for kind, _ in corruptions(schema, example(schema, rng), rng))
    assert len(counts) == 5 and min(counts.values()) >= 40, counts


@pytest.mark.parametrize("index", range(N))
def test_grammar_and_jsonschema_agree_on_examples_and_corruptions(index):
    schema, rng = SCHEMAS[index], random.Random(index)
    matcher = LLMatcher(TOKENIZER, grammar(schema))
    assert not matcher.is_error(), matcher.get_error()
    for _ in range(3):
        instance = example(schema, rng)
        validate(instance, schema)
        assert accepts(matcher, instance), compact(instance)
        text = compact(instance)
        assert len(text) - len(re.findall(r"\\.", text)) <= max_chars(schema), text  # escapes: one character
        for kind, bad in corruptions(schema, instance, rng):
            with pytest.raises(ValueError):
                validate(bad, schema)
            assert not accepts(matcher, bad), (kind, compact(bad))


def test_validate_says_where_and_what_is_wrong():
    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                               "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 1}},
              "required": ["day"], "additionalProperties": False}
    validate({"day": "2024-02-29", "tags": ["a"]}, schema)
    with pytest.raises(ValueError, match=r"2 error\(s\).*at \$\.day: '2024-02-30' is not a 'date'.*at \$\.tags: "):
        validate({"day": "2024-02-30", "tags": ["a", "b"]}, schema)
