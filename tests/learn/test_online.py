"""online.FTRL: one FTRL-Proximal for the cost model's laws (dense coordinates, lower bounds, L1)
and the acceptance model (named coordinates, the gate), against the algorithm as published."""

from __future__ import annotations

import json
import math
import random

import pytest

from adaspark_core.learn.online import FTRL


def sigmoid(s: float) -> float:
    return 1.0 / (1.0 + math.exp(-s))


def reference(rows, alpha, beta, l1, l2, center):
    """FTRL-Proximal for logistic regression as McMahan et al. (2013), Algorithm 1, states it, on
    the deviation u = w - center: the weights w each row is predicted with."""
    dim = len(center)
    z, n = [0.0] * dim, [0.0] * dim
    used = []
    for x, y in rows:
        u = [0.0 if abs(z[i]) <= l1 else -(z[i] - math.copysign(l1, z[i])) / ((beta + math.sqrt(n[i])) / alpha + l2)
             for i in range(dim)]
        w = [ui + ci for ui, ci in zip(u, center)]
        p = sigmoid(sum(wi * xi for wi, xi in zip(w, x)))
        for i in range(dim):
            if x[i] != 0.0:  # the paper's "for all i in I": the row's nonzero features
                g = (p - y) * x[i]
                sigma = (math.sqrt(n[i] + g * g) - math.sqrt(n[i])) / alpha
                z[i] += g - sigma * u[i]
                n[i] += g * g
        used.append(w)
    return used


def logistic_rows(seed: int, count: int = 400):
    """Sparse rows of a logistic model with two irrelevant features (their weights should stay 0
    under a large enough L1)."""
    rng = random.Random(seed)
    true = [1.5, -2.0, 0.0, 0.7, 0.0, -0.4]
    rows = []
    for _ in range(count):
        x = [rng.uniform(-1.0, 1.0) if rng.random() < 0.6 else 0.0 for _ in true]
        x[0] = 1.0
        rows.append((x, 1.0 if rng.random() < sigmoid(sum(a * b for a, b in zip(true, x))) else 0.0))
    return rows


PLAIN = dict(alpha=0.3, beta=1.0, l1=1.0, l2=0.5)


@pytest.mark.parametrize("center", [[0.0] * 6, [0.5, 0.0, -1.0, 0.0, 2.0, 0.0]])
def test_dense_plain_ftrl_is_ftrl_proximal(center):
    rows = logistic_rows(1)
    expected = reference(rows, center=center, **PLAIN)
    f = FTRL(6, n_cap=math.inf, center=center, **PLAIN)
    held = 0  # steps with a coordinate that has gradients but is held at its prior by the L1
    for (x, y), want in zip(rows, expected):
        w = f.weights()
        assert w == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert [wi == ci for wi, ci in zip(w, center)] == [a == c for a, c in zip(want, center)]  # L1 zeros exactly
        held += any(wi == ci and f.z[i] != 0.0 for i, (wi, ci) in enumerate(zip(w, center)))
        f.update_linear(x, sigmoid(f.predict(x)) - y)
    # the test sees both sides of the L1 threshold
    assert held >= 10 and all(w != c for w, c in zip(f.weights(), center))


def test_named_plain_ftrl_is_ftrl_proximal():
    rows = logistic_rows(2)
    expected = reference(rows, center=[0.0] * 6, **PLAIN)
    f = FTRL(n_cap=math.inf, **PLAIN)
    keys = [f"f{i}" for i in range(6)]
    for (x, y), want in zip(rows, expected):
        w = [f.weight(k) for k in keys]
        assert w == pytest.approx(want, rel=1e-12, abs=1e-15)
        p = sigmoid(sum(wi * xi for wi, xi in zip(w, x)))
        f.update({k: (p - y) * xi for k, xi in zip(keys, x) if xi != 0.0})
    assert f.v is None and set(f.m) == set(keys)  # plain: no noise scale kept


def test_a_coordinate_with_zero_input_is_not_stepped():
    f = FTRL(3)
    f.update_linear([1.0, 0.0, 2.0], 0.5)
    assert f.n == {0: 0.25, 1: 0.0, 2: 1.0} and f.z[1] == 0.0
    with pytest.raises(LookupError):
        f.update({3: 1.0})  # dense coordinates are 0..dim-1 only


