"""``adaspark profile``: the survey's plan, medians and fit on a fake target, the PNG writer, the
command's bad-input errors, and one tiny real run (marked model)."""

import io
import struct
import subprocess
import sys

import numpy as np
import orjson
import pytest
from helpers import adaspark, assert_one_error_line

from adaspark_cli.plot import line_plot
from adaspark_core.base.errors import InputError
from adaspark_core.engine.base import Verified
from adaspark_core.evaluate import survey as prof

# --- the fit --------------------------------------------------------------------------------------

def test_fit_recovers_an_exact_line():
    f = prof.fit_affine([443, 1596, 8444], [24.7 + 0.00128 * c for c in (443, 1596, 8444)])
    assert f.alpha == pytest.approx(24.7) and f.beta == pytest.approx(0.00128)
    assert max(abs(r) for r in f.residuals) < 1e-9
    assert f.value(1000) == pytest.approx(24.7 + 1.28)


def test_fit_is_least_squares_with_residuals():
    cs, ts = [100, 400, 900, 2000], [10.0, 11.5, 11.0, 14.0]
    f = prof.fit_affine(cs, ts)
    beta, alpha = np.polyfit(cs, ts, 1)
    assert f.alpha == pytest.approx(alpha) and f.beta == pytest.approx(beta)
    assert f.residuals == pytest.approx([t - (alpha + beta * c) for c, t in zip(cs, ts)])
    assert sum(f.residuals) == pytest.approx(0.0, abs=1e-9)  # least squares with an intercept
    assert f.max_abs_residual() == pytest.approx(max(abs(r) for r in f.residuals))


def test_fit_of_one_context_has_no_slope():
    f = prof.fit_affine([443], [20.0])
    assert f.alpha is None and f.beta is None and f.residuals == [None]
    assert f.max_abs_residual() is None


# --- medians and the warm-up rule -----------------------------------------------------------------

def test_warm_median_drops_the_first_two_rounds():
    assert prof.warm_median([900.0, 500.0, 3.0, 1.0, 2.0]) == 2.0
    assert prof.warm_median([900.0, 500.0, 3.0, 1.0]) == 2.0
    assert prof.kept([5.0, 6.0, 7.0]) == [7.0]
    # no more samples than warm-ups: keep them all rather than take the median of nothing
    assert prof.warm_median([4.0, 6.0]) == 5.0
    with pytest.raises(ValueError):
        prof.warm_median([])


# --- pass order -----------------------------------------------------------------------------------

def test_pass_order_is_ascending_then_reversed():
    p1, p2 = prof.pass_order([8, 1, 2], [512, 64])
    assert p1 == [(64, 1), (64, 2), (64, 8), (512, 1), (512, 2), (512, 8)]
    assert p2 == p1[::-1]
    assert [w for c, w in p2 if c == 64] == [8, 2, 1]  # widths descending in pass 2
    three = prof.pass_order([1, 2], [10], passes=3)
    assert three[0] == three[2] == three[1][::-1]


class FakeTarget:
    """Records what the survey does; a verify of w rows at context c takes alpha[w] + beta[w]*c ms,
    except the first two verifies of each cell, which are slow (warm-ups)."""

    def __init__(self, alpha, beta, n_ctx=4096):
        self.alpha, self.beta, self.n_ctx = alpha, beta, n_ctx
        self.n_vocab = 1000
        self.calls = []  # ("start", c) | ("verify", c, w) | ("discard", c, w)
        self.anchor = None
        self.context = 0
        self.pending = None
        self.seen: dict = {}

    def tokenize(self, text, special=True):
        return [ord(ch) % 1000 for ch in text]

    def start(self, tokens):
        self.context = len(tokens)
        self.anchor = tokens[-1]
        self.calls.append(("start", len(tokens)))

    def verify(self, lay):
        assert self.pending is None, "verify before the last one was discarded"
        assert lay.token[0] == self.anchor and lay.is_chain
        w = lay.width
        self.calls.append(("verify", self.context, w))
        key = (self.context, w, sum(1 for c in self.calls if c[0] == "start"))
        n = self.seen[key] = self.seen.get(key, 0) + 1
        ms = self.alpha[w] + self.beta[w] * self.context + (1000.0 if n <= 2 else 0.0)
        self.pending = w
        return Verified([0] * w, ms + 0.5, ms, 0.5)

    def discard(self, lay):
        self.calls.append(("discard", self.context, lay.width))
        self.pending = None


