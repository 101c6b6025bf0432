"""Decoding under a grammar (decode/grammar.py) on the simulated model, whose tokens are bytes:
candidates the grammar forbids are cut, the tokens it alone allows lead the round as certain
FORCED candidates, every arm emits what plain decoding under the grammar emits, greedy and
sampled, and a constrained log replays exactly."""

import json

import jsonschema
import pytest
from conftest import SIM

from adaspark_core.base.errors import InputError
from adaspark_core.base.sampling import Sampling
from adaspark_core.base.tree import ANCHOR, FORCED, NGRAM, Candidate
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import run
from adaspark_core.decode.grammar import ANY_OBJECT, Grammar, LazyGrammar, follows_schema
from adaspark_core.engine.simlm import EOG, SimModel
from adaspark_core.evaluate.replay import replay
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundLog, RoundRecord, read_log

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "size", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def model():
    return SimModel(SIM)


def _bytes(model, text: str) -> list[int]:
    return model.tokenize(text)


def _text(model, tokens: list[int]) -> str:
    return b"".join(map(model.piece, tokens)).decode()


def test_a_schema_the_grammar_engine_refuses_is_one_input_error(model):
    with pytest.raises(InputError, match="cannot be compiled"):
        Grammar.for_schema(model, {"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(InputError, match="no-such-format"):
        Grammar.for_schema(model, {"type": "string", "format": "no-such-format"})


def test_the_forced_run_is_every_token_the_grammar_alone_allows(model):
    g = Grammar.for_schema(model, SCHEMA)
    # the first key is required and the only one first: the structure up to its string value is known
    assert _text(model, g.forced_run(100)) == '{"name":"'
    assert _text(model, g.forced_run(3)) == '{"n'
    g.commit(_bytes(model, '{"name":"ab"'))  # (the matcher was left where it was)
    assert _text(model, g.forced_run(100)) == ',"tags":['


def test_fit_cuts_what_the_grammar_forbids_and_leads_with_the_forced_run(model):
    g = Grammar.for_schema(model, SCHEMA)
    g.commit(_bytes(model, '{"name":"ab'))

    def chain(text, parent=ANCHOR, depth0=0, at=0):
        out = []
        for i, t in enumerate(_bytes(model, text)):
            out.append(Candidate(t, parent if i == 0 else at + i - 1, NGRAM, depth0 + i + 1, bucket="copy/1/0"))
        return out

    cands = chain('c","tags"')  # allowed all the way
    cands += chain("\n") + chain('"')  # a raw newline in a string is not JSON; a quote ends the string
    cands += [Candidate(_bytes(model, "x")[0], 0, NGRAM, 2, bucket="copy/1/0")]  # 'c' then 'x': allowed
    cands += [Candidate(_bytes(model, ":")[0], 3, NGRAM, 4, bucket="copy/1/0")]  # 'c",' then ':': forbidden
    fitted = g.fit(cands, 20)
    proposed = sorted(_text(model, [c.token for c in _path(fitted, j)]) for j, c in enumerate(fitted)
                      if c.source == NGRAM)
    assert proposed == ['"', "c", 'c"', 'c",', 'c","', 'c","t', 'c","ta', 'c","tag', 'c","tags', 'c","tags"', "cx"]
    # below a leaf, the run the grammar forces from there; none at the anchor (several tokens may come)
    tails = {_text(model, [c.token for c in _path(fitted, j)]) for j, c in enumerate(fitted)
             if c.source == FORCED and not any(d.parent == j for d in fitted)}
    assert tails == {'","tags":[', 'c","tags":['} and fitted[0].source == NGRAM
    assert max(c.depth for c in g.fit(chain('"'), 4)) == 4  # the tail stops at the depth limit
    # where one token may come next, the run leads and a proposal on it stands below it
    g.commit(_bytes(model, 'c"'))
    fitted = g.fit(chain(',"tags":["q', ANCHOR), 30)
    assert [c.source for c in fitted[:9]] == [FORCED] * 9
    assert _text(model, [c.token for c in fitted[:9]]) == ',"tags":['
    assert [(c.parent, c.depth, _text(model, [c.token])) for c in fitted[9:]] == [(8, 10, '"'), (9, 11, "q")]


def _path(cands, j):
    out = []
    while j != ANCHOR:
        out.append(cands[j])
        j = cands[j].parent
    return out[::-1]


def test_an_end_token_is_a_candidate_only_where_the_grammar_accepts(model):
    g = Grammar.for_schema(model, {"type": "object", "properties": {}, "additionalProperties": False})
    fitted = g.fit([Candidate(EOG, ANCHOR, NGRAM, 1, bucket="copy/1/0")], 5)  # not yet: cut
    assert [(c.token, c.source) for c in fitted] == [(t, FORCED) for t in _bytes(model, "{}") + [EOG]]
    g.commit(_bytes(model, "{}"))
    assert [(c.token, c.source) for c in g.fit([], 5)] == [(EOG, FORCED)]  # nothing but the end may follow
    end = Candidate(EOG, ANCHOR, NGRAM, 1, bucket="copy/1/0")
    assert g.fit([end], 0) == [end]  # (no run at depth limit 0) where the grammar accepts, it stays
    g.commit([EOG])  # an end token is not the grammar's: committing it changes nothing


@pytest.mark.parametrize("arm", ["chain:3", "tree:16", "adaspark"])
def test_every_arm_emits_what_plain_decoding_under_the_grammar_emits(model, arm):
    prompt = model.tokenize("<user>Describe the sea as JSON.\n<assistant>")
    plain = run(model.target(), prompt, parse_arm("ar"), 200, grammar=Grammar.for_schema(model, SCHEMA))
    spec = run(model.target(), prompt, parse_arm(arm), 200, grammar=Grammar.for_schema(model, SCHEMA))
    assert spec.tokens == plain.tokens and plain.finish == "stop" and spec.stats.rounds < plain.stats.rounds
    jsonschema.validate(json.loads(_text(model, plain.tokens)), SCHEMA)


def test_sampled_under_a_grammar_speculation_changes_nothing(model):
    prompt = model.tokenize("<user>Describe the sea as JSON.\n<assistant>")
    texts = []
    for arm in ("ar", "chain:3", "adaspark"):
        gen = run(model.target(), prompt, parse_arm(arm), 200, sampling=Sampling(0.9, seed=4),
                  grammar=Grammar.for_schema(model, SCHEMA))
        texts.append(_text(model, gen.tokens))
    assert texts[0] == texts[1] == texts[2]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)


def test_a_constrained_log_checks_and_replays_exactly(model, tmp_path):
    prompt = model.tokenize("<user>Describe the sea as JSON.\n<assistant>")
    live = Learners()
    with RoundLog(tmp_path / "r.jsonl") as log:
        for i in range(3):
            run(model.target(), prompt, parse_arm("adaspark"), 200, request_id=f"q{i}", log=log, learners=live,
                grammar=Grammar.for_schema(model, SCHEMA))
        run(model.target(), prompt, parse_arm("adaspark"), 60, request_id="free", log=log, learners=live)
    records = list(read_log(tmp_path / "r.jsonl"))
    constrained = [r for r in records if r.constrained]
    assert {r.request for r in constrained} == {"q0", "q1", "q2"}
    forced = [(r, j) for r in constrained for j, c in enumerate(r.candidates) if c["source"] == FORCED]
    assert forced and all(r.candidates[j]["q"] == 1.0 for r, j in forced)
    on_path = [(r, j) for r, j in forced if j in r.rows]
    assert on_path and all(j in r.path for r, j in on_path)  # a verified forced candidate is accepted
    replayed, _ = replay(records)
    assert replayed.state() == live.state()
    assert any(k.startswith("grammar:") for k in live.state()["acceptance"]["buckets"]["z"])  # the class learned
    # a record holding a forced candidate in a round under no grammar is refused
    r, j = forced[0]
    line = {**r.to_json(), "constrained": False}
    with pytest.raises(ValueError, match="forced"):
        RoundRecord.from_json(line)


def test_a_reply_follows_its_schema_whoever_wrote_it():
    ok = '{"name":"ab","tags":["x"],"size":3,"ok":true}'
    assert follows_schema(ok, SCHEMA)
    # JSON another grammar (llama.cpp's GBNF) allows: whitespace around tokens, \u escapes of any character
    assert follows_schema(' {\n  "name": "a\\u00e9",\n  "tags": [],\n  "size": 3,\n  "ok": true\n}\n', SCHEMA)
    for bad in ('{"name":"ab","tags":["x"],"size":3', '{"name":"ab","tags":["x"],"size":1000,"ok":true}',
                '{"name":"abcdefghijklm","tags":[],"size":3,"ok":true}', '{"name":"ab","tags":[],"size":3}',
                '{"tags":[],"name":"ab","size":3,"ok":true}',  # out of the schema's order, as both grammars hold
                '{"name":"\\ud800","tags":[],"size":3,"ok":true}', '{"name":"ab","tags":[],"size":NaN,"ok":true}',
                "", "abc"):
        assert not follows_schema(bad, SCHEMA), bad
    assert follows_schema('{"any": [1, {"b": null}]}', ANY_OBJECT) and not follows_schema("[1]", ANY_OBJECT)
    jsonschema.validate(json.loads(ok), SCHEMA)


def test_an_unbounded_integer_has_at_most_16_digits_and_the_reply_ends(model):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}},
              "required": ["n", "x"], "additionalProperties": False}
    for text, ok in [('{"n":-9999999999999999,', True), ('{"n":99999999999999999', False),
                     ('{"n":1,"x":12345678901234567', False), ('{"n":1,"x":1234567890123456.5}', True)]:
        g = Grammar.for_schema(model, schema)
        assert (g.matcher.validate_tokens(_bytes(model, text)) == len(text)) == ok, text
    # the simulated model writes digits where it may: bounded, its reply ends by the grammar
    gen = run(model.target(), model.tokenize("<user>A number.\n<assistant>"), parse_arm("adaspark"), 400,
              grammar=Grammar.for_schema(model, schema))
    assert gen.finish == "stop" and set(json.loads(_text(model, gen.tokens))) == {"n", "x"}
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema is left alone