def test_the_gate_holds_a_noise_coordinate_at_its_prior_and_releases_a_consistent_one():
    prior = {"noise": 0.5, "signal": 0.5}
    gated = FTRL(alpha=0.05, l2=0.01, gate=3.0, center=prior)
    plain = FTRL(alpha=0.05, l2=0.01, center=prior)
    rng = random.Random(3)
    steps, held, last, jumps = 2000, 0, 0.5, []
    for _ in range(steps):
        grads = {"noise": rng.choice((-0.4, 0.4)), "signal": -0.3 + rng.uniform(-0.2, 0.2)}
        gated.update(grads)
        plain.update(grads)
        held += gated.weight("noise") == 0.5
        jumps.append(abs(gated.weight("signal") - last))
        last = gated.weight("signal")
    assert held >= 0.95 * steps and gated.weight("noise") == 0.5
    assert plain.weight("noise") != 0.5  # without the gate the noise moves it
    assert gated.weight("signal") > 1.0  # a consistent negative gradient raises the weight
    assert max(jumps) < 0.05  # it left the prior continuously: a soft threshold, no jump
    assert gated.m == {"noise": steps, "signal": steps}
    assert gated.v["noise"] == pytest.approx(steps * 0.16)


@pytest.mark.parametrize("dim", [None, 1])
def test_the_threshold_is_l1_plus_gate_sqrt_v(dim):
    key = "a" if dim is None else 0
    f = FTRL(dim, alpha=0.1, beta=1.0, l1=0.5, l2=0.2, gate=2.0, center={key: 0.3} if dim is None else [0.3])

    def at(z):
        one = (lambda x: {key: x}) if dim is None else (lambda x: [x])
        state = {"z": one(z), "n": one(1.0), "v": one(1.0)}
        if dim is None:
            state["m"] = {key: 1}
        return f.load(state).weight(key)

    assert at(2.4) == 0.3 and at(-2.4) == 0.3  # inside 0.5 + 2 sqrt(1)
    assert at(3.0) == pytest.approx(0.3 - 0.5 / (2.0 / 0.1 + 0.2))
    assert at(-3.0) == pytest.approx(0.3 + 0.5 / (2.0 / 0.1 + 0.2))


def test_lower_bounds_project_the_weight_as_read_and_as_stepped():
    f = FTRL(2, alpha=0.5, lower=[None, 0.0])
    for _ in range(20):
        f.update_linear([1.0, 1.0], 1.0)  # a positive gradient pushes both weights down
    w0, w1 = f.weights()
    assert w0 < 0.0 and w1 == 0.0 and f.predict([1.0, 1.0]) == w0
    # z is not clipped, but the step uses the projected weight: coordinate 1, read as 0 all along,
    # accumulated its gradients alone; coordinate 0 also its sigma * w terms
    assert f.z[1] == 20.0 and f.z[0] > 20.0
    named = FTRL(alpha=0.5, lower={"a": 0.0})
    named.update({"a": 1.0, "b": 1.0})
    assert named.weight("a") == 0.0 and named.weight("b") < 0.0


def test_n_cap_caps_the_rate_but_not_the_gate_noise():
    f = FTRL(alpha=0.1, n_cap=1.0, gate=1.0)
    for _ in range(10):
        f.update({"a": 0.5})
    assert f.n["a"] == 1.0 and f.v["a"] == pytest.approx(2.5) and f.m["a"] == 10
    z = f.z["a"]
    f.update({"a": 0.5})
    assert f.z["a"] == z + 0.5  # capped: sigma is 0, z steps by the gradient alone
    t = math.sqrt(f.v["a"])
    assert f.weight("a") == pytest.approx(-(f.z["a"] - t) / ((1.0 + 1.0) / 0.1))  # the capped n in the rate
    d = FTRL(1, n_cap=2.0)
    d.update_linear([2.0], 1.0)
    assert d.n[0] == 2.0


# --- bit for bit what the two classes were --------------------------------------------------------


def dense_run(f: FTRL) -> FTRL:
    """The cost model's step (cost.Law._step: quantile loss at tau 0.1) on a linear target."""
    rng = random.Random(7)
    for _ in range(300):
        x = [1.0] + [rng.uniform(0.0, 2.0) for _ in range(4)]
        y = 0.8 + 0.3 * x[1] + 0.1 * x[2] + rng.uniform(0.0, 0.5)
        f.update_linear(x, (1.0 if y < f.predict(x) else 0.0) - 0.1)
    return f


