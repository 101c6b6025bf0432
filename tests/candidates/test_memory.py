"""The n-gram memory of earlier requests (issue 16, adaspark_core/candidates/memory.py): lookups, the cap's
eviction, the file beside the store, the fill's memory chains, and a served run that learns
from it and replays exactly."""

import random
import zlib

import numpy as np
import orjson
import pytest
from conftest import SIM

from adaspark_core.base.errors import StoreError
from adaspark_core.base.tree import ANCHOR, NGRAM
from adaspark_core.candidates import memory as mem
from adaspark_core.candidates import memory_file
from adaspark_core.candidates.memory import GRAM, NgramMemory
from adaspark_core.candidates.ngram import MEMORY, SuffixIndex, bucket, fill
from adaspark_core.evaluate.replay import replay
from adaspark_core.store.fingerprint import fingerprint_key
from adaspark_core.store.record import read_log


def docs(n, length, vocab=40, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def brute_lookup(documents, tail):
    """The longest match of at least GRAM tokens ending a document position with a follower,
    ties to the newest; over every occurrence (the memory scans the newest SCAN of its gram)."""
    best = None
    for d in documents:
        for e in range(GRAM - 1, len(d) - 1):
            m = 0
            while m < len(tail) and e - m >= 0 and d[e - m] == tail[-1 - m]:
                m += 1
            if m >= GRAM and (best is None or m >= best[1]):
                best = (d[e + 1], m)
    return best


def test_a_lookup_finds_the_longest_match_and_reads_on_to_the_documents_end():
    ds = docs(30, 120)
    m = NgramMemory()
    for d in ds:
        m.add(d)
    assert m.n_tokens == 30 * 120 and m.documents == 30
    rng = random.Random(2)
    for _ in range(200):
        d = rng.choice(ds)
        e = rng.randrange(GRAM, len(d) - 1)
        tail = tuple(d[max(0, e - 12) : e + 1])
        token, length, p = m.lookup(tail)
        assert (token, length) == brute_lookup(ds, tail)
        assert m.tokens[p] == token
    # read on: the document's tokens, then its end
    last = ds[-1]
    token, length, p = m.lookup(tuple(last[-8:-1]))
    assert token == last[-1] and m.read_on(p) is None
    assert m.lookup((99, 98, 97, 96)) is None and m.lookup(tuple(last[:3])) is None  # unseen; shorter than GRAM


def test_no_match_runs_across_two_documents():
    m = NgramMemory()
    m.add([1, 2, 3, 4, 5, 6])
    m.add([7, 8, 9, 10, 11, 12])
    assert m.lookup((5, 6, 7, 8, 9, 10)) == (11, 4, m.tokens.index(11))  # only 7 8 9 10 matches
    assert m.lookup((3, 4, 5, 6)) is None  # 6 ends its document: no follower


def test_the_cap_drops_the_oldest_documents_and_the_index_stays_exact():
    ds = docs(60, 200, vocab=30, seed=3)
    cap_mb = 50 * 200 * mem.BYTES_PER_TOKEN / 1e6  # room for about 50 documents
    m = NgramMemory(cap_mb)
    for d in ds:
        m.add(d)
    assert m.nbytes <= cap_mb * 1e6 and m.evicted > 0
    kept = m.documents
    assert 30 <= kept < 60
    fresh = NgramMemory()
    for d in ds[-kept:]:  # the newest survive, in order
        fresh.add(d)
    assert list(m.tokens) == list(fresh.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(m.index(), fresh.index()))


def test_the_file_round_trips_and_a_bad_one_is_reported_and_left_as_is(tmp_path):
    store = tmp_path / "s.json"
    m = NgramMemory()
    for d in docs(5, 50):
        m.add(d)
    m.lookup(tuple(docs(5, 50)[0][:6]))
    m.note(rows=7, accepted=3)
    memory_file.save(m, store, "owner-a")
    assert not m.dirty
    back = memory_file.load(store, "owner-a")
    assert list(back.tokens) == list(m.tokens) and np.array_equal(back.index()[0], m.index()[0])
    assert back.summary() == m.summary()
    with pytest.raises(StoreError, match="another model"):
        memory_file.load(store, "owner-b")
    path = memory_file.memory_path(store)
    good = path.read_bytes()
    for bad in (good[:-3], b"junk", good.replace(b'"version":2', b'"version":9'),
                good[: len(mem.MAGIC)] + b"{]\n"):
        path.write_bytes(bad)
        with pytest.raises(StoreError, match="cannot be used") as e:
            memory_file.load(store, "owner-a")
        assert "store reset --memory" in str(e.value)
        assert path.read_bytes() == bad  # left as is
    assert memory_file.load(tmp_path / "none.json", "x").n_tokens == 0


def written(tmp_path, documents):
    """(the store path, its memory's file, the memory) of a memory of ``documents`` saved beside it."""
    store = tmp_path / "s.json"
    m = NgramMemory()
    for d in documents:
        m.add(d)
    memory_file.save(m, store, "owner-a")
    return store, memory_file.memory_path(store), m


def test_a_flipped_byte_is_reported_by_the_checksum_and_the_file_left_as_is(tmp_path):
    """A byte that still leaves every token an id of the vocabulary: only the checksum tells."""
    store, path, m = written(tmp_path, docs(5, 50))
    good = path.read_bytes()
    at = len(good) - mem.CHECKSUM_BYTES - 4 * 7  # the low byte of a token of the last document
    assert 0 <= int.from_bytes(good[at : at + 4], "little") < 40  # an id of docs' vocabulary, so is t ^ 1
    damaged = good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :]
    path.write_bytes(damaged)
    with pytest.raises(StoreError) as e:
        memory_file.load(store, "owner-a", n_vocab=40)
    message = str(e.value)
    assert f"the n-gram memory {path} cannot be used: it is damaged: checksum" in message
    assert "store reset --memory" in message and "\n" not in message
    assert path.read_bytes() == damaged  # reported, never replaced
    path.write_bytes(good)
    assert list(memory_file.load(store, "owner-a", n_vocab=40).tokens) == list(m.tokens)


