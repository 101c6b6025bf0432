"""The contract every learner keeps (learned.py; river's contract suite, DESIGN.md "Style to
follow"): the cost model, the chooser, the width policy that joins them, the acceptance model, and
``Learners`` itself.

- ``state()`` is JSON and ``from_state`` restores it exactly, into a learner that goes on learning
  as the original would;
- ``learn(rec)`` does not change the round record it reads;
- replaying a run's round log into fresh learners reproduces the run's learners;
- every section carries its version: a section without one (written before versions) is read as
  the oldest, one of a newer version is refused.

The trained state is learned from the checked-in log of a real run of the default model
(fixtures/logs/rounds.jsonl); the live run is the simulated model behind ``--model sim:CURVE``.
"""

import copy
import re

import orjson
import pytest
from conftest import ROOT

from adaspark_core.base.checks import NewerVersion, UnknownField
from adaspark_core.base.errors import StoreError
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.runtime import EngineOptions, Runtime
from adaspark_core.evaluate.replay import replay
from adaspark_core.learn.acceptance import AcceptanceModel
from adaspark_core.learn.chooser import AdaptiveWidth, Chooser
from adaspark_core.learn.cost import CostModel
from adaspark_core.learn.depth import DraftDepth
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import read_log
from adaspark_core.store.store import Store

FIXTURE_LOG = ROOT / "fixtures" / "logs" / "rounds.jsonl"  # re-recorded by `make fixture-log`
# A store of the learners replayed from fixtures/logs/rounds-schema3.jsonl by the learners of its
# day, written before the learners versioned their sections: what every store on disk looked like then.
FIXTURE_STORE = ROOT / "fixtures" / "stores" / "before-versions.json"
SIM = "sim:cpu-smollm2-q4_0"


def part_setter(attr: str):
    """Set a part of a Learners by dotted attribute (``policy.cost``)."""
    def put(ls: Learners, x) -> Learners:
        *up, last = attr.split(".")
        obj = ls
        for a in up:
            obj = getattr(obj, a)
        setattr(obj, last, x)
        return ls
    return put


# name -> (class, the learner inside a Learners, the Learners with that learner replaced)
LEARNERS = {
    "CostModel": (CostModel, lambda ls: ls.policy.cost, part_setter("policy.cost")),
    "Chooser": (Chooser, lambda ls: ls.policy.chooser, part_setter("policy.chooser")),
    "AdaptiveWidth": (AdaptiveWidth, lambda ls: ls.policy, part_setter("policy")),
    "AcceptanceModel": (AcceptanceModel, lambda ls: ls.acceptance, part_setter("acceptance")),
    # untouched here (no draft model in these runs): tests/learn/test_depth.py trains one
    "DraftDepth": (DraftDepth, lambda ls: ls.depth, part_setter("depth")),
    "Learners": (Learners, lambda ls: ls, lambda ls, x: x),
}
each = pytest.mark.parametrize("name", list(LEARNERS))


def js(x):
    """JSON, as a store holds it."""
    return orjson.loads(orjson.dumps(x))


def round_trip(cls, x):
    return cls.from_state(js(x.state()))


@pytest.fixture(scope="module")
def records():
    return list(read_log(FIXTURE_LOG))


@pytest.fixture(scope="module")
def trained(records):
    return replay(records)[0]


# --- (a) state round-trips ---------------------------------------------------------------------


@each
def test_state_is_json_and_restores_exactly(name, trained, live):
    cls, part, _ = LEARNERS[name]
    for x in (part(trained), part(live[0]), cls()):  # two runs' learners (held, splits, bands...), a fresh one
        restored = round_trip(cls, x)
        assert type(restored) is cls and restored is not x
        assert js(restored.state()) == js(x.state())


