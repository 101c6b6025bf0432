"""A store's learner sections are checked whole before use (issue 13): every field's shape and
range, through each learner's own ``from_state`` (adaspark_core/base/checks.py). A damaged section, or
a field this version does not know, is one StoreError from ``Learners.from_store``, before any
decoding, and the file is left as it was; a valid section restores exactly.

The valid state is learned by replaying the checked-in log of a real run of the default model
(fixtures/logs/rounds.jsonl); each damaged variant changes one field of it.
"""

import copy
import math

import numpy as np
import orjson
import pytest
from conftest import PROMPTS, SIM
from helpers import adaspark, assert_one_error_line

from adaspark_core.base.errors import StoreError
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.engine.sim import make_sim
from adaspark_core.evaluate.replay import replay
from adaspark_core.learn.learned import Learners
from adaspark_core.store.fingerprint import fingerprint
from adaspark_core.store.record import read_log
from adaspark_core.store.store import SCHEMA, Store

FIXTURE_LOG = PROMPTS.parent / "logs" / "rounds.jsonl"
FP = {"model": {"size": 1, "sha256": "0" * 64}}  # from_store reads the sections only


def json_copy(x):
    return orjson.loads(orjson.dumps(x))


@pytest.fixture(scope="module")
def trained():
    """The store sections of learners that learned from a real run (JSON, as a store holds them)."""
    learners, _ = replay(list(read_log(FIXTURE_LOG)))
    return json_copy(learners.state())


def restore(sections):
    return Learners.from_store(Store("store.json", FP, sections=sections))


# --- damaged sections ---------------------------------------------------------------------------------

class Delete:
    def __repr__(self):
        return "DELETE"


DELETE = Delete()  # remove the field


class Key:
    """Move the entry at the path to the key ``new`` (a class width, a band)."""

    def __init__(self, new):
        self.new = new

    def __repr__(self):
        return f"Key({self.new!r})"


def damaged(sections, path, value):
    """A copy of ``sections`` with the field at the dotted ``path`` set to ``value`` (or deleted,
    or moved to another key)."""
    d = copy.deepcopy(sections)
    *parents, last = path.split(".")
    node = d
    for k in parents:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        last = int(last)
    if value is DELETE:
        del node[last]
    elif isinstance(value, Key):
        node[value.new] = node.pop(last)
    else:
        node[last] = value
    return d


LAW = "width.cost.classes.1.law"  # width 1 has samples, a level window in band 8 and a bank
BUCKET = "ng:follow/1/0"  # an n-gram bucket the run labelled