def test_a_version_1_file_still_reads_and_its_next_save_writes_the_checksum(tmp_path):
    store, path, m = written(tmp_path, docs(3, 40))
    head = {"version": 1, "owner": "owner-a", "documents": m.documents, "size": len(m.tokens), "evicted": 0,
            "lookups": 0, "found": 0, "rows": 0, "accepted": 0}
    path.write_bytes(mem.MAGIC + orjson.dumps(head) + b"\n" + np.asarray(m.tokens, "<i4").tobytes())  # no checksum
    old = memory_file.load(store, "owner-a", n_vocab=40)
    assert list(old.tokens) == list(m.tokens) and old.summary() == m.summary()
    old.add(docs(1, 40, seed=9)[0])
    memory_file.save(old, store, "owner-a")
    raw = path.read_bytes()
    assert orjson.loads(raw[len(mem.MAGIC) : raw.index(b"\n", len(mem.MAGIC))])["version"] == 2
    assert int.from_bytes(raw[-mem.CHECKSUM_BYTES :], "little") == zlib.crc32(raw[: -mem.CHECKSUM_BYTES])
    assert memory_file.load(store, "owner-a").documents == 4


def chain(cands):
    return [(c.token, c.kind, c.evidence) for c in cands]


def test_the_fill_reads_the_memory_where_the_requests_own_text_has_no_copy():
    m = NgramMemory()
    m.add([50, 51, 52, 53, 54, 55, 56, 57])
    index = SuffixIndex()
    index.extend([9, 8, 50, 51, 52, 53])  # the request's own text has no earlier copy of this context
    cands = []
    fill(cands, index, depth_limit=6, max_alts=0, memory=m)
    assert chain(cands) == [(54, MEMORY, 4), (55, MEMORY, 5), (56, MEMORY, 6), (57, MEMORY, 7)]  # then the document ends
    assert all(c.source == NGRAM for c in cands) and cands[0].parent == ANCHOR
    assert cands[1].bucket == bucket(MEMORY, 5, 1)
    # the request's own copy wins over the memory
    index = SuffixIndex()
    index.extend([50, 51, 52, 53, 60, 61, 62, 50, 51, 52, 53])
    cands = []
    fill(cands, index, depth_limit=3, max_alts=0, memory=m)
    assert [c.token for c in cands] == [60, 61, 62] and MEMORY not in {c.kind for c in cands}
    # where the memory goes on differently from the own copy, its chain is a sibling
    m.add([50, 51, 52, 53, 70, 71, 72])
    cands = []
    fill(cands, index, depth_limit=3, max_alts=3, memory=m)
    assert chain(cands)[:3] == [(60, "copy", 4), (61, "copy", 5), (62, "copy", 6)]
    sib = [c for c in cands if c.kind == MEMORY]
    assert [(c.token, c.evidence, c.depth) for c in sib] == [(70, 4, 1), (71, 5, 2), (72, 6, 3)]
    assert sib[0].parent == ANCHOR
    # no memory: the same fill as before
    cands = []
    fill(cands, index, depth_limit=3, max_alts=0)
    assert [c.token for c in cands] == [60, 61, 62]


