"""llama.cpp's own llama-server as a compare arm (adaspark_core/evaluate/peer.py): spec parsing, the command
line, the stream reader and its client-clock timing on canned streams, the process handling with a
stand-in server script, and (with the binary `make peer` builds) a real reply against our ar, also
under the server's draft-model speculation."""

import json
import stat
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaspark_core.base.errors import InputError
from adaspark_core.engine import llama_server
from adaspark_core.evaluate import compare as cmp
from adaspark_core.evaluate import peer

EOG = 2


def is_eog(t):
    return t == EOG


def one_line_error(fn, *words):
    with pytest.raises(InputError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


# --- specs and the command line ---------------------------------------------------------------------


def test_good_specs():
    assert peer.parse_peer("llama:ar") == peer.PeerSpec("llama:ar", None)
    assert peer.parse_peer(" llama:ngram-simple ") == peer.PeerSpec("llama:ngram-simple", "ngram-simple")
    assert peer.parse_peer("llama:ngram-mod:8:16") == peer.PeerSpec("llama:ngram-mod:8:16", "ngram-mod", (8, 16))
    assert peer.parse_peer("llama:ngram-cache").sizes is None
    for kind in ("ngram-map-k", "ngram-map-k4v"):
        assert peer.parse_peer(f"llama:{kind}:3:12").sizes == (3, 12)
    assert peer.parse_peer("llama:draft:4") == peer.PeerSpec("llama:draft:4", "draft-simple", draft=(4, None))
    assert peer.parse_peer("llama:draft:8:0.75").draft == (8, 0.75)
    assert peer.parse_peer("llama:draft:1:0").draft == (1, 0.0) and peer.parse_peer("llama:draft:2:1").draft == (2, 1.0)
    assert peer.parse_peer("llama:draft:3").needs_draft and not peer.parse_peer("llama:ngram-mod").needs_draft


@pytest.mark.parametrize("spec,words", [
    ("llama:", ["unknown llama-server spec type"]),
    ("llama:nope", ["unknown llama-server spec type", "'nope'", "ngram-mod"]),
    ("llama:draft-simple", ["unknown llama-server spec type", "draft:N[:P]"]),  # offered as llama:draft:N
    ("llama:draft", ["give the most draft tokens N", "llama:draft:N or llama:draft:N:P"]),
    ("llama:draft:x", ["give the most draft tokens N"]),
    ("llama:draft:-1", ["give the most draft tokens N"]),
    ("llama:draft:2.5", ["give the most draft tokens N"]),
    ("llama:draft:4:0.5:1", ["give the most draft tokens N"]),
    ("llama:draft:0", ["N, the most draft tokens, must be at least 1"]),
    ("llama:draft:4:", ["P, the least probability", "from 0 to 1"]),
    ("llama:draft:4:x", ["P, the least probability", "from 0 to 1"]),
    ("llama:draft:4:1.5", ["from 0 to 1"]),
    ("llama:draft:4:-0.1", ["from 0 to 1"]),
    ("llama:draft:4:nan", ["from 0 to 1"]),
    ("llama:draft:4:inf", ["from 0 to 1"]),
    ("llama:none", ["unknown"]),
    ("llama:ar:3", ["unknown"]),
    ("llama:ngram-cache:1:2", ["takes no sizes"]),
    ("llama:ngram-mod:8", ["give both sizes", "llama:ngram-mod:N:M"]),
    ("llama:ngram-mod:8:16:2", ["give both sizes"]),
    ("llama:ngram-mod:8:x", ["give both sizes"]),
    ("llama:ngram-mod:-1:16", ["give both sizes"]),
    ("llama:ngram-mod:0:16", ["between 1 and 1024"]),
    ("llama:ngram-simple:4:2000", ["between 1 and 1024"]),
    ("pld:3", ["not a llama-server arm"]),
])
def test_bad_specs_are_one_line_errors(spec, words):
    one_line_error(lambda: peer.parse_peer(spec), *words)


def test_the_command_line():
    spec = peer.parse_peer("llama:ngram-mod:8:16")
    cmd = peer.server_command(Path("/x/llama-server"), spec, Path("/m/model.gguf"), 4096, 2, 8123)
    assert cmd[0] == "/x/llama-server"
    pairs = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert pairs["-m"] == "/m/model.gguf" and pairs["-c"] == "4096"
    assert pairs["-t"] == pairs["-tb"] == "2" and pairs["-np"] == "1"
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8123"
    assert pairs["-fa"] == "off" and pairs["--cache-ram"] == "0" and pairs["--top-k"] == "1"
    assert "--no-ui" in cmd and "--no-cache-prompt" in cmd
    assert cmd[-8:] == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-max", "16",
                        "--spec-ngram-mod-n-min", "16"]
    assert peer.parse_peer("llama:ngram-mod:24:64").server_args()[-1] == "48"  # the server's own default
    assert peer.parse_peer("llama:ngram-simple:3:12").server_args() == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "12"]
    assert peer.parse_peer("llama:ngram-map-k4v").server_args() == ["--spec-type", "ngram-map-k4v"]
    assert peer.parse_peer("llama:ar").server_args() == []  # plain decoding: the server's default