# (field, bad value, what the message must say; None: the field's dotted path)
DAMAGE = [
    # FTRL vectors of the wrong length: the next update of the law indexes past them
    (f"{LAW}.ftrl.z", [], "ftrl.z has 0 items, not 5"),
    (f"{LAW}.ftrl.n", [], "ftrl.n has 0 items, not 5"),
    (f"{LAW}.ftrl.z", [0.0] * 6, "ftrl.z has 6 items, not 5"),
    (f"{LAW}.ftrl.n", [0.0] * 4, "ftrl.n has 4 items, not 5"),
    # a gated coordinate without its accumulators: weight() reads n of every key of z
    ("acceptance.coef.n.a7", DELETE, "sections.acceptance.coef.n has not"),
    ("acceptance.buckets.m", {}, "sections.acceptance.buckets.m has not"),
    # counts
    ("width.cost.rounds", -5, None),
    ("width.cost.classes.1.count", -5, None),
    (f"{LAW}.samples", -5, None),
    ("width.chooser.held", -5, None),
    ("width.chooser.bands.8.count", -5, None),
    ("acceptance.requests", -5, None),
    ("acceptance.guard.head.count", -5, None),
    ("acceptance.coef.m.a7", 0, None),  # a coordinate exists once updated
    ("acceptance.requests", True, None),
    ("width.cost.classes.4.count", True, None),
    ("width.chooser.bands.8.count", False, None),
    ("width.chooser.held", 2.5, None),
    # widths and bands
    ("width.chooser.incumbent", 999, None),
    ("width.chooser.incumbent", 0, None),
    ("width.chooser.incumbent", "4", None),
    ("width.chooser.incumbent", 4.0, None),
    ("width.cost.classes.4", Key("999"), "sections.width.cost.classes has the key '999'"),
    ("width.cost.classes.4", Key("0"), "sections.width.cost.classes has the key '0'"),
    ("width.cost.classes.4", Key("04"), "sections.width.cost.classes has the key '04'"),
    ("width.cost.classes.1.level.8", Key("99"), "sections.width.cost.classes.1.level has the key '99'"),
    (f"{LAW}.bank.8", Key("40"), f"sections.{LAW}.bank has the key '40'"),
    ("width.chooser.bands.8", Key("-1"), "sections.width.chooser.bands has the key '-1'"),
    # weights and accumulated gradients
    (f"{LAW}.ftrl.z.0", 1e308, None),
    (f"{LAW}.ftrl.n.0", 401.0, None),  # the cap is 400
    (f"{LAW}.ftrl.n.1", -1.0, None),
    ("acceptance.coef.z.a7", 1e308, None),
    (f"acceptance.buckets.z.{BUCKET}", -1e308, None),
    ("acceptance.coef.n.a7", -1.0, None),
    ("acceptance.coef.v.ctx", -1.0, None),
    # NaN, infinity, null (what Store.put makes of a NaN) where a number belongs
    ("width.cost.classes.1.d_ref", math.nan, None),
    ("width.cost.d_recent.0", math.nan, None),
    ("acceptance.guard.fitted.x", math.inf, None),
    ("width.cost.classes.1.level.8.0", math.nan, None),
    (f"{LAW}.lowest", None, None),  # null is "no time yet", but the law has samples
    ("width.cost.classes.64.law.lowest", 5.0, None),  # and a time without any sample
    # strings where a number belongs
    ("width.cost.rounds", "203", None),
    ("width.cost.classes.1.d_ref", "0.5", None),
    (f"{LAW}.first.0", "1.0", None),
    ("acceptance.coef.z.a7", "0.1", None),
    # other ranges and sizes
    ("width.cost.d_recent", [0.5] * 9, "d_recent has 9 items"),  # the window keeps 8
    ("width.cost.d_recent.0", -1.0, None),
    ("width.cost.classes.1.level.8", [], "level.8 has 0 items"),
    ("width.cost.classes.1.level.8", [1.0] * 9, "level.8 has 9 items"),
    ("width.cost.classes.1.level.8.0", 0.0, None),
    (f"{LAW}.first", [1.0] * 4, "first has 4 items, not 3"),
    (f"{LAW}.bank.8", [[200, 1.0]] * 17, "bank.8 has 17 items"),  # a band keeps 16
    (f"{LAW}.bank.8.0", [200], "bank.8.0 has 1 items, not 2"),
    (f"{LAW}.bank.8.0.0", -1, None),
    (f"{LAW}.bank.8.0.0", 2**32, None),
    (f"{LAW}.bank.8.0.1", 0.0, None),
    ("width.chooser.bands.8.y", -1.0, None),
    # missing fields
    ("acceptance.coef.v", DELETE, "sections.acceptance.coef.v is missing"),
    ("width.cost.classes.1.law", DELETE, "sections.width.cost.classes.1.law is missing"),
    ("width", {}, "sections.width.cost is missing"),
    ("acceptance", {}, "sections.acceptance.coef is missing"),
]


@pytest.mark.parametrize("path,value,says", DAMAGE, ids=[f"{p}={v!r}"[:60] for p, v, _ in DAMAGE])
def test_a_damaged_section_is_refused_naming_the_field(trained, path, value, says):
    with pytest.raises(StoreError) as e:
        restore(damaged(trained, path, value))
    msg = str(e.value)
    assert "is damaged" in msg and "left as is" in msg and "\n" not in msg, msg
    assert (says or f"sections.{path} is ") in msg, msg


NEWER = ["width", "width.cost", "width.cost.classes.1", LAW, f"{LAW}.ftrl", "width.chooser",
         "width.chooser.bands.8", "acceptance", "acceptance.coef", "acceptance.buckets", "acceptance.guard",
         "acceptance.guard.head"]


@pytest.mark.parametrize("where", NEWER)
def test_a_field_from_a_newer_version_is_refused_not_dropped(trained, where):
    with pytest.raises(StoreError) as e:
        restore(damaged(trained, f"{where}.later", {"a": 1}))
    msg = str(e.value)
    assert f"has a field this version does not know: sections.{where}.later (written by a newer AdaSpark?)" in msg
    assert "left as is" in msg and "\n" not in msg