def test_a_served_run_remembers_its_replies_saves_them_beside_the_store_and_replays_exactly(tmp_path, monkeypatch):
    from adaspark_core.decode import runtime
    from adaspark_core.decode.runtime import EngineOptions, Runtime
    from adaspark_core.serve.service import serve_request

    # A loaded machine can make the first memory write slower than the throttle's bound, which then
    # skips the second reply's write for MEMORY_EVERY_S: this test is about what is written.
    monkeypatch.setattr(runtime, "MEMORY_SLOW_S", float("inf"))

    store, log = tmp_path / "store.json", tmp_path / "rounds.jsonl"
    with Runtime.open(EngineOptions(model=SIM), "adaspark", store=store, log=log) as rt:
        prompt = rt.chat([{"role": "user", "content": "Tell me about rivers."}])
        first = serve_request(rt, prompt, 160, "a")
        second = serve_request(rt, prompt, 160, "b")
        summary = rt.memory.summary()
    assert first.text == second.text
    assert summary["documents"] == 2 and summary["rows"] > 0 and summary["lookups"] > 0
    records = list(read_log(log))
    kinds = {(r.request, c["kind"]) for r in records for c in r.candidates}
    assert ("b", MEMORY) in kinds and ("a", MEMORY) not in kinds  # the first reply had nothing to remember
    _, report = replay(records)  # raises ReplayMismatch where the log and the learners disagree
    assert report.rows["memory"] == summary["rows"] and report.accepted["memory"] == summary["accepted"]
    owner = fingerprint_key(orjson.loads(store.read_bytes())["fingerprint"])
    saved = memory_file.load(store, owner)
    assert saved.documents == 2 and saved.summary()["rows"] == summary["rows"]


def test_a_slow_memory_write_waits_between_replies_but_not_at_the_servers_last_save(tmp_path, monkeypatch):
    """A big memory's file takes tens of ms to rewrite, and a reply's end waits for it: between a
    server's replies a write slower than MEMORY_SLOW_S is repeated only every MEMORY_EVERY_S (the
    learners are saved every time); the server's last save, and a save outside a server, write
    it whenever it changed. Here every write counts as slow."""
    from adaspark_core.decode import runtime
    from adaspark_core.decode.runtime import EngineOptions, Runtime
    from adaspark_core.serve.service import keep, serve_request

    monkeypatch.setattr(runtime, "MEMORY_SLOW_S", -1.0)
    monkeypatch.setattr(runtime, "MEMORY_EVERY_S", 3600.0)
    store = tmp_path / "store.json"

    def on_disk() -> tuple[int, int]:
        owner = fingerprint_key(orjson.loads(store.read_bytes())["fingerprint"])
        return orjson.loads(store.read_bytes())["counts"]["requests"], memory_file.load(store, owner).documents

    with Runtime.open(EngineOptions(model=SIM), "adaspark", store=store) as rt:
        prompt = rt.chat([{"role": "user", "content": "Tell me about rivers."}])
        serve_request(rt, prompt, 160, "a")
        assert on_disk() == (1, 1)  # the first write is due
        serve_request(rt, prompt, 160, "b")
        assert on_disk() == (2, 1)  # the learners are saved; the slow memory waits
        assert rt.memory.dirty and rt.memory.documents == 2
        keep(rt, 0, 0, None)  # the server's last save
        assert on_disk() == (2, 2) and not rt.memory.dirty


