"""``adaspark store show|reset|export|import`` and ``adaspark inspect-store``, end to end.

The store is built by replaying the checked-in log of a real run (fixtures/logs/rounds.jsonl)
into fresh learners and saving them, keyed by a stand-in model file (the fingerprint hashes the
file; nothing loads it), under a private ADASPARK_HOME. The commands run as subprocesses of the
real CLI. Expected values come from the learners, never from numbers copied out of the fixture.
"""

import math

import numpy as np
import orjson
import pytest
from conftest import PROMPTS
from helpers import adaspark, assert_one_error_line

from adaspark_core.evaluate.replay import replay
from adaspark_core.evaluate.store_report import COEFFICIENTS, CONTEXTS, affine_fit, summarize
from adaspark_core.learn.learned import Learners
from adaspark_core.store.fingerprint import fingerprint, fingerprint_key
from adaspark_core.store.record import read_log
from adaspark_core.store.store import Store, default_store_path

FIXTURE_LOG = PROMPTS.parent / "logs" / "rounds.jsonl"


def ok(res):
    assert res.returncode == 0, res.stderr
    return res


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    # the subprocesses inherit it: the default store and the digest cache live under it
    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def replayed():
    records = list(read_log(FIXTURE_LOG))
    learners, report = replay(records)
    return learners, len(report.requests), len(records)


def fake_model(path, seed: int):
    path.write_bytes(np.random.default_rng(seed).bytes(4096))
    return path


@pytest.fixture
def model(tmp_path):
    return fake_model(tmp_path / "model.gguf", 1)


@pytest.fixture
def other_model(tmp_path):
    return fake_model(tmp_path / "other.gguf", 2)


def save_store(path, fp, replayed):
    learners, requests, rounds = replayed
    with Store.open(path, fp) as st:  # closed: the commands under test may write it
        learners.to_store(st)
        st.bump(requests=requests, rounds=rounds)
        st.save()
    return path


@pytest.fixture
def store(model, replayed):
    """The default store of ``model`` on this machine, learned from the fixture log."""
    fp = fingerprint(model)
    return save_store(default_store_path(fp), fp, replayed)


def restored(path):
    fp = orjson.loads(path.read_bytes())["fingerprint"]
    st, _ = Store.read(path, fp)
    return st, Learners.from_store(st)


def show_json(*args):
    return orjson.loads(ok(adaspark("store", "show", "--json", *args)).stdout)


# --- show ---------------------------------------------------------------------------------------


def test_show_json_reports_the_learners_state(store, model, replayed):
    st, learners = restored(store)
    cost, ch, acc = learners.policy.cost, learners.policy.chooser, learners.acceptance
    out = show_json("--model", model)

    fp = fingerprint(model)
    assert out["path"] == str(store)
    assert out["fingerprint"]["key"] == fingerprint_key(fp) == store.stem
    assert out["fingerprint"]["model"] == fp["model"] and out["fingerprint"]["machine"] == fp["machine"]
    assert "drafter" not in out["fingerprint"]
    _, requests, rounds = replayed
    assert out["counts"] == {"requests": requests, "rounds": rounds, "cost_rounds": cost.rounds,
                             "chooser_rounds": sum(d.count for d in ch.bands.values()),
                             "acceptance_requests": acc.requests}
    assert requests >= 2 and cost.rounds == rounds

    c_out = out["cost"]
    assert c_out["widths"] == cost.widths and len(cost.widths) >= 2
    assert c_out["d_now_ms"] == cost.d_now() > 0
    assert c_out["contexts"] == list(CONTEXTS)
    assert [k["width"] for k in c_out["classes"]] == cost.widths
    below = 0
    for k in c_out["classes"]:
        w, wc = k["width"], cost.classes[k["width"]]
        assert k["rows"] == [below + 1, w]  # the classes tile 1 .. the widest width
        below = w
        assert k["count"] == wc.count and k["law"]["samples"] == wc.law.samples and k["d_ref_ms"] == wc.d_ref
        if wc.law.samples == 0:  # a width no round made worth measuring: nothing to report
            assert all(k["law"]["time_ms"][str(c)] is None for c in CONTEXTS) and wc.count == 0
            continue
        for c in CONTEXTS:
            assert k["law"]["time_ms"][str(c)] == pytest.approx(wc.law.value(c), rel=1e-12)
            assert k["price_ms"][str(c)] == pytest.approx(cost.class_price(w, c), rel=1e-12)
            offered = cost.prices(c).get(w)  # None for a width measured fewer than 3 times
            assert k["offered_price_ms"][str(c)] == (None if offered is None else pytest.approx(offered, rel=1e-12))
        # Table 1's fit: least squares of the law over [443, 8444], checked against numpy's
        xs = np.linspace(443, 8444, 64)
        beta, alpha = np.polyfit(xs, [wc.law.value(int(round(x))) for x in xs], 1)
        fit = k["law"]["fit"]
        assert fit["contexts"] == [443, 8444]
        assert fit["alpha_ms"] == pytest.approx(alpha, rel=1e-9, abs=1e-9)
        assert fit["beta_ms_per_1k"] == pytest.approx(1000 * beta, rel=1e-6, abs=1e-9)
        assert 0 <= fit["max_residual"] < 0.5
        assert {lv["band"]: lv["window"] for lv in k["levels"]} == {b: list(v) for b, v in wc.level.items()}
        for lv in k["levels"]:
            assert lv["factor"] == min(max(min(lv["window"]), 0.5), 2.0)
    assert any(k["levels"] for k in c_out["classes"])

    bands = out["chooser"]["bands"]
    assert [b["band"] for b in bands] == sorted(ch.bands)
    for b in bands:
        d = ch.bands[b["band"]]
        assert b["rounds"] == d.count and b["rho_tokens_per_ms"] == d.ratio > 0
        assert b["contexts"] == [1 << (b["band"] - 1), (1 << b["band"]) - 1]
    assert out["chooser"]["incumbent"] == ch.incumbent

    a = out["acceptance"]
    assert [c["name"] for c in a["coefficients"]][: len(COEFFICIENTS)] == list(COEFFICIENTS)
    for c in a["coefficients"]:
        assert c["weight"] == acc.coef.weight(c["name"]) and c["labels"] == acc.coef.m.get(c["name"], 0)
    # every bucket weight, largest |weight| first, with its label count
    assert {b["key"] for b in a["buckets"]} == set(acc.buckets.z) and len(a["buckets"]) > 0
    for b in a["buckets"]:
        assert b["weight"] == acc.buckets.weight(b["key"]) and b["labels"] == acc.buckets.m[b["key"]]
    mags = [abs(b["weight"]) for b in a["buckets"]]
    assert mags == sorted(mags, reverse=True)
    assert a["requests"] == acc.requests and a["guard"]["priced_by"] in ("fitted", "head")