def test_survey_order_warmups_medians_and_fit():
    alpha, beta = {1: 5.0, 2: 8.0, 4: 11.0}, {1: 0.001, 2: 0.002, 4: 0.004}
    t = FakeTarget(alpha, beta)
    steps = []
    s = prof.survey(t, [4, 1, 2], [256, 64], rounds=4, on_cell=lambda p, w, c: steps.append((p, c, w)))
    assert s.widths == [1, 2, 4] and s.contexts == [64, 256]
    # order: pass 1 ascending, pass 2 reversed; the cache filled once per context and pass
    assert steps == [(0, 64, 1), (0, 64, 2), (0, 64, 4), (0, 256, 1), (0, 256, 2), (0, 256, 4),
                     (1, 256, 4), (1, 256, 2), (1, 256, 1), (1, 64, 4), (1, 64, 2), (1, 64, 1)]
    assert [c for c in t.calls if c[0] == "start"] == [("start", 64), ("start", 256), ("start", 256), ("start", 64)]
    # every verify is discarded at once, so the context never moves
    verifies = [c for c in t.calls if c[0] == "verify"]
    discards = [c for c in t.calls if c[0] == "discard"]
    assert len(verifies) == len(discards) == 2 * 3 * 2 * 4
    assert all(t.calls[i + 1][0] == "discard" for i, c in enumerate(t.calls) if c[0] == "verify")
    # samples: per pass, all rounds, warm-ups first; medians leave the warm-ups out
    cell = s.cells[(2, 256)]
    assert len(cell.verify) == 2 and all(len(x) == 4 for x in cell.verify)
    assert cell.verify[0][0] > 1000 and cell.verify[0][2] < 1000
    assert cell.median() == pytest.approx(8.0 + 0.002 * 256 + 0.5)
    assert cell.median(which="decode") == pytest.approx(8.0 + 0.002 * 256)
    for w in s.widths:
        f = s.fit(w, "decode")
        assert f.alpha == pytest.approx(alpha[w]) and f.beta == pytest.approx(beta[w])
    js = s.to_json()
    assert js["widths"] == [1, 2, 4] and js["contexts"] == [64, 256] and js["warmup"] == 2
    assert len(js["cells"]) == 6 and len(js["fits"]) == 3
    orjson.dumps(js)  # serialisable


def test_survey_needs_more_rounds_than_warmups():
    with pytest.raises(InputError):
        prof.survey(FakeTarget({1: 1.0}, {1: 0.0}), [1], [16], rounds=2)


def test_chain_layout():
    lay = prof.chain_layout(7, 5)
    assert lay.width == 5 and lay.is_chain and lay.token[0] == 7 and lay.max_depth == 4
    assert prof.chain_layout(7, 1).width == 1


# --- the plan: widths, contexts, clamping ---------------------------------------------------------

def test_default_contexts_are_clamped_to_the_model_and_say_so():
    ws, cs, n_ctx, notes = prof.plan(None, None, 8192)
    assert ws == [1, 2, 4, 8, 16, 32, 64]
    assert cs[:2] == [443, 1596] and cs[2] == prof.context_limit(8192, 64) < 8444
    assert len(notes) == 1 and "8444" in notes[0]
    assert cs[-1] + 64 - 2 < n_ctx <= 8192  # the widest verify at the largest context fits
    ws, cs, n_ctx, notes = prof.plan([1, 2], None, 32768)
    assert cs == [443, 1596, 8444] and not notes and n_ctx >= 8444 + 2