def test_the_recent_run_merges_into_the_index_a_single_run_would_be(monkeypatch):
    """New documents go into a small recent run, merged into the main one when it fills (so a
    reply's end does not move the whole index). Merging often, never, or building the index at
    once must give the same index and the same answer to every lookup, also where a gram's
    newest SCAN occurrences straddle the two runs (a small vocabulary repeats every gram)."""
    ds = docs(80, 60, vocab=4, seed=9)
    monkeypatch.setattr(mem, "RECENT_MAX", 150)
    often = NgramMemory()
    for d in ds:
        often.add(d)
    assert 0 < len(often._rkeys) < 150 and len(often._keys) > 150  # both runs hold grams
    monkeypatch.setattr(mem, "RECENT_MAX", 10**9)
    never = NgramMemory()
    for d in ds:
        never.add(d)
    assert len(never._keys) == 0
    once = NgramMemory()
    once.add_many(ds)
    assert len(once._rkeys) == 0
    for m in (often, never):
        assert all(np.array_equal(a, b) for a, b in zip(m.index(), once.index()))
    rng = random.Random(4)
    tails = [tuple(rng.randrange(4) for _ in range(rng.randrange(GRAM, GRAM + 8))) for _ in range(400)]
    answers = [once.lookup(t) for t in tails]
    main_top = int(often._ends.max()) + 1  # the last position a main-run answer can give
    assert sum(a is not None and a[2] > main_top for a in answers) > 20  # answered from the recent run
    assert sum(a is not None and a[2] <= main_top for a in answers) > 20
    assert [often.lookup(t) for t in tails] == answers == [never.lookup(t) for t in tails]


def test_a_corpus_added_at_once_is_the_memory_of_its_documents_added_one_by_one():
    ds = docs(40, 90, vocab=25, seed=5)
    one, many = NgramMemory(), NgramMemory()
    for d in ds:
        one.add(d)
    many.add_many(ds + [[1, 2]])  # too short to keep
    assert list(one.tokens) == list(many.tokens) and one.documents == many.documents == 40
    assert all(np.array_equal(a, b) for a, b in zip(one.index(), many.index()))


# --- the commands -----------------------------------------------------------------------------


def test_decodes_remember_their_replies_and_the_store_commands_show_and_reset_the_memory(tmp_path):
    from conftest import PROMPTS
    from helpers import adaspark, assert_one_error_line

    store = tmp_path / "store.json"
    mem_file = memory_file.memory_path(store)
    for _ in range(2):
        res = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "-n", 48, "--store", store, "--json")
        assert res.returncode == 0, res.stderr
    shown = orjson.loads(adaspark("store", "show", "--store", store, "--json").stdout)["memory"]
    assert shown["documents"] == 2 and shown["tokens"] > 0 and shown["file_bytes"] == mem_file.stat().st_size
    assert shown["rows"] > 0 and 0 <= shown["acceptance"] <= 1  # the second decode verified memory nodes
    text = adaspark("store", "show", "--store", store).stdout
    assert "N-gram memory: 2 documents" in text and "memory nodes verified" in text
    # a corpus, added once
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A corpus line the model may say again.\n" * 20)
    res = adaspark("store", "memorize", corpus, "--model", SIM, "--store", store)
    assert res.returncode == 0 and "memorized 1 file" in res.stdout, res.stderr
    assert orjson.loads(adaspark("store", "show", "--store", store, "--json").stdout)["memory"]["documents"] == 3
    # a damaged memory: one error line, the file left as is, for decode and for show
    good = mem_file.read_bytes()
    mem_file.write_bytes(good[:-1])
    for res in (adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "-n", 8, "--store", store),
                adaspark("store", "show", "--store", store)):
        assert_one_error_line(res, "n-gram memory", "store reset --memory")
    assert mem_file.read_bytes() == good[:-1]
    # reset the memory alone, then decode without one
    assert adaspark("store", "reset", "--store", store, "--memory").returncode == 2  # needs --yes
    res = adaspark("store", "reset", "--store", store, "--memory", "--yes")
    assert res.returncode == 0 and not mem_file.exists() and store.exists()
    res = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "-n", 8, "--store", store, "--memory-mb", 0)
    assert res.returncode == 0 and not mem_file.exists()
    adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "-n", 8, "--store", store)
    assert mem_file.exists()
    res = adaspark("store", "reset", "--store", store, "--yes")  # the whole store takes its memory along
    assert res.returncode == 0 and not store.exists() and not mem_file.exists()
