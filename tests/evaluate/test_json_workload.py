"""The JSON extraction workload (evaluate/json_workload.py): requests built from the test set's
documents, each schema valid, strict, bounded and compilable to a grammar; no model."""

import json
import re

import llguidance
import orjson
import pytest
from conftest import TESTSET
from jsonschema import Draft202012Validator

from adaspark_core.evaluate import json_workload as jw
from adaspark_core.evaluate import testset


@pytest.fixture(scope="module")
def excerpt():
    return jw.load_json_workload(TESTSET)


def _shared_or_skip():
    if not testset.shared_dir().is_dir():
        pytest.skip("no ../shared/testset beside the repository")
    return jw.load_json_workload(testset.shared_dir())


def _walk(schema):
    """Every subschema, the schema first."""
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if "items" in schema:
        yield from _walk(schema["items"])


def _schemas(requests):
    return [c.response_format["json_schema"]["schema"] for c in requests]


def test_the_excerpt_gives_requests_of_every_document_kind_it_holds(excerpt):
    names = [c.name for c in excerpt]
    assert len(names) >= 4 and len(set(names)) == len(names)
    assert {c.kind for c in excerpt} == {"financial_report", "financial_table", "tool_result", "article"}
    for c in excerpt:
        assert c.set == jw.SET_NAME and c.name.startswith(("cf-", "ta-", "lb-"))
        assert [(t["kind"], t["type"]) for t in c.turns] == [("extraction", "first")]


def test_the_same_input_gives_the_same_requests(excerpt):
    assert jw.load_json_workload(TESTSET) == excerpt
    convs = testset.load_sources(["convfinqa", "toolace"], TESTSET)
    assert jw.extraction_set(convs) == jw.extraction_set(convs)
    assert jw.extraction_set(testset.load_sources(["wildchat", "speedbench"], TESTSET)) == []  # no documents


def test_the_full_test_set_gives_20_to_30_requests():
    requests = _shared_or_skip()
    assert 20 <= len(requests) <= 30
    assert len({c.name for c in requests}) == len(requests)


def test_response_formats_have_openais_shape(excerpt):
    for c in excerpt:
        rf = c.response_format
        assert rf.keys() == {"type", "json_schema"} and rf["type"] == "json_schema"
        assert rf["json_schema"].keys() == {"name", "schema", "strict"} and rf["json_schema"]["strict"] is True
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", rf["json_schema"]["name"])
    assert testset.load(TESTSET / "convfinqa.json")[0].response_format is None  # the sets have none


def _check_schemas(requests):
    for schema in _schemas(requests):
        Draft202012Validator.check_schema(schema)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                               defaults={"whitespace_flexible": False})
        # no warning either: llguidance would warn of a keyword it ignores, a bound not enforced
        assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar) == (False, [])
        for sub in _walk(schema):
            if sub["type"] == "object":  # OpenAI's strict style
                assert sub["required"] == list(sub["properties"]) and sub["additionalProperties"] is False
            if sub["type"] == "string":  # every reply is bounded
                assert "enum" in sub or 0 < sub["maxLength"] <= 200
            if sub["type"] == "array":
                assert 0 < sub["maxItems"] <= 8


def test_schemas_are_valid_strict_bounded_and_compile_to_grammars(excerpt):
    _check_schemas(excerpt)


def test_the_full_test_sets_schemas_too():
    _check_schemas(_shared_or_skip())


def test_prompts_quote_a_bounded_document_and_their_schema(excerpt):
    for c in excerpt:
        text = c.turns[0]["text"]
        assert orjson.dumps(c.response_format["json_schema"]["schema"]).decode() in text
        assert len(text.encode()) <= jw.MAX_DOCUMENT_BYTES + 1500  # the instruction and schema around it
    report = next(c.turns[0]["text"] for c in excerpt if c.name == "cf-1-financial_report")
    assert "<table" in report and "Question:" not in report  # the filing, not ConvFinQA's task prompt
    assert "what was the weighted average exercise price per share in 2007?" in report  # its question


def test_cut_keeps_short_text_and_ends_long_text_at_a_boundary():
    assert jw.cut("short. text", 100) == "short. text"
    text = "First sentence here. " * 20 + "\n\n" + "Second paragraph. " * 20
    assert jw.cut(text, 500) == text[: text.index("\n\n")].rstrip()  # the paragraph end
    assert jw.cut(text, 300) == ("First sentence here. " * 14).rstrip()  # else the sentence end
    assert jw.cut("x" * 1000, 300) == "x" * 300  # else the limit
    chinese = "讲者说了一句话。" * 500
    cut = jw.cut(chinese, 1000)
    assert len(cut.encode()) <= 1000 and cut.endswith("。")  # bytes, not characters


def test_a_tool_result_is_a_valid_reply_to_its_own_schema():
    result = {"city": "New York", "latitude": 40.7, "zip": 10001, "open": True, "note": None,
              "quotes": [{"text": "Keep going.", "author": "Sam Levenson"}]}
    schema = jw.result_schema(result)
    Draft202012Validator(schema).validate(result)
    assert schema["properties"]["quotes"]["maxItems"] == 8
    assert not Draft202012Validator(schema).is_valid({**result, "extra": 1})