def test_show_text_has_the_key_lines(store, model):
    st, learners = restored(store)
    cost = learners.policy.cost
    text = ok(adaspark("store", "show", "--model", model)).stdout
    lines = text.splitlines()
    assert lines[0] == f"Store {store}"
    assert any(line.split() == ["key", store.stem] for line in lines)
    assert f"Seen: {st.counts['requests']} requests, {st.counts['rounds']} rounds" in text
    assert f"Learned widths: {' '.join(map(str, cost.widths))} (" in text
    assert f"Round fixed cost D now: {cost.d_now():.3f} ms" in text
    for heading in ("T(443)", "T(1,596)", "T(8,444)", "alpha (ms)", "beta (ms/1k)", "Prices the chooser reads",
                    "Levels per context band", "Band rates rho", "Acceptance model", "Bucket weights"):
        assert heading in text
    # each class's row carries its law at the three contexts
    for w in cost.widths:
        row = next(line.split() for line in lines if line.split()[:1] == [str(w)])
        for c in CONTEXTS:
            law = cost.classes[w].law
            assert (f"{law.value(c):.2f}" if law.samples else "-") in row
    n = len(learners.acceptance.buckets.z)
    assert f"Bucket weights: {n} buckets" in text
    listed = [line.split()[0] for line in lines if line.split()[:1] and line.split()[0] in learners.acceptance.buckets.z]
    assert len(listed) == min(n, 12)


def test_inspect_store_is_the_same_command(store, model):
    by_model = adaspark("store", "show", "--model", model, "--json")
    assert ok(adaspark("inspect-store", "--model", model, "--json")).stdout == by_model.stdout
    assert ok(adaspark("inspect-store", "--store", store, "--json")).stdout == by_model.stdout
    assert ok(adaspark("inspect-store", "--store", store)).stdout == ok(adaspark("store", "show", "--store", store)).stdout


def test_show_at_other_contexts(store):
    out = show_json("--store", store, "-c", 300, "--context", 200)
    assert out["cost"]["contexts"] == [200, 300]
    k = out["cost"]["classes"][0]
    assert set(k["law"]["time_ms"]) == {"200", "300"} and k["law"]["fit"]["contexts"] == [200, 300]


def test_summarize_is_plain_json(store):
    st, learners = restored(store)
    s = summarize(st)
    assert orjson.loads(orjson.dumps(s)) == s  # str keys, no infinities
    assert s == summarize(st, learners)


