import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/fakes.py and tests/helpers.py, from every folder


def _private_home() -> None:
    """Every test process gets its own cache home, so no test reads or writes the user's learned
    stores (a store another build left in ~/.cache once failed CI: "written by a newer AdaSpark").
    Only the prepared models are shared, through a link: requantising the default per run costs
    seconds and the file never changes. Set here, at import, so the commands the tests start inherit it."""
    from adaspark_core.base.paths import models_dir

    models = models_dir()
    models.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="adaspark-tests-"))
    (home / "models").symlink_to(models, target_is_directory=True)
    os.environ["ADASPARK_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, ignore_errors=True)


_private_home()

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "fixtures" / "prompts"
TESTSET = ROOT / "fixtures" / "testset"  # the repository's excerpt of the benchmark workload
# The simulated model (adaspark_core/engine/simlm.py) for command tests where llama.cpp is not the
# point: the whole CLI, store and log run on it, in a fraction of the real model's load time.
SIM = "sim:cpu-smollm2-q4_0"
# A re-score's top-2 logit gap below this is a near tie: where kernels of different shapes may
# pick different argmaxes (paper 3.5).
NEAR_TIE = 0.5


@pytest.fixture(scope="session")
def default_model_path():
    from adaspark_core.engine.models import default_model

    return default_model()


@pytest.fixture(scope="session")
def lm(default_model_path):
    from adaspark_core.engine.llama import LlamaModel

    model = LlamaModel(default_model_path)
    yield model


@pytest.fixture(scope="session")
def target(lm):
    from adaspark_core.engine.llama_target import LlamaTarget

    return LlamaTarget(lm, n_ctx=2048)


def assert_same_sample(lm, prompt, got, want, sampling, seed, what=""):
    """``got`` is the sample ``want`` is, or parts from it only where kernels of other shapes may
    have swapped the two best perturbed scores: at the first token they differ, a re-score's top
    two perturbed scores (sampling.scores) nearly tie (the greedy near-tie rule, paper 3.5)."""
    import numpy as np

    from adaspark_core.base.sampling import scores
    from adaspark_core.engine.llama_sequence import score

    if got == want:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    row = score(lm, prompt + want[:i])[-1]
    _, sc = scores(row, sampling, seed, len(prompt) - 1 + i)
    top2 = np.sort(sc)[-2:]
    assert top2[1] - top2[0] < NEAR_TIE, (what, i, top2)


def prompt_tokens(lm, name):
    return lm.chat_prompt([{"role": "user", "content": (PROMPTS / name).read_text()}])