@each
def test_a_restored_learner_learns_on_as_the_original(name, records):
    """Nothing the next rounds need is left out of ``state()``: a learner restored between two
    requests and replayed on to the log's end is the one that never stopped."""
    cls, part, put = LEARNERS[name]
    cut = next(i for i, r in enumerate(records) if r.first and i > len(records) // 2)
    whole, _ = replay(records)
    first, _ = replay(records[:cut])
    resumed, _ = replay(records[cut:], put(first, round_trip(cls, part(first))))
    assert js(part(resumed).state()) == js(part(whole).state())


# --- (b) learning does not change the record ----------------------------------------------------


@each
def test_learn_does_not_change_the_record(name, records):
    cls, _, _ = LEARNERS[name]
    x = cls()
    mine = copy.deepcopy(records)
    for rec in mine:
        if rec.first and hasattr(x, "start_request"):
            x.start_request()
        before = copy.deepcopy(rec)
        x.learn(rec)
        assert rec == before, f"{name}.learn changed request {rec.request} round {rec.round}"
    assert mine == records  # nor later (the acceptance model keeps rounds for hindsight labels)


# --- (c) replay reproduces the live learners -----------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Learners after a live run of the simulated model (adaspark, then the cost arm, pinned:4
    and ar, one learner set as a server keeps it), its round log and its saved store."""
    tmp = tmp_path_factory.mktemp("live")
    texts = ["Say something, then say it again, and again.", "again and again and again, then more",
             "A list: one, two, three, one, two, three.", "Say something else, and again."]
    with Runtime.open(EngineOptions(model=SIM), "adaspark", store=tmp / "s.json", log=tmp / "log.jsonl") as rt:
        for i, (arm, text) in enumerate(zip(["adaspark", "cost", "pinned:4", "ar", "adaspark"], texts + texts[:1])):
            gen = Generation(rt.target, rt.chat([{"role": "user", "content": text}]), parse_arm(arm), 160,
                             request_id=f"q{i}", log=rt.log, clock=rt.target.clock,
                             learners=rt.learners if parse_arm(arm).learns else None)
            rt.run(gen)
        rt.save(rounds=0, requests=0)
        learners = rt.learners
    return learners, list(read_log(tmp / "log.jsonl")), tmp / "s.json"


def test_the_live_run_exercises_the_learners(live):
    learners, log, _ = live
    assert {r.arm for r in log} == {"adaspark", "cost", "pinned:4", "ar"}
    assert any(r.candidates and r.priced == "fitted" for r in log)  # the fitted model priced
    assert any(r.decision.measure for r in log) and any(r.decision.prices for r in log)  # cold start, then chosen widths
    assert max(r.width for r in log) > 1 and any(r.path for r in log)


@each
def test_replaying_the_log_reproduces_the_live_learners(name, live):
    _, part, _ = LEARNERS[name]
    learners, log, store = live
    replayed, _ = replay(log)
    assert js(part(replayed).state()) == js(part(learners).state())
    saved = Learners.from_store(Store.read(store)[0])
    assert js(part(saved).state()) == js(part(learners).state())


# --- (d) versions ---------------------------------------------------------------------------------


def versions(st, at=()):
    """The dotted paths (as tuples) of every versioned section in ``st``, with their versions."""
    if not isinstance(st, dict):
        return []
    here = [(at, st["version"])] if "version" in st else []
    return here + [p for k, v in st.items() for p in versions(v, (*at, k))]


def unversioned(st):
    """``st`` as written before the learners versioned their sections."""
    if isinstance(st, dict):
        return {k: unversioned(v) for k, v in st.items() if k != "version"}
    return st


def at_path(st, path):
    for k in path:
        st = st[k]
    return st


@each
def test_every_section_has_its_version(name, trained):
    cls, part, _ = LEARNERS[name]
    st = js(part(trained).state())
    found = versions(st)
    if cls is not Learners:
        assert st["version"] == cls.VERSION >= 1
    # every learner's section, its own and its parts'
    assert len(found) == {"CostModel": 1, "Chooser": 1, "AdaptiveWidth": 3, "AcceptanceModel": 1, "DraftDepth": 1,
                          "Learners": 4}[name]


@each
def test_a_section_without_a_version_is_read_as_the_oldest(name, trained):
    cls, part, _ = LEARNERS[name]
    st = js(part(trained).state())
    assert js(cls.from_state(unversioned(st)).state()) == st


@each
def test_a_section_of_a_newer_version_is_refused(name, trained):
    cls, part, _ = LEARNERS[name]
    st = js(part(trained).state())
    for path, v in versions(st):
        newer = copy.deepcopy(st)
        at_path(newer, path)["version"] = v + 1
        where = ".".join(("x", *path, "version"))
        with pytest.raises(NewerVersion, match=re.escape(f"{where} is {v + 1}, this version reads 1 to {v}")):
            cls.from_state(newer, path="x")


@each
@pytest.mark.parametrize("bad", [0, -1, "1", 1.0, None, True])
def test_a_version_that_is_no_version_is_damage(name, bad, trained):
    cls, part, _ = LEARNERS[name]
    st = js(part(trained).state())
    path, _ = versions(st)[0]
    at_path(st, path)["version"] = bad
    with pytest.raises(ValueError, match=r"\.version is .*, not an integer >= 1") as e:
        cls.from_state(st)
    assert not isinstance(e.value, NewerVersion)


def test_the_store_says_a_newer_adaspark_wrote_a_newer_section(trained):
    st = js(trained.state())
    st["acceptance"]["version"] += 1
    with pytest.raises(StoreError, match=r"was written by a newer AdaSpark \(sections\.acceptance\.version is 2, "
                                         r"this version reads 1 to 1\); it was left as is"):
        Learners.from_store(Store("s.json", {}, sections=st))


# What a cost-model class kept until version 3 of its section (cost._without_reach drops them).
DROPPED = ("short", "widest_short")


def without_dropped(sections):
    """``sections`` without the cost classes' dropped fields."""
    out = copy.deepcopy(sections)
    for k in out["width"]["cost"]["classes"].values():
        for f in DROPPED:
            del k[f]
    return out