def test_bad_widths_and_contexts():
    for ws in ([0], [65], [1, 128]):
        with pytest.raises(InputError, match="widths"):
            prof.plan(ws, [64], 8192)
    with pytest.raises(InputError, match="does not fit"):
        prof.plan([1, 64], [8192], 8192)
    with pytest.raises(InputError, match="at least 1"):
        prof.plan([1], [0], 8192)
    assert prof.parse_ints("4, 1,2,2", "widths") == [1, 2, 4]
    with pytest.raises(InputError, match="--widths"):
        prof.parse_ints("1,x", "widths")
    with pytest.raises(InputError, match="empty"):
        prof.parse_ints(",", "contexts")


# --- the PNG writer -------------------------------------------------------------------------------

def read_png(data: bytes):
    """(width, height, RGB pixels as floats in [0, 1]) of a PNG: the signature and IHDR checked by
    hand, the pixels decoded by matplotlib's own reader."""
    from matplotlib.image import imread

    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    px = imread(io.BytesIO(data), format="png")
    assert px.shape[:2] == (h, w)
    return w, h, px[:, :, :3]


def count(px, color: str) -> int:
    """Pixels of exactly this matplotlib colour (to within one 8-bit step)."""
    from matplotlib.colors import to_rgb

    return int((np.abs(px - np.array(to_rgb(color))) <= 1 / 255).all(axis=2).sum())


def test_line_plot_writes_a_decodable_png_with_every_series(tmp_path):
    widths = [1, 2, 4, 8, 16, 32, 64]
    series = {"ctx 443": (widths, [5, 8, 10, 14, 21, 39, 76]),
              "ctx 1596": (widths, [6, 9, 12, 16, 25, 45, 88], [5, 8, 11, 15, 23, 43, 85], [7, 10, 13, 17, 27, 47, 91]),
              "ctx 8128": (widths, [9, 13, 17, 24, 35, 60, 120])}
    path = line_plot(tmp_path / "p.png", series, "rows", "verify ms", "verify time", size=(640, 400), y_zero=True)
    w, h, px = read_png(path.read_bytes())
    assert (w, h) == (640, 400)
    for color in ("C0", "C1", "C2"):  # one colour per series, each drawn
        assert count(px, color) > 50
    assert count(px, "C3") == 0  # and no fourth
    assert count(px, "white") > 0.5 * w * h  # a white background with a plot on it
    assert count(px, "white") < 0.97 * w * h


def test_point_and_interval_series_with_categories(tmp_path):
    def ratios(with_intervals):
        lo_hi = ([1.0, 0.9, 1.2], [1.2, 1.0, 1.4]) if with_intervals else ()
        path = line_plot(tmp_path / "r.png", {"adaspark / ar": ([0, 1, 2], [1.1, 0.95, 1.3], *lo_hi)},
                         y_label="ratio", connect=False, x_ticks=[(0, "convfinqa"), (1, "longbench"), (2, "specbench")],
                         hlines=[1.0])
        return read_png(path.read_bytes())

    w, h, px = ratios(True)
    assert (w, h) == (800, 500)
    _, _, bare = ratios(False)
    assert count(px, "C0") > count(bare, "C0") + 30  # the whiskers are drawn in the series' colour
    with pytest.raises(ValueError):
        line_plot(tmp_path / "bad.png", {"x": ([1, 2], [1])})
    with pytest.raises(ValueError):
        line_plot(tmp_path / "bad.png", {"x": ([1, 2], [1, 2], [0], [3])})
    assert not (tmp_path / "bad.png").exists()


def test_without_matplotlib_a_plot_is_one_error_line(tmp_path, monkeypatch):
    from adaspark_cli.plot import missing, require_matplotlib

    assert missing() == ""
    require_matplotlib()  # installed (the test extra): no error
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # now `import matplotlib` fails
    with pytest.raises(InputError) as e:
        require_matplotlib()
    assert str(e.value) == "--plot needs matplotlib: pip install 'adaspark[plot]'"
    assert "pip install 'adaspark[plot]'" in missing() and "\n" not in missing()
    with pytest.raises(InputError, match="needs matplotlib"):
        line_plot(tmp_path / "p.png", {"x": ([1, 2], [1, 2])})
    assert not (tmp_path / "p.png").exists()


