"""The persisted learned state: round trip, refusal of bad stores, atomic saves, fingerprints."""

import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest
from conftest import ROOT

from adaspark_core.base.errors import InputError, OutputError, StoreError
from adaspark_core.store import fingerprint as fingerprint_mod
from adaspark_core.store import store as store_mod
from adaspark_core.store.fingerprint import fingerprint, fingerprint_key
from adaspark_core.store.store import SCHEMA, Store, default_store_path

FP = {
    "model": {"size": 123, "sha256": "ab" * 32},
    "machine": {"cpu": "Test CPU", "cpus": 2, "arch": "x86_64", "llama_cpp_python": "0.3.36"},
}
OTHER_FP = {**FP, "machine": {**FP["machine"], "cpus": 4}}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))


def saved_store(path, fp=FP, gen=1):
    st = Store.open(path, fp)
    st.put("cost", {"gen": gen, "table": [1.0, 2.5]})
    st.bump(requests=1, rounds=gen)
    st.save()
    st.close()
    return st


def test_round_trip_sections_and_counts(tmp_path):
    path = default_store_path(FP)
    assert path == tmp_path / "home" / "stores" / f"{fingerprint_key(FP)}.json"
    st = Store.open(path, FP)
    state = {"a": np.arange(3), "b": np.float32(1.5), "nested": {"x": [1, 2], "y": None}, "s": "w"}
    st.put("cost", state)
    st.put("chooser", {"width": 4})
    st.bump(requests=1, rounds=5)
    st.bump(rounds=2)
    expected = {"a": [0, 1, 2], "b": 1.5, "nested": {"x": [1, 2], "y": None}, "s": "w"}
    assert st.get("cost") == expected  # normalised at put: same as after a reopen
    st.save()

    st.close()
    again = Store.open(path, FP)
    again.close()
    assert again.get("cost") == expected
    assert again.get("chooser") == {"width": 4}
    assert again.get("acceptance") is None
    assert again.counts == {"requests": 1, "rounds": 7}
    assert again.updated is not None
    d = orjson.loads(path.read_bytes())
    assert d["schema"] == SCHEMA and d["fingerprint"] == FP
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(path.parent) == [path.name]  # no temp file left behind


def test_missing_file_starts_empty(tmp_path):
    path = tmp_path / "none" / "s.json"
    st = Store.open(path, FP)
    assert st.get("cost") is None and st.counts == {"requests": 0, "rounds": 0}
    assert not path.exists()  # opening does not create anything


def test_put_rejects_unsaveable_state(tmp_path):
    st = Store.open(tmp_path / "s.json", FP)
    with pytest.raises(TypeError):
        st.put("cost", {1: 2.0})  # non-str keys would silently turn into strings
    with pytest.raises(TypeError):
        st.put("cost", [1, 2])
    with pytest.raises(ValueError):
        st.bump(rounds=-1)


def good_doc(**over):
    d = {"schema": SCHEMA, "fingerprint": FP, "updated": None,
         "counts": {"requests": 0, "rounds": 0}, "sections": {}}
    d.update(over)
    return orjson.dumps({k: v for k, v in d.items() if v is not ...})


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"schema": 1, "fingerp', "is corrupt (line 1:"),
        (b"", "is corrupt"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"schema": 1}\n}', "is corrupt (line 2:"),
        (good_doc(schema=...), "unknown schema None"),
        (good_doc(schema=99), "unknown schema 99"),
        (good_doc(schema="1"), "unknown schema '1'"),
        (good_doc(schema=True), "unknown schema True"),
        (good_doc(counts={"requests": -1, "rounds": 0}), "bad counts"),
        (good_doc(sections={"cost": [1]}), "bad sections"),
        (good_doc(fingerprint=OTHER_FP), "another model or machine (differs in machine.cpus)"),
        (good_doc(later={"x": 1}), "a field this version does not know: later"),
    ],
)
def test_bad_store_raises_and_is_left_as_is(tmp_path, content, words):
    path = tmp_path / "s.json"
    path.write_bytes(content)
    before = path.stat()
    with pytest.raises(StoreError) as e:
        Store.open(path, FP)
    msg = str(e.value)
    assert isinstance(e.value, InputError)
    assert words in msg and str(path) in msg and "adaspark store reset" in msg and "\n" not in msg
    assert path.read_bytes() == content
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    assert os.listdir(tmp_path) == ["s.json"]