def test_a_store_written_before_versions_restores_exactly():
    """The checked-in store: a save writes its learners back with their versions and without the
    cost classes' dropped fields, nothing else changed. (It held exactly what replaying its log
    gave the learners of its day; learners changed since, the per-kind n-gram slope and the cost
    model's transfer floor, learn otherwise from the same rounds, so that is no longer compared.)"""
    st, schema = Store.read(FIXTURE_STORE)
    assert schema == 2 and not versions(st.sections)
    assert all(f in k for k in st.sections["width"]["cost"]["classes"].values() for f in DROPPED)
    restored = Learners.from_store(st)
    assert unversioned(js(restored.state())) == without_dropped(st.sections)


def keys(x):
    """Every key of every object in ``x``."""
    if isinstance(x, dict):
        return set(x) | {k for v in x.values() for k in keys(v)}
    if isinstance(x, list):
        return {k for v in x for k in keys(v)}
    return set()


def test_a_version_2_cost_section_drops_the_short_counts(trained, live):
    """Version 2 kept, per class, the measuring rounds too narrow for it (``short``) and their
    widest tree (``widest_short``); no measuring round is narrower than its width, so version 3
    drops both. An old section restores to the same table, and no state or store written now
    holds them (a version-3 section that does is refused, not read)."""
    st = js(trained.policy.cost.state())
    assert st["version"] == CostModel.VERSION == 3 and not keys(st) & set(DROPPED)
    old = copy.deepcopy(st)
    old["version"] = 2
    for w, k in old["classes"].items():
        k["short"], k["widest_short"] = 5, int(w) - 1
    before = copy.deepcopy(old)
    restored = CostModel.from_state(old)
    assert old == before  # the upgrade leaves its input alone
    assert js(restored.state()) == st
    assert not keys(js(trained.state())) & set(DROPPED)
    _, _, store = live
    assert not keys(orjson.loads(store.read_bytes())) & set(DROPPED)
    newer = copy.deepcopy(st)
    next(iter(newer["classes"].values()))["short"] = 0
    with pytest.raises(UnknownField, match=r"cost\.classes\.\d+\.short"):
        CostModel.from_state(newer)


def test_a_schema_1_cost_section_drops_its_level_windows(trained):
    """Version 1 also covers the cost model's layout of store schema 1: one level window per
    class, no contexts (cost.upgrade_state drops it)."""
    st = unversioned(js(trained.policy.cost.state()))
    old = copy.deepcopy(st)
    for k in old["classes"].values():
        k["level"] = [1.1, 0.9]
    before = copy.deepcopy(old)
    restored = CostModel.from_state(old)
    assert old == before  # the upgrade leaves its input alone
    assert all(k.level == {} for k in restored.classes.values())
    assert {w: k.count for w, k in restored.classes.items()} == {int(w): k["count"] for w, k in st["classes"].items()}