# --- the command ----------------------------------------------------------------------------------

# The command's own function in a throwaway Typer app, so these run whether or not main.py has
# registered it; the real `adaspark profile` is exercised by the model test below.
APP = ("import typer, sys; from adaspark_cli.profile_cmd import profile; app = typer.Typer(add_completion=False); "
       "app.command()(profile); app.command('x')(lambda: None); sys.argv[0] = 'adaspark'; app()")


def profile_cmd(*args):
    return subprocess.run([sys.executable, "-c", APP, "profile", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("widths, word", [("0", "between 1 and 64"), ("1,65", "between 1 and 64"), ("a,b", "--widths")])
def test_bad_widths_are_one_error_line(widths, word):
    assert_one_error_line(profile_cmd("--widths", widths), word)


def test_unreadable_models_are_one_error_line(tmp_path):
    assert_one_error_line(profile_cmd("--model", tmp_path / "nope.gguf"), "not found")
    bad = tmp_path / "m.gguf"
    bad.write_text("not a model")
    assert_one_error_line(profile_cmd("--model", bad), "not a GGUF")


def test_plot_must_be_a_png(tmp_path):
    assert_one_error_line(profile_cmd("--plot", tmp_path / "p.jpg"), ".png")


def test_plot_without_matplotlib_is_refused_before_anything_runs(tmp_path):
    """The matplotlib error comes before the model is even looked for (it would be "not found")."""
    res = subprocess.run([sys.executable, "-c", "import sys; sys.modules['matplotlib'] = None; " + APP, "profile",
                          "--model", str(tmp_path / "nope.gguf"), "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=120)
    assert_one_error_line(res, "--plot needs matplotlib", "adaspark[plot]")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.model
def test_profile_json_shape(tmp_path):
    png = tmp_path / "verify.png"
    res = adaspark("profile", "--widths", "1,2", "--contexts", "64,256", "--rounds", 3, "--json", "--plot", png)
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["schema"] == 1 and out["widths"] == [1, 2] and out["contexts"] == [64, 256]
    assert out["rounds"] == 3 and out["warmup"] == 2 and out["passes"] == 2
    assert {"cpu", "cpus", "arch", "llama_cpp_python", "threads"} <= set(out["machine"])
    assert out["model"]["path"].endswith(".gguf") and out["model"]["size_bytes"] > 0
    assert out["n_ctx"] > 256 + 2 and out["notes"] == []
    assert [(c["width"], c["context"]) for c in out["cells"]] == [(1, 64), (1, 256), (2, 64), (2, 256)]
    for c in out["cells"]:
        assert len(c["samples"]) == len(c["decode_samples"]) == 2
        assert all(len(s) == 3 and all(v > 0 for v in s) for s in c["samples"])
        assert c["ms"] > 0 and c["decode_ms"] > 0 and len(c["pass_ms"]) == 2
        assert c["ms"] == pytest.approx(sorted(c["pass_ms"])[0] / 2 + sorted(c["pass_ms"])[1] / 2)
        assert c["pass_ms"] == pytest.approx([s[2] for s in c["samples"]])  # one kept round per pass
    assert [f["width"] for f in out["fits"]] == [1, 2]
    for f in out["fits"]:
        assert isinstance(f["alpha_ms"], float) and isinstance(f["beta_ms_per_token"], float)
        assert len(f["residuals_ms"]) == len(f["residuals_rel"]) == 2
        assert f["max_abs_residual_ms"] == pytest.approx(0.0, abs=1e-6)  # two points: an exact line
    w, h, _ = read_png(png.read_bytes())
    assert w > 100 and h > 100