def test_upgrades_are_applied(tmp_path, monkeypatch):
    # A current file read by a (simulated) next-schema build goes through the next upgrade.
    path = tmp_path / "s.json"
    saved_store(path)
    monkeypatch.setattr(store_mod, "SCHEMA", SCHEMA + 1)
    monkeypatch.setattr(store_mod, "UPGRADES", [*store_mod.UPGRADES, lambda d: {**d, "sections": {**d["sections"], "new": {}}}])
    assert Store.open(path, FP).get("new") == {}


def test_a_schema_1_store_keeps_its_widths_and_drops_its_context_free_levels(tmp_path):
    from adaspark_core.learn.learned import Learners

    path = tmp_path / "s.json"
    live = Learners()
    live.policy.cost.classes[4].count = 3
    width = orjson.loads(orjson.dumps(live.policy.state()))
    for part in (width, width["cost"], width["chooser"]):
        del part["version"]  # schema 1 was written before the learners versioned their sections
    for k in width["cost"]["classes"].values():
        k["level"] = [1.1, 0.9]  # schema 1: one window, no contexts
    doc = {"schema": 1, "fingerprint": FP, "updated": None, "counts": {"requests": 1, "rounds": 5},
           "sections": {"width": width}}
    path.write_bytes(orjson.dumps(doc))
    restored = Learners.from_store(Store.open(path, FP))
    assert restored.policy.cost.classes[4].count == 3 and restored.policy.cost.classes[4].level == {}


def test_an_unreadable_learner_section_is_reported(tmp_path):
    from adaspark_core.learn.learned import Learners

    path = tmp_path / "s.json"
    st = Store(path, FP)
    st.put("acceptance", {"coef": "nonsense"})
    st.save()
    with pytest.raises(StoreError, match="cannot read"):
        Learners.from_store(Store.open(path, FP))


def test_save_is_atomic_when_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    saved_store(path, gen=1)
    old = path.read_bytes()

    def crash(*a, **k):
        raise OSError("simulated crash")

    st = Store.open(path, FP)
    st.put("cost", {"gen": 2})
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OutputError, match="simulated crash"):
        st.save()
    st.close()
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["s.json"]


CHILD = r"""
import sys
import numpy as np, orjson
from adaspark_core.store.store import Store
path, fp, n = sys.argv[1], orjson.loads(sys.argv[2]), int(sys.argv[3])
st = Store.open(path, fp)
gen = st.get("big")["gen"]
while True:
    gen += 1
    st.put("big", {"gen": gen, "data": np.full(n, gen + 0.25)})
    st.bump(rounds=1)
    st.save()
    print(gen, flush=True)  # reported only once the save is complete
"""


def check_consistent(path, n):
    """Open the store (must succeed) and check it is one whole generation; return the generation."""
    with Store.open(path, FP) as st:  # closed: the next child learns into it
        big = st.get("big")
    gen = big["gen"]
    assert len(big["data"]) == n and set(big["data"]) == {gen + 0.25}
    assert st.counts["rounds"] == gen
    return gen


def test_killed_writer_never_leaves_an_unreadable_store(tmp_path):
    n = 100_000  # about 1.3 MB of JSON, so kills often land inside a write
    path = tmp_path / "s.json"
    with Store.open(path, FP) as st:
        st.put("big", {"gen": 0, "data": [0.25] * n})
        st.save()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(1234)
    gen = 0
    for _ in range(20):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), orjson.dumps(FP).decode(), str(n)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
        )
        try:
            first = child.stdout.readline()  # the child has imported and saved once
            assert first, child.stderr.read().decode()
            time.sleep(rng.uniform(0, 0.3))
        finally:
            child.send_signal(signal.SIGKILL)
            out, _ = child.communicate()
        assert child.returncode == -signal.SIGKILL
        lines = (first + out).decode().split("\n")[:-1]  # complete lines only
        reported = int(lines[-1])
        # Either the last save the child reported, or the one it finished but did not report yet.
        now = check_consistent(path, n)
        assert now in (reported, reported + 1) and now > gen
        gen = now


def test_reset_deletes_only_the_store(tmp_path):
    path = tmp_path / "s.json"
    saved_store(path)
    (tmp_path / "other.json").write_text("{}")
    assert Store.reset(path) is True
    assert not path.exists() and (tmp_path / "other.json").exists()
    assert Store.reset(path) is False