def test_affine_fit_known_answer():
    fit = affine_fit(lambda c: 2.0 + 0.003 * c, 443, 8444)
    assert fit["alpha_ms"] == pytest.approx(2.0) and fit["beta_ms_per_1k"] == pytest.approx(3.0)
    assert fit["max_residual"] == pytest.approx(0.0, abs=1e-12)
    assert affine_fit(lambda c: math.inf, 443, 8444) is None


def test_an_empty_store_shows(tmp_path, model):
    fp = fingerprint(model)
    path = tmp_path / "empty.json"
    with Store.open(path, fp) as st:
        st.save()
    out = show_json("--store", path, "--model", model)
    assert out["counts"]["requests"] == 0 and out["cost"]["measuring"] == 1
    assert all(k["law"]["time_ms"]["443"] is None and k["law"]["fit"] is None for k in out["cost"]["classes"])
    assert out["chooser"]["bands"] == [] and out["chooser"]["incumbent"] is None
    assert "no incumbent yet" in ok(adaspark("store", "show", "--store", path)).stdout


# --- missing and bad stores ---------------------------------------------------------------------------


def test_a_missing_store_is_one_error_line(tmp_path, model):
    # exit 2: there is nothing to show, and a script should not mistake a message for a report
    assert_one_error_line(adaspark("store", "show", "--model", model), "no store yet at",
                          str(default_store_path(fingerprint(model))))
    assert_one_error_line(adaspark("inspect-store", "--store", tmp_path / "none.json", "--json"), "no store yet")
    assert_one_error_line(adaspark("store", "show", "--model", tmp_path / "nope.gguf"), "model file not found")
    assert_one_error_line(adaspark("store", "export", tmp_path / "x.json", "--store", tmp_path / "none.json"),
                          "no store yet", "nothing was exported")
    assert not (tmp_path / "x.json").exists()


GARBAGE = bytes(range(256)) * 3


def bad_store(kind, path, fp, other_model, replayed):
    if kind == "garbage":
        path.write_bytes(GARBAGE)
    elif kind == "truncated":
        path.write_bytes(b'{"schema": 2, "fingerp')
    elif kind == "schema":
        path.write_bytes(b'{"schema": 99, "fingerprint": {}, "counts": {"requests": 0, "rounds": 0}, "sections": {}}')
    elif kind == "section":  # a learner section this version cannot read
        path.write_bytes(orjson.dumps({"schema": 2, "fingerprint": fp, "counts": {"requests": 0, "rounds": 0},
                                       "sections": {"width": {"cost": {"rounds": "x"}}}}))
    else:  # another model's store
        save_store(path, fingerprint(other_model), replayed)
    return path


@pytest.mark.parametrize("kind,words", [("garbage", ["corrupt", "left as is"]), ("truncated", ["corrupt"]),
                                        ("schema", ["unknown schema 99"]), ("section", ["cannot read"]),
                                        ("other", ["another model or machine", "model.sha256"])])
def test_a_bad_store_is_one_error_line_and_left_alone(kind, words, model, other_model, replayed):
    fp = fingerprint(model)
    path = bad_store(kind, default_store_path(fp), fp, other_model, replayed)
    before = path.read_bytes()
    for args in (["store", "show", "--model", model], ["store", "show", "--model", model, "--json"],
                 ["inspect-store", "--model", model]):
        assert_one_error_line(adaspark(*args), str(path), *words)
    if kind == "other":
        # --store alone reads a store of any model (it is only shown); with --model it must match
        assert show_json("--store", path)["fingerprint"]["key"] == fingerprint_key(fingerprint(other_model))
        assert_one_error_line(adaspark("store", "show", "--store", path, "--model", model), "another model")
    elif kind != "section":
        assert_one_error_line(adaspark("store", "show", "--store", path), *words)
        exported = path.parent / "exported.json"
        assert_one_error_line(adaspark("store", "export", exported, "--model", model), "nothing was exported")
        assert not exported.exists()
    assert path.read_bytes() == before


# --- reset, export, import ----------------------------------------------------------------------------


def test_reset_needs_yes_and_removes_only_the_store(store, model, tmp_path):
    before = store.read_bytes()
    assert_one_error_line(adaspark("store", "reset", "--model", model), "--yes", str(store))
    assert store.read_bytes() == before
    sibling = store.parent / "digests.json"
    assert sibling.exists()
    assert str(store) in ok(adaspark("store", "reset", "--model", model, "--yes")).stdout
    assert not store.exists() and sibling.exists()
    assert "no store" in ok(adaspark("store", "reset", "--model", model, "--yes")).stdout
    bad = tmp_path / "bad.json"
    bad.write_bytes(GARBAGE)  # reset is the remedy for a corrupt store
    ok(adaspark("store", "reset", "--store", bad, "-y"))
    assert not bad.exists()