def named_run(f: FTRL) -> FTRL:
    rng = random.Random(11)
    for _ in range(300):
        f.update({k: rng.uniform(-0.6, 0.3) for k in rng.sample(["a0", "a1", "a4", "ctx", "ng:1", "ng:2"], 3)})
    return f


def dense_law() -> FTRL:
    return FTRL(5, alpha=0.05, beta=1.0, l1=0.1, l2=0.01, n_cap=40.0, lower=[None, 0.0, 0.0, 0.0, 0.0],
                center=[1.0, 0.0, 0.0, 0.0, 0.0])


def named_gated() -> FTRL:
    return FTRL(alpha=0.05, beta=1.0, l2=0.01, n_cap=4.0, gate=3.0, center={"a0": 0.69, "a1": 1.0})


def test_both_shapes_sum_as_the_two_classes_did():
    """The values were computed by FTRL and GatedFTRL before they became one class (312af81). The
    dense shape sums z + (g - sigma d), the named one (z + g) - sigma d: a change of either order
    changes these, and stores and logged rounds would no longer replay exactly."""
    d = dense_run(dense_law())
    assert [w.hex() for w in d.weights()] == ["0x1.ed81b2ec70842p-1", "0x1.06a24d81e5a7ep-2", "0x1.04c2fc2b37ff7p-4",
                                              "0x0.0p+0", "0x0.0p+0"]
    assert [z.hex() for z in d.state()["z"]] == ["0x1.32bae3a8f0502p+2", "-0x1.8bf00589e8ff1p+4", "-0x1.05f9c474fc963p+3",
                                                 "0x1.33a386671f7b6p+2", "0x1.78acea80a4d74p+2"]
    g = named_run(named_gated())
    assert {k: (g.weight(k).hex(), g.z[k].hex()) for k in sorted(g.z)} == {
        "a0": ("0x1.c72301c2ac541p-1", "-0x1.6ae0eaa8421b4p+4"), "a1": ("0x1.409003652f272p+0", "-0x1.b44b4ceaa520ep+4"),
        "a4": ("0x1.d45a12f689b8dp-3", "-0x1.91f93158f1243p+4"), "ctx": ("0x1.a8f3099a4d7ecp-3", "-0x1.7d5cce0172db3p+4"),
        "ng:1": ("0x1.1743c519880e3p-2", "-0x1.c1d2f70042826p+4"), "ng:2": ("0x1.a7d33e30edb11p-3", "-0x1.6ea45ef34efb1p+4")}
    assert g.m == {"ctx": 148, "ng:1": 155, "ng:2": 148, "a1": 160, "a0": 143, "a4": 146}


@pytest.mark.parametrize("gate", [None, 1.0])
def test_quantile_steps_are_predict_and_update_linear_bit_for_bit(gate):
    """A law's refit steps through ``quantile_steps`` (one loop over lists, for host time): its z,
    n, v and weights must be exactly those of a predict and an update_linear per sample, or a
    store and a replayed log would no longer agree. Lower bounds that bind, a cap that binds,
    inputs of 0 (not stepped) and a gate are all on the path."""
    rng = random.Random(7)
    samples = []
    for _ in range(300):
        u = rng.choice([0.0, rng.uniform(0.0, 0.6)])
        x = [1.0, u, u * u, math.sqrt(u), math.log1p(u)]
        samples.append((x, rng.uniform(0.6, 1.8) - 0.8 * u))  # falling: the bounds bind

    def law() -> FTRL:
        return FTRL(5, alpha=0.05, beta=1.0, l1=0.002, l2=0.01, n_cap=20.0, lower=[None, 0.0, 0.0, 0.0, 0.0],
                    center=[1.0, 0.0, 0.0, 0.0, 0.0], gate=gate)

    tau = 0.15
    one, fused = law(), law()
    for x, y in samples[:40]:  # both start from the same stepped state
        for f in (one, fused):
            f.update_linear(x, (1.0 if y < f.predict(x) else 0.0) - tau)
    for x, y in samples[40:]:
        one.update_linear(x, (1.0 if y < one.predict(x) else 0.0) - tau)
    fused.quantile_steps(samples[40:], tau)
    assert fused.state() == one.state()
    assert [w.hex() for w in fused.weights()] == [w.hex() for w in one.weights()]
    assert any(w == 0.0 for w in one.weights()[1:])  # a lower bound binds
    assert max(one.state()["n"]) == 20.0  # the cap binds (late: before it, sigma > 0)
    x, y = samples[-1]
    assert fused.predict(x) == one.predict(x)