def test_fields_older_versions_wrote_are_still_read(trained):
    # The chooser's gains (before the lookahead) and the acceptance model's exploration count
    # (before the hindsight labels): accepted and not read.
    old = damaged(trained, "width.chooser.gains", {"8": {"sxx": [1.0], "sxy": [1.0], "n": 3}})
    old = damaged(old, "acceptance.explore_count", 7)
    assert json_copy(restore(old).state()) == trained


# --- valid sections round-trip -------------------------------------------------------------------------


def sim_learners(curve, requests=4, rounds=150):
    """Learners after a few simulated requests in several context bands (splits, bands, levels)."""
    target, drafter, clock, _ = make_sim(curve, seed=3)
    learners = Learners()
    for q in range(requests):
        prompt = drafter.text.span(0, [300, 700, 1500, 3000][q % 4])
        for _ in Generation(target, prompt, parse_arm("adaspark"), rounds, clock=clock, drafter=drafter,
                            learners=learners, request_id=f"q{q}"):
            pass
    return learners


def test_a_valid_store_restores_exactly(trained):
    assert json_copy(restore(trained).state()) == trained
    for curve in ("qwen3-4b-q4km", "cpu-smollm2-q8_0"):
        sections = json_copy(sim_learners(curve).state())
        assert json_copy(restore(sections).state()) == sections
    fresh = json_copy(Learners().state())
    assert json_copy(restore({}).state()) == fresh and json_copy(restore(fresh).state()) == fresh


# --- through the CLI ------------------------------------------------------------------------------------


def write_store(path, fp, sections):
    """A store file that passes the file checks (JSON, schema, fingerprint) whatever its sections."""
    path.write_bytes(orjson.dumps({"schema": SCHEMA, "fingerprint": fp, "updated": None,
                                   "counts": {"requests": 3, "rounds": 203}, "sections": sections},
                                  option=orjson.OPT_INDENT_2))
    return path


def empty_laws(sections):
    """The issue's store: FTRL vectors that are empty lists (a decode crashed on it and saved it back)."""
    d = copy.deepcopy(sections)
    for k in d["width"]["cost"]["classes"].values():
        k["law"]["ftrl"] = {"z": [], "n": []}
    return d


def test_decode_refuses_a_damaged_store_before_decoding_and_leaves_it(tmp_path, trained):
    fp = fingerprint(SIM)
    path = write_store(tmp_path / "store.json", fp, empty_laws(trained))
    before = path.read_bytes()
    res = adaspark("decode", PROMPTS / "story.txt", "--model", SIM, "-n", 16, "--store", path)
    assert_one_error_line(res, str(path), "is damaged", "classes.1.law.ftrl.z has 0 items", "left as is")
    assert path.read_bytes() == before


@pytest.fixture
def home(tmp_path, monkeypatch):
    # the subprocesses inherit it: the digest cache of a stand-in model lives under it
    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))


def test_store_show_reports_a_damaged_store_in_one_line(tmp_path, trained, home):
    path = write_store(tmp_path / "store.json", FP, empty_laws(trained))
    newer = write_store(tmp_path / "newer.json", FP, damaged(trained, "acceptance.coef.later", 1))
    before = path.read_bytes(), newer.read_bytes()
    assert_one_error_line(adaspark("store", "show", "--store", path), "is damaged", "ftrl.z has 0 items")
    assert_one_error_line(adaspark("inspect-store", "--store", path, "--json"), "is damaged")
    assert_one_error_line(adaspark("store", "show", "--store", newer),
                          "does not know: sections.acceptance.coef.later", "newer AdaSpark")
    assert (path.read_bytes(), newer.read_bytes()) == before


def test_store_import_refuses_a_damaged_store(tmp_path, trained, home):
    model = tmp_path / "model.gguf"  # a stand-in: the fingerprint hashes the file, nothing loads it
    model.write_bytes(np.random.default_rng(1).bytes(4096))
    fp = fingerprint(model)
    src = write_store(tmp_path / "src.json", fp, empty_laws(trained))
    dest = tmp_path / "installed.json"
    res = adaspark("store", "import", src, "--store", dest, "--model", model)
    assert_one_error_line(res, "is damaged", "nothing was imported")
    assert not dest.exists()