# --- a lazy grammar (tool calls under tool_choice auto) ------------------------------------------

CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"enum": ["get_weather", "get_time"]},
                       "arguments": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 8}}}}}
CALL_PROMPT = "<user>Call a tool.\n<assistant>"


def after(trigger: str):
    """A lazy grammar's ``opens``: a value begins right after ``trigger``."""
    return lambda text: at + len(trigger) if (at := text.find(trigger)) >= 0 else None


def _held_values(text: str, trigger: str, capped: bool = False) -> list:
    """The JSON values that follow each trigger in ``text``, each read whole, the free text
    between them unread; in a reply the token cap cut (``capped``) the last may be unfinished,
    and is left out."""
    values, at, decoder = [], 0, json.JSONDecoder()
    while (at := text.find(trigger, at)) >= 0:
        try:
            value, at = decoder.raw_decode(text, at + len(trigger))
        except json.JSONDecodeError:
            assert capped, text[at:]
            break
        values.append(value)
    return values


@pytest.mark.parametrize("trigger", ["rhn", "h"])
def test_a_lazy_grammar_holds_the_reply_only_from_each_trigger_to_its_value_end(model, tmp_path, trigger):
    prompt = model.tokenize(CALL_PROMPT)
    free = _text(model, run(model.target(), prompt, parse_arm("ar"), 120).tokens)
    assert trigger in free
    texts = []
    for arm in ("ar", "chain:3", "tree:16", "adaspark"):
        with RoundLog(tmp_path / f"{arm}.jsonl") as log:
            gen = run(model.target(), prompt, parse_arm(arm), 240, log=log, grammar=LazyGrammar(model, after(trigger), CALL))
        texts.append(_text(model, gen.tokens))
        capped = gen.finish == "length"
        capped = gen.finish == "length"
        # a round is held or free throughout: the free round that writes the trigger ends with it
        text = ""
        for r in read_log(tmp_path / f"{arm}.jsonl"):
            before, text = text, text + _text(model, r.emitted)
            at = text.find(trigger, max(0, len(before) - len(trigger) + 1))
            if not r.constrained and at >= 0:
                assert at + len(trigger) == len(text), (arm, r.round)
    assert texts[1:] == texts[:1] * 3  # every arm emits what plain decoding under the lazy grammar emits
    text = texts[0]
    head = text[: text.find(trigger) + len(trigger)]
    assert free.startswith(head)  # free text up to the trigger: unconstrained decoding's
    values = _held_values(text, trigger, capped)
    assert len(values) >= (2 if trigger == "h" else 1)
    for v in values:
        jsonschema.validate(v, CALL)


def test_a_lazy_grammar_samples_as_plain_decoding_does(model):
    prompt = model.tokenize(CALL_PROMPT)
    gens = [run(model.target(), prompt, parse_arm(arm), 200, sampling=Sampling(0.9, seed=4),
                grammar=LazyGrammar(model, after("h"), CALL)) for arm in ("ar", "chain:3", "adaspark")]
    texts = [_text(model, g.tokens) for g in gens]
    assert texts[0] == texts[1] == texts[2]
    assert len(_held_values(texts[0], "h", capped=gens[0].finish == "length")) >= 2
    with pytest.raises(InputError, match="cannot be compiled"):
        LazyGrammar(model, after("h"), {"type": "no-such-type"})
