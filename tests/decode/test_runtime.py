"""The runtime (adaspark_core/decode/runtime.py) and the simulated model behind ``--model sim:CURVE``
(adaspark_core/engine/simlm.py) that lets the CLI tests run without llama.cpp."""

import pytest

from adaspark_core.base.errors import InputError
from adaspark_core.decode.runtime import EngineOptions, Runtime, open_model
from adaspark_core.engine import simlm
from adaspark_core.store.fingerprint import fingerprint
from adaspark_core.store.store import Store

SIM = "sim:cpu-smollm2-q4_0"
PROMPT = "Say something, then say it again, and again."


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The simulated model's greedy reply, one token at a time: the re-score every speculative
    arm must reproduce."""
    toks = list(prompt)
    out = []
    stop_at = len(prompt) + simlm.STOP_AFTER if simlm.STOP_MARK.encode() in b"".join(map(model.piece, prompt)) else None
    for _ in range(n):
        pos = len(toks)
        t = simlm.EOG if pos == stop_at else model.next_token(toks[-2] if len(toks) > 1 else 0, toks[-1], pos)
        if model.is_eog(t):
            break
        out.append(t)
        toks.append(t)
    return out


def decode(arm: str, text: str = PROMPT, max_tokens: int = 120, **kw):
    with Runtime.open(EngineOptions(model=SIM), arm, **kw) as rt:
        prompt = rt.chat([{"role": "user", "content": text}])
        gen = rt.generation(prompt, max_tokens)
        reply = rt.run(gen)
        return rt.model, prompt, gen, reply


@pytest.mark.parametrize("arm", ["ar", "chain:3", "tree:8", "pinned:4", "adaspark"])
def test_every_arm_emits_the_simulated_models_greedy_reply(arm, tmp_path):
    model, prompt, gen, reply = decode(arm, store=tmp_path / "s.json")
    want = greedy(model, prompt, 120)
    assert gen.tokens == want
    assert reply == b"".join(map(model.piece, want)).decode()


def test_the_sim_reply_has_accepted_and_rejected_drafts(tmp_path):
    """What makes it a useful stand-in: the n-gram fill finds continuations, some accepted, some
    not, and the learners see widths above one."""
    _, _, gen, _ = decode("adaspark", max_tokens=200, store=tmp_path / "s.json")
    assert max(gen.stats.widths) > 1
    assert sum(n for k, n in gen.stats.accepted.items() if k > 0) > 0
    assert gen.stats.rounds < 200


def test_the_sim_is_deterministic_on_its_virtual_clock(tmp_path):
    runs = [decode("chain:3") for _ in range(2)]
    (_, _, a, ra), (_, _, b, rb) = runs
    assert ra == rb and a.stats.to_json() == b.stats.to_json()
    assert a.stats.decode_tps > 0


def test_a_conversations_next_turn_goes_on_from_the_last_turns_ngram_index():
    """The index the first turn ended with is the one the second turn extends (its prompt starts
    with the first turn's text), and the second reply is what a fresh runtime decodes."""
    turns = [PROMPT, "Now say it once more."]
    with Runtime.open(EngineOptions(model=SIM), "chain:3") as rt:
        messages = [{"role": "user", "content": turns[0]}]
        first = rt.generation(rt.chat(messages), 60)
        messages += [{"role": "assistant", "content": rt.run(first)}, {"role": "user", "content": turns[1]}]
        prompt = rt.chat(messages)
        second = rt.generation(prompt, 60)
        rt.run(second)
        assert second.ngram.index is first.ngram.index and second.ngram.index.start == len(prompt)
    with Runtime.open(EngineOptions(model=SIM), "chain:3") as rt:
        alone = rt.generation(prompt, 60)
        rt.run(alone)
    assert alone.ngram.index is not second.ngram.index
    # The same rounds (the simulated verify times differ: its noise follows the calls made).
    assert second.tokens == alone.tokens
    assert (second.stats.rounds, second.stats.widths, second.stats.accepted) == \
        (alone.stats.rounds, alone.stats.widths, alone.stats.accepted)


def test_a_stop_mark_ends_the_reply_with_the_end_token():
    _, _, gen, reply = decode("adaspark", text=f"then stop {simlm.STOP_MARK}", max_tokens=200)
    assert gen.finish == "stop" and len(gen.tokens) == simlm.STOP_AFTER


def test_a_sim_store_is_keyed_by_the_sims_name(tmp_path):
    path = tmp_path / "s.json"
    with Runtime.open(EngineOptions(model=SIM), "adaspark", store=path) as rt:
        rt.save(rounds=0, requests=0)
    st, _ = Store.read(path)
    assert st.fingerprint["model"] == {"sim": "cpu-smollm2-q4_0"}
    assert fingerprint(SIM)["model"] != fingerprint("sim:cpu-smollm2-q8_0")["model"]


def test_unknown_sim_and_a_drafter_on_a_sim_are_one_clear_error():
    with pytest.raises(InputError, match="unknown simulated model"):
        open_model("sim:nope")
    with pytest.raises(InputError, match="takes no drafter"):
        Runtime.open(EngineOptions(model=SIM, drafter="model:x.gguf"), "ar")


def test_a_failed_open_releases_the_store_and_writes_nothing(tmp_path):
    path = tmp_path / "s.json"
    with pytest.raises(InputError):
        Runtime.open(EngineOptions(model=SIM), "adaspark", store=path, log=tmp_path)  # the log is a folder
    assert not path.exists()
    with Runtime.open(EngineOptions(model=SIM), "adaspark", store=path) as rt:  # not left locked
        assert rt.learners is not None


def test_closing_does_not_save_and_a_fixed_arm_has_no_store(tmp_path):
    path = tmp_path / "s.json"
    with Runtime.open(EngineOptions(model=SIM), "adaspark", store=path):
        pass
    assert not path.exists()
    with Runtime.open(EngineOptions(model=SIM), "chain:3", store=path) as rt:
        assert rt.store is None and rt.learners is None
        rt.save(rounds=3, requests=1)
    assert not path.exists()