def test_reset_names_a_memory_it_cannot_remove_and_removes_nothing(store, model):
    memory = store.with_name(store.name + ".memory")
    memory.mkdir()  # a folder where the memory's file goes
    (memory / "kept").write_text("a user's file")
    before = store.read_bytes()
    for only in (["--memory"], []):
        res = adaspark("store", "reset", "--model", model, "--yes", *only)
        assert_one_error_line(res, f"cannot remove the n-gram memory {memory}: it is a directory", "nothing was removed")
    assert store.read_bytes() == before and (memory / "kept").read_text() == "a user's file"


def test_export_reset_import_round_trip(store, model, tmp_path):
    shown = show_json("--model", model)
    dest = tmp_path / "out" / "copy.json"
    res = ok(adaspark("store", "export", dest, "--model", model))
    assert str(dest) in res.stdout and dest.read_bytes() == store.read_bytes()
    exported = dest.read_bytes()

    ok(adaspark("store", "reset", "--model", model, "--yes"))
    res = ok(adaspark("store", "import", dest, "--model", model))
    assert "imported" in res.stdout and store.exists()
    again = show_json("--model", model)
    for volatile in ("updated", "file_bytes"):
        shown.pop(volatile), again.pop(volatile)
    assert again == shown
    assert dest.read_bytes() == exported  # the source is never modified

    # the same state again: nothing to do, nothing written
    before = store.read_bytes()
    assert "nothing changed" in ok(adaspark("store", "import", dest, "--model", model)).stdout
    assert store.read_bytes() == before


def test_import_keeps_a_different_store_unless_forced(store, model, tmp_path, replayed):
    dest = tmp_path / "copy.json"
    ok(adaspark("store", "export", dest, "--store", store))
    with Store.open(store, fingerprint(model)) as st:
        st.bump(requests=1, rounds=5)  # the store learned on after the export
        st.save()
    before = store.read_bytes()
    assert_one_error_line(adaspark("store", "import", dest, "--model", model), "different store", "--force")
    assert store.read_bytes() == before
    ok(adaspark("store", "import", dest, "--model", model, "--force"))
    assert Store.read(store, fingerprint(model))[0].counts == orjson.loads(dest.read_bytes())["counts"]

    # an unreadable file in the way is not replaced without --force either
    store.write_bytes(GARBAGE)
    assert_one_error_line(adaspark("store", "import", dest, "--model", model), "not a readable store", "--force")
    assert store.read_bytes() == GARBAGE
    ok(adaspark("store", "import", dest, "--model", model, "--force"))
    Store.read(store, fingerprint(model))


def test_import_checks_the_fingerprint(store, model, other_model, tmp_path):
    dest = tmp_path / "copy.json"
    ok(adaspark("store", "export", dest, "--model", model))
    target = default_store_path(fingerprint(other_model))
    assert_one_error_line(adaspark("store", "import", dest, "--model", other_model),
                          "another model or machine", "nothing was imported", "--force")
    assert not target.exists()
    # --store with no --model: checked against the default model's fingerprint, which needs it
    assert_one_error_line(adaspark("store", "import", dest, "--store", tmp_path / "t.json"), "default model")
    assert not (tmp_path / "t.json").exists()

    res = ok(adaspark("store", "import", dest, "--model", other_model, "--force"))
    assert "rewritten" in res.stdout
    moved, _ = Store.read(target, fingerprint(other_model))  # now keyed by the other model
    assert moved.sections == Store.read(store, fingerprint(model))[0].sections

    bad = tmp_path / "bad.json"
    bad.write_bytes(GARBAGE)
    assert_one_error_line(adaspark("store", "import", bad, "--store", tmp_path / "t2.json", "--model", model),
                          "corrupt", "nothing was imported")
    assert not (tmp_path / "t2.json").exists() and bad.read_bytes() == GARBAGE


def test_a_drafter_keys_another_store(store, model, tmp_path):
    drafter = fake_model(tmp_path / "drafter.gguf", 3)
    assert_one_error_line(adaspark("store", "show", "--model", model, "--drafter", f"dspark:{drafter}"), "no store yet")
    assert_one_error_line(adaspark("store", "show", "--model", model, "--drafter", "bogus"), "unknown drafter")
    dest = tmp_path / "copy.json"
    ok(adaspark("store", "export", dest, "--model", model))
    ok(adaspark("store", "import", dest, "--model", model, "--drafter", f"model:{drafter}", "--force"))
    out = show_json("--model", model, "--drafter", f"model:{drafter}")
    assert out["fingerprint"]["drafter"] == fingerprint(model, drafter)["drafter"]