def test_a_draft_arms_command_line():
    """``-md`` alone does not speculate in the vendored server (peer.py's doc): the type is given."""
    spec = peer.parse_peer("llama:draft:4")
    assert spec.server_args() == ["--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]
    assert peer.parse_peer("llama:draft:8:0.75").server_args()[-2:] == ["--spec-draft-p-min", "0.75"]
    assert peer.parse_peer("llama:draft:8:.5").server_args()[-1] == "0.5"
    cmd = peer.server_command(Path("/x/llama-server"), spec, Path("/m/model.gguf"), 4096, 2, 8123,
                              Path("/m/draft.gguf"))
    pairs = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert pairs["-m"] == "/m/model.gguf" and pairs["-c"] == "4096" and pairs["-t"] == "2"
    assert cmd[-14:] == ["-md", "/m/draft.gguf", "-td", "2", "-tbd", "2", "-ngld", "0",
                         "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]
    # a draft path goes with a draft arm only
    with pytest.raises(ValueError):
        peer.server_command(Path("/x/llama-server"), spec, Path("/m/model.gguf"), 4096, 2, 8123)
    with pytest.raises(ValueError):
        peer.server_command(Path("/x/llama-server"), peer.parse_peer("llama:ar"), "m", 512, 1, 1, Path("d.gguf"))


def model_drafter(path):
    """What make_arms reads of a ``--drafter model:FILE`` drafter (candidates/drafters.ModelDrafter)."""
    return SimpleNamespace(name="model", model=SimpleNamespace(path=path))


def test_the_draft_model_is_the_runs_model_drafters():
    from adaspark_core.candidates.drafters import DSparkDrafter, ModelDrafter

    assert (ModelDrafter.name, DSparkDrafter.name) == ("model", "dspark")  # what draft_model_path tells apart
    assert peer.draft_model_path(model_drafter("/m/draft.gguf")) == Path("/m/draft.gguf")
    assert peer.draft_model_path(None) is None
    assert peer.draft_model_path(SimpleNamespace(name="dspark", model=SimpleNamespace(path="/m/ds.gguf"))) is None


def test_the_request_is_greedy_uncached_and_exact():
    body = peer.request_body([1, 5, 9], 16)
    assert body["prompt"] == [1, 5, 9] and body["n_predict"] == 16
    assert body["stream"] and body["timings_per_token"] and not body["cache_prompt"]
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["samplers"] == ["top_k"]
    assert "json_schema" not in body  # free text


def test_a_request_under_a_schema_sends_it_for_the_servers_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = peer.request_body([1, 5, 9], 16, schema=schema)
    assert body["json_schema"] == schema and body["samplers"] == ["top_k"]  # greedy under it, as ours
    assert json.loads(json.dumps(body)) == body  # sent as it is


def test_a_sampled_request_asks_for_our_chain_at_our_settings():
    from adaspark_core.base.sampling import Sampling

    body = peer.request_body([1, 5, 9], 16, sampling=Sampling(0.7, top_p=0.95, top_k=40, min_p=0.05, seed=3))
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"], body["seed"]) == (0.7, 40, 0.95, 0.05, 3)
    assert body["samplers"] == ["top_k", "top_p", "min_p", "temperature"]
    assert peer.request_body([1], 4, sampling=Sampling(1.0))["top_k"] == 0  # off, as ours


def test_a_missing_binary_says_make_peer(tmp_path, monkeypatch):
    monkeypatch.setenv(llama_server.ENV_BINARY, str(tmp_path / "nope"))
    one_line_error(lambda: llama_server.server_binary(), "make peer", str(tmp_path / "nope"))
    one_line_error(lambda: peer.LlamaServerArm("llama:ar", "m.gguf", 512, 1, is_eog), "make peer")
    one_line_error(lambda: cmp.make_arms(["ar", "llama:ar"], None, None, None, is_eog, model_path="m.gguf", n_ctx=512),
                   "make peer")


def test_make_arms_builds_peer_arms_lazily(tmp_path, monkeypatch):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(llama_server.ENV_BINARY, str(fake))
    arms = cmp.make_arms(["ar", "llama:ar", "llama:ngram-mod:8:16"], None, None, None, is_eog,
                         model_path="m.gguf", n_ctx=512, threads=2)
    assert [a.name for a in arms] == ["ar", "llama:ar", "llama:ngram-mod:8:16"]
    assert arms[1].server is None  # no process until the first reply
    cmp.close_arms(arms)
    one_line_error(lambda: cmp.make_arms(["llama:ar"], None, None, None, is_eog), "needs the model file")
    # --arms is split on commas: sizes go after colons, and a split-up spec says so
    one_line_error(lambda: cmp.make_arms("ar,llama:ngram-mod,8,16".split(","), None, None, None, is_eog,
                                         model_path="m.gguf", n_ctx=512), "after colons", "llama:ngram-mod:8:16")
    one_line_error(lambda: peer.parse_peer("llama:ngram-mod,8,16"), "after colons")


def test_draft_arms_need_a_model_drafter(tmp_path, monkeypatch):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(llama_server.ENV_BINARY, str(fake))
    specs = ["ar", "llama:ar", "llama:draft:4", "llama:draft:8:0.75"]
    arms = cmp.make_arms(specs, None, model_drafter(tmp_path / "draft.gguf"), None, is_eog,
                         model_path="m.gguf", n_ctx=512, threads=2)
    try:
        assert [a.name for a in arms] == specs
        assert arms[1].draft_path is None  # the other peers ignore the run's drafter
        assert arms[2].draft_path == arms[3].draft_path == tmp_path / "draft.gguf"
        cmd = arms[3].command(8123)
        assert cmd[cmd.index("-md") + 1] == str(tmp_path / "draft.gguf") and cmd[cmd.index("-td") + 1] == "2"
        assert cmd[-2:] == ["--spec-draft-p-min", "0.75"] and "-md" not in arms[1].command(8123)
    finally:
        cmp.close_arms(arms)
    dspark = SimpleNamespace(name="dspark", model=SimpleNamespace(path=tmp_path / "ds.gguf"))
    for drafter in (None, dspark):
        msg = one_line_error(lambda: cmp.make_arms(["ar", "llama:draft:4"], None, drafter, None, is_eog,
                                                   model_path="m.gguf", n_ctx=512), "--drafter model:FILE")
        assert msg.startswith("arm llama:draft:4 ")
    one_line_error(lambda: peer.LlamaServerArm("llama:draft:2", "m.gguf", 512, 1, is_eog), "--drafter model:FILE")


# --- the stream ---------------------------------------------------------------------------------------


def sse(*objs, extra=()):
    lines = [b": ping\n", b"\n"]
    for o in objs:
        lines += [b"data: " + json.dumps(o).encode() + b"\n", b"\n"]
    return lines + list(extra)


def tok(t, n_pred, round_ms, content=None):
    """A streamed token event as the server sends it with timings_per_token (round_ms: the server's
    predicted_ms, the same for every token of one round)."""
    return {"content": f"<{t}>" if content is None else content, "tokens": [t], "stop": False,
            "tokens_predicted": n_pred, "timings": {"predicted_ms": round_ms}}


def final(n_pred, stop_type="eos", truncated=False, **timings):
    return {"content": "", "tokens": [], "stop": True, "stop_type": stop_type, "truncated": truncated,
            "tokens_predicted": n_pred, "timings": {"predicted_per_second": 50.0, **timings}}


class FakeClock:
    """Reads the next canned time on every call: one call per event."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_plain_decoding_one_delta_per_token():
    lines = sse({"content": "", "tokens": [], "stop": False},  # a begin event carries no token
                tok(10, 1, 0.001), tok(11, 2, 20.0), tok(12, 3, 40.0), tok(13, 4, 60.0), tok(EOG, 5, 80.0), final(5))
    got = peer.read_stream(lines, is_eog, FakeClock(0.5, 1.0, 2.0, 3.0, 5.0, 5.1, 5.2))
    assert got.tokens == [10, 11, 12, 13] and got.text == "<10><11><12><13>" and got.finish == "stop"
    assert got.deltas == [(1, 1.0), (1, 2.0), (1, 3.0), (1, 5.0)]  # the end of generation is not timed
    assert got.tok_s == pytest.approx(3 / 4.0)
    assert got.trace() == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 4.0)]
    assert got.ids_complete and got.generated == 4 and got.timings["predicted_per_second"] == 50.0


def test_a_rounds_burst_is_one_delta():
    # round 1: the first token; round 2: three tokens (a verify that accepted two drafts); round 3: two
    lines = sse(tok(10, 1, 0.001), tok(11, 2, 30.0), tok(12, 3, 30.0), tok(13, 4, 30.0),
                tok(14, 5, 55.5), tok(15, 6, 55.5), final(6, "limit", draft_n=8, draft_n_accepted=3))
    got = peer.read_stream(lines, is_eog, FakeClock(1.0, 2.0, 2.0001, 2.0002, 3.0, 3.0001, 3.1))
    assert got.deltas == [(1, 1.0), (3, 2.0002), (2, 3.0001)]
    assert got.tok_s == pytest.approx(5 / 2.0001)  # the 5 tokens after the first delta
    assert got.trace() == [(1, 0.0), (4, pytest.approx(1.0002)), (6, pytest.approx(2.0001))]
    assert got.finish == "length" and got.timings["draft_n_accepted"] == 3


def test_without_timings_every_event_is_a_delta():
    events = [{"content": "x", "tokens": [t], "stop": False, "tokens_predicted": i + 1} for i, t in enumerate((7, 8))]
    got = peer.read_stream(sse(*events, final(2, "limit")), is_eog, FakeClock(1.0, 1.5, 1.6))
    assert got.deltas == [(1, 1.0), (1, 1.5)] and got.tok_s == pytest.approx(2.0)


def test_one_delta_has_no_speed_and_finish_reasons():
    got = peer.read_stream(sse(tok(10, 1, 0.001), final(1, "limit", truncated=True)), is_eog, FakeClock(1.0, 1.1))
    assert got.tok_s is None and got.finish == "context"
    got = peer.read_stream(sse(tok(EOG, 1, 0.001), final(1)), is_eog, FakeClock(1.0, 1.1))
    assert got.tokens == [] and got.tok_s is None and got.finish == "stop" and got.ids_complete
    assert peer.finish_reason({"stop_type": "word"}) == "stop"


def test_a_held_back_token_is_counted_and_marks_the_ids_incomplete():
    # token 11 ended inside a UTF-8 character: the server sent its text with token 12's event
    lines = sse(tok(10, 1, 0.001, "a"), tok(12, 3, 40.0, "é"), tok(13, 4, 60.0, "b"), final(4, "limit"))
    got = peer.read_stream(lines, is_eog, FakeClock(1.0, 3.0, 4.0, 4.1))
    assert got.tokens == [10, 12, 13] and not got.ids_complete and got.generated == 4
    assert got.deltas == [(1, 1.0), (2, 3.0), (1, 4.0)] and got.tok_s == pytest.approx(3 / 3.0)
    # ... and at the very end, where the end of generation's event was held back with it
    got = peer.read_stream(sse(tok(10, 1, 0.001), tok(12, 2, 20.0), final(4)), is_eog, FakeClock(1.0, 2.0, 2.1))
    assert not got.ids_complete and got.generated == 3


def test_stream_errors_are_one_line():
    one_line_error(lambda: peer.read_stream(sse({"error": {"code": 400, "message": "bad\nthing"}}), is_eog),
                   "llama-server")
    one_line_error(lambda: peer.read_stream(sse(tok(10, 1, 0.001)), is_eog, FakeClock(1.0)),
                   "without its final event")
    one_line_error(lambda: peer.read_stream([b"data: {nope\n"], is_eog), "not JSON")
    # [DONE] ends an OpenAI-style stream; a stream that ends there without a final event is an error too
    one_line_error(lambda: peer.read_stream(sse(extra=[b"data: [DONE]\n"]), is_eog), "final event")


def test_error_events_join_lines():
    with pytest.raises(InputError) as e:
        peer.read_stream(sse({"error": {"code": 400, "message": "bad"}}), is_eog)
    assert str(e.value) == "llama-server: bad"


# --- the process, with a stand-in server ---------------------------------------------------------------

STAND_IN = '''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
if "--fail" in args or "fail.gguf" in args:
    sys.stderr.write("loading model\\nerror: failed to load model 'fail.gguf'\\n")
    sys.exit(1)
port = int(args[args.index("--port") + 1])

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        shift = 200 if "json_schema" in body else 100  # a reply under a schema is another reply
        toks = [t + shift for t in body["prompt"]][: body["n_predict"]]
        if not body["stream"]:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"content": "", "tokens": toks, "stop": True, "stop_type": "limit",
                                         "tokens_predicted": len(toks)}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        shown = [t for t in toks if t % 100 != 5]  # 105 "ends inside a UTF-8 character": no event of its own
        for i, t in enumerate(shown):
            n = toks.index(t) + 1
            ev = {"content": "c", "tokens": [t], "stop": False, "tokens_predicted": n,
                  "timings": {"predicted_ms": float(n)}}
            self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\\n\\n")
            self.wfile.flush()
        fin = {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "truncated": False,
               "tokens_predicted": len(toks), "timings": {"predicted_per_second": 1.0}}
        self.wfile.write(b"data: " + json.dumps(fin).encode() + b"\\n\\n")

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(STAND_IN))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(llama_server.ENV_BINARY, str(script))
    return script


def test_an_arm_starts_its_server_answers_and_closes(stand_in):
    arm = peer.LlamaServerArm("llama:ngram-simple", "m.gguf", 512, 1, is_eog,
                              detokenize=lambda toks: " ".join(map(str, toks)))
    try:
        ans = arm.answer([1, 2, 3, 4], 3, "c/0/0")
        assert ans.tokens == [101, 102, 103] and ans.text == "101 102 103" and ans.finish == "length"
        assert ans.widths == {} and ans.tok_s is not None and [p[0] for p in ans.trace] == [1, 2, 3]
        proc = arm.server.proc
        # a reply whose stream held token 105 back: its ids come from a second, unstreamed request
        ans = arm.answer([1, 3, 5, 7], 4, "c/1/0")
        assert ans.tokens == [101, 103, 105, 107] and len(ans.trace) == 3
        assert arm.server.proc is proc  # one server per arm, kept between replies
        assert arm.last_timings == {"predicted_per_second": 1.0}
        # under a schema, both requests send it: the held-back id comes from the same reply
        ans = arm.answer([1, 3, 5, 7], 4, "j/0/0", schema={"type": "object"})
        assert ans.tokens == [201, 203, 205, 207]
    finally:
        arm.close()
    assert proc.poll() is not None and arm.server is None
    arm.close()  # twice is fine


def test_a_failed_start_reports_the_logs_last_lines(stand_in):
    arm = peer.LlamaServerArm("llama:ar", "fail.gguf", 512, 1, is_eog)
    try:
        msg = one_line_error(lambda: arm.answer([1], 2, "c/0/0"), "llama-server for llama:ar exited",
                             "failed to load model")
        assert "loading model | error:" in msg
    finally:
        arm.close()


# --- the real server (after `make peer`) -----------------------------------------------------------------


def built_binary():
    try:
        return llama_server.server_binary()
    except InputError:
        return None


@pytest.mark.model
@pytest.mark.skipif(built_binary() is None, reason="no llama-server: run `make peer`")
def test_llama_server_samples_seeded_at_compares_settings(target, lm):
    from conftest import prompt_tokens

    from adaspark_core.base.sampling import Sampling

    prompt = prompt_tokens(lm, "rewrite.txt")
    s = Sampling(0.9, top_p=0.95, seed=5)
    arms = cmp.make_arms(["llama:ngram-simple"], target, None, None, lm.is_eog, model_path=lm.path,
                         n_ctx=target.n_ctx, threads=None, sampling=s)
    try:
        peer_arm = arms[1]
        first, again = (peer_arm.answer(prompt, 48, "p/0/0").tokens for _ in range(2))
        peer_arm.sampling = None
        greedy = peer_arm.answer(prompt, 48, "p/0/0").tokens
    finally:
        cmp.close_arms(arms)
    assert first == again and first != greedy  # seeded: the same sample twice; not the greedy text


@pytest.mark.model
@pytest.mark.skipif(built_binary() is None, reason="no llama-server: run `make peer`")
def test_llama_server_replies_greedily_as_our_ar(target, lm):
    from conftest import prompt_tokens

    prompt = prompt_tokens(lm, "rewrite.txt")
    ours = cmp.SchedulerArm(cmp.parse_arm("ar"), target).answer(prompt, 16, "p/0/0")
    arms = cmp.make_arms(["llama:ar", "llama:ngram-simple"], target, None, None, lm.is_eog,
                         model_path=lm.path, n_ctx=target.n_ctx, threads=None)[1:]
    try:
        for arm in arms:
            ans = arm.answer(prompt, 16, "p/0/0")
            assert ans.tokens[:8] == ours.tokens[:8], arm.name
            assert ans.finish in ("stop", "length") and ans.widths == {}
            assert arm.last_timings and arm.last_timings["predicted_n"] >= len(ans.tokens)
    finally:
        cmp.close_arms(arms)


@pytest.mark.model
@pytest.mark.skipif(built_binary() is None, reason="no llama-server: run `make peer`")
def test_llama_server_drafts_with_the_runs_draft_model(target, lm):
    """The default model as its own draft (a stand-in for --drafter model:FILE): the server loads it,
    speculates (draft_n > 0, which ``-md`` without ``--spec-type draft-simple`` would not) and replies
    greedily as our ar."""
    from conftest import prompt_tokens

    prompt = prompt_tokens(lm, "rewrite.txt")
    ours = cmp.SchedulerArm(cmp.parse_arm("ar"), target).answer(prompt, 16, "p/0/0")
    arms = cmp.make_arms(["llama:draft:4"], target, model_drafter(lm.path), None, lm.is_eog,
                         model_path=lm.path, n_ctx=target.n_ctx, threads=None)[1:]
    try:
        ans = arms[0].answer(prompt, 16, "p/0/0")
        timings = arms[0].last_timings
    finally:
        cmp.close_arms(arms)
    assert ans.tokens[:8] == ours.tokens[:8] and ans.finish in ("stop", "length")
    assert timings and timings.get("draft_n", 0) > 0, timings