def test_export_and_import(tmp_path):
    path = tmp_path / "s.json"
    saved_store(path, gen=3)
    dest = tmp_path / "out" / "copy.json"
    Store.export(path, dest)
    assert dest.read_bytes() == path.read_bytes()

    target = tmp_path / "in.json"
    st = Store.import_(dest, target, FP)
    assert st.get("cost") == {"gen": 3, "table": [1.0, 2.5]}
    assert Store.open(target, FP).counts == {"requests": 1, "rounds": 3}

    exported = dest.read_bytes()
    with pytest.raises(StoreError, match="another model or machine") as e:
        Store.import_(dest, tmp_path / "in2.json", OTHER_FP)
    assert str(dest) in str(e.value) and not (tmp_path / "in2.json").exists()
    st = Store.import_(dest, tmp_path / "in2.json", OTHER_FP, force=True)
    assert Store.open(tmp_path / "in2.json", OTHER_FP).get("cost")["gen"] == 3
    assert dest.read_bytes() == exported  # the source is never modified

    (tmp_path / "bad.json").write_bytes(b"{oops")
    with pytest.raises(StoreError, match="corrupt"):
        Store.import_(tmp_path / "bad.json", tmp_path / "in3.json", FP)
    with pytest.raises(StoreError, match="corrupt"):
        Store.export(tmp_path / "bad.json", tmp_path / "out3.json")
    with pytest.raises(StoreError, match="no store"):
        Store.export(tmp_path / "missing.json", tmp_path / "out4.json")
    assert not (tmp_path / "in3.json").exists() and not (tmp_path / "out3.json").exists()


def test_fingerprint_is_stable_and_follows_the_file(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    data = os.urandom(3 << 20) + b"tail"  # several 1 MiB chunks plus a partial one
    model.write_bytes(data)

    hashed = []
    real = fingerprint_mod._sha256_file
    monkeypatch.setattr(fingerprint_mod, "_sha256_file", lambda p: hashed.append(p) or real(p))

    fp1 = fingerprint(model)
    assert fp1["model"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert fp1["machine"]["cpus"] >= 1 and fp1["machine"]["cpu"] and fp1["machine"]["arch"]
    assert (tmp_path / "home" / "stores" / "digests.json").exists()
    fp2 = fingerprint(model)
    assert fp2 == fp1 and fingerprint_key(fp2) == fingerprint_key(fp1)
    assert len(hashed) == 1  # the second call used the digest cache
    key = fingerprint_key(fp1)
    assert len(key) == 16 and int(key, 16) >= 0

    # Same size, different content, new mtime: rehashed, new key.
    st = model.stat()
    model.write_bytes(b"X" + data[1:])
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    fp3 = fingerprint(model)
    assert len(hashed) == 2
    assert fp3["model"]["sha256"] != fp1["model"]["sha256"]
    assert fingerprint_key(fp3) != key

    # Different size.
    model.write_bytes(data + b"more")
    fp4 = fingerprint(model)
    assert fp4["model"]["size"] == len(data) + 4 and fingerprint_key(fp4) not in (key, fingerprint_key(fp3))

    # A corrupt digest cache is ignored, not an error.
    (tmp_path / "home" / "stores" / "digests.json").write_bytes(b"garbage")
    assert fingerprint(model) == fp4


def test_fingerprint_key_is_canonical():
    shuffled = {"machine": dict(reversed(list(FP["machine"].items()))), "model": FP["model"]}
    assert fingerprint_key(shuffled) == fingerprint_key(FP)
    assert fingerprint_key(OTHER_FP) != fingerprint_key(FP)


def test_the_store_imports_neither_llama_cpp_nor_models():
    """Importing the store (and the fingerprint, which knows a simulated model's name) loads no
    llama.cpp, no llama engine and no model cache: ``store show`` stays quick."""
    heavy = ("llama_cpp", "adaspark_core.engine.bindings", "adaspark_core.engine.llama", "adaspark_core.engine.models")
    code = ("import sys, adaspark_core.store.store, adaspark_core.store.fingerprint; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert out.strip() == "[]"


def test_a_section_this_version_does_not_know_is_kept_through_a_save(tmp_path):
    from adaspark_core.learn.learned import Learners

    path = tmp_path / "s.json"
    path.write_bytes(good_doc(sections={"memory": {"ngrams": [1, 2, 3]}}))
    with Store.open(path, FP) as st:
        Learners.from_store(st).to_store(st)
        st.save()
    sections = orjson.loads(path.read_bytes())["sections"]
    assert sections["memory"] == {"ngrams": [1, 2, 3]} and {"width", "acceptance"} <= set(sections)