# --- state ------------------------------------------------------------------------------------------


def test_state_layouts():
    assert FTRL(2).state() == {"z": [0.0, 0.0], "n": [0.0, 0.0]}
    assert FTRL(1, gate=1.0).state() == {"z": [0.0], "n": [0.0], "v": [0.0]}
    g = FTRL(gate=3.0, center={"a": 1.0})
    g.update({"a": 0.5})
    assert json.dumps(g.state()) == '{"z": {"a": 0.5}, "n": {"a": 0.25}, "v": {"a": 0.25}, "m": {"a": 1}}'
    p = FTRL()
    p.update({"a": 0.5})
    assert list(p.state()) == ["z", "n", "m"]


def dense_gated() -> FTRL:
    return FTRL(3, gate=2.0)


def dense_gated_run(f: FTRL) -> FTRL:
    for _ in range(5):
        f.update_linear([1.0, 0.5, 2.0], 0.3)
    return f


@pytest.mark.parametrize("make, run", [(dense_law, dense_run), (named_gated, named_run), (dense_gated, dense_gated_run)])
def test_state_round_trip(make, run):
    a = run(make())
    text = json.dumps(a.state())
    b = make().load(json.loads(text), "x")
    assert json.dumps(b.state()) == text
    run(a), run(b)  # and they go on learning identically
    assert json.dumps(b.state()) == json.dumps(a.state())
    keys = range(a.dim) if a.dim is not None else a.z
    assert [a.weight(k) for k in keys] == [b.weight(k) for k in keys]


DENSE_BAD = [
    ({"z": [0.0] * 4, "n": [0.0] * 5}, "x.z has 4 items, not 5"),
    ({"z": [0.0] * 5, "n": [0.0] * 6}, "x.n has 6 items, not 5"),
    ({"z": {}, "n": [0.0] * 5}, "x.z is {}, not a list"),
    ({"z": [0.0, None, 0.0, 0.0, 0.0], "n": [0.0] * 5}, "x.z.1 is null"),
    ({"z": [0.0] * 5, "n": [0.0, 0.0, 41.0, 0.0, 0.0]}, "x.n.2 is 41.0, not a number in [0, 40]"),
    ({"z": [0.0] * 5, "n": [-1.0, 0.0, 0.0, 0.0, 0.0]}, "x.n.0 is -1.0"),
    ({"z": [0.0] * 5}, "x.n is missing"),
    ({"z": [0.0] * 5, "n": [0.0] * 5, "v": [0.0] * 5}, "x.v"),  # no gate, no v
    ([], "x is [], not an object"),
]
NAMED_BAD = [
    ({"z": {"a": 1.0}, "n": {}, "v": {"a": 1.0}, "m": {"a": 1}}, "x.z has the coordinate 'a', x.n has not"),
    ({"z": {"a": 1.0}, "n": {"a": 1.0}, "v": {"a": 1.0}, "m": {"a": 1, "b": 1}}, "x.m has the coordinate 'b', x.z has not"),
    ({"z": {"a": 1.0}, "n": {"a": 1.0}, "v": {"a": 1.0}, "m": {"a": 0}}, "x.m.a is 0, not an integer >= 1"),
    ({"z": {"a": 1.0}, "n": {"a": 1.0}, "v": {"a": -1.0}, "m": {"a": 1}}, "x.v.a is -1.0"),
    ({"z": {"a": 1.0}, "n": {"a": 5.0}, "v": {"a": 1.0}, "m": {"a": 1}}, "x.n.a is 5.0"),
    ({"z": {"a": "1"}, "n": {"a": 1.0}, "v": {"a": 1.0}, "m": {"a": 1}}, "x.z.a is '1'"),
    ({"z": {"a": 1.0}, "n": {"a": 1.0}, "m": {"a": 1}}, "x.v is missing"),
    ({"z": [], "n": {}, "v": {}, "m": {}}, "x.z is [], not an object"),
]


@pytest.mark.parametrize("make, run, bad, words", [(dense_law, dense_run, *case) for case in DENSE_BAD]
                         + [(named_gated, named_run, *case) for case in NAMED_BAD])
def test_load_rejects_a_bad_state_and_keeps_its_own(make, run, bad, words):
    f = run(make())
    before = json.dumps(f.state())
    with pytest.raises(ValueError) as err:
        f.load(bad, "x")
    assert words in str(err.value)
    assert json.dumps(f.state()) == before
