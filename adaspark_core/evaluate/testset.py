"""The conversation sets of the paper's Appendix A (the benchmark workload ``../shared/testset``
beside the repository, or the repository's own excerpt ``fixtures/testset``) and any file of the
same format: ``{"set", "provenance", "subset", "conversations": [...]}``; a conversation
has ``name``, ``kind``, ``source`` and ``turns``, a turn ``kind``, ``type`` and ``text`` (and, in
tool-use sets, ``result``: the recorded tool result returned after the model's reply)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from adaspark_core.base.errors import InputError
from adaspark_core.base.files import read_regular

# The sources in the order of the paper's Table 13 (and ../shared/testset/README.md).
SOURCE_ORDER = ("specbench", "speedbench", "wildchat", "convfinqa", "toolace", "longbench")
# The largest set file read whole. Every turn is a prompt that fits a context; the benchmark's
# largest set (longbench) is 91 KB, so 64 MB is a file that is not a set.
MAX_SET_BYTES = 64 << 20


def shared_dir() -> Path:
    """``../shared/testset`` beside the repository: the benchmark workload."""
    return Path(__file__).resolve().parents[3] / "shared" / "testset"


def fixture_dir() -> Path:
    """``fixtures/testset``: a verbatim excerpt of it in the repository (its README says which
    conversations), so a fresh clone tests itself and runs ``compare`` with no folder beside it."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "testset"


def default_dir() -> Path:
    """The benchmark workload where it is, else the repository's excerpt."""
    return shared_dir() if shared_dir().is_dir() else fixture_dir()


@dataclass(frozen=True, slots=True)
class Conversation:
    set: str
    name: str
    kind: str
    turns: tuple[dict, ...]
    tools: tuple[dict, ...] = ()  # the tool schemas a tool-use conversation offers
    # The OpenAI response_format its replies must follow (json_workload's structured-output requests)
    response_format: dict | None = None


def load(path: Path) -> list[Conversation]:
    """The conversations of one set file; InputError naming the file for anything malformed."""
    return read_set(path)[0]


def read_set(path: Path) -> tuple[list[Conversation], bool]:
    """(the conversations of one set file, whether it says it already is the paper's evaluation
    subset, as ../shared/testset does), read once; InputError naming the file for anything
    that is not a regular file of at most MAX_SET_BYTES holding a conversation set."""
    try:
        raw = read_regular(path, "the conversation set", MAX_SET_BYTES)
    except FileNotFoundError as e:
        raise InputError(f"cannot read the conversation set {path}: {e.strerror}") from None
    try:
        d = orjson.loads(raw)
        convs = d["conversations"]
        name = d.get("set") or Path(path).stem
        out = [Conversation(name, c["name"], c["kind"], tuple(c["turns"]), tuple(c.get("tools") or ())) for c in convs]
        if any(not isinstance(t.get("text"), str) for c in out for t in c.turns):
            raise ValueError("a turn has no text")
        return out, str(d.get("subset", "")).startswith("evaluation subset")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise InputError(f"{path} is not a conversation set ({e})") from None


def load_sources(names: list[str], directory: Path | None = None) -> list[Conversation]:
    """Conversations of the named sources (``specbench`` or ``specbench:rag,summarization`` to
    keep only some kinds), in the order given."""
    directory = directory or default_dir()
    out: list[Conversation] = []
    for spec in names:
        source, _, kinds = spec.partition(":")
        convs = load(directory / f"{source}.json")
        keep = set(kinds.split(",")) if kinds else None
        out += [c for c in convs if keep is None or c.kind in keep]
    return out


def user_message(turn: dict) -> dict:
    return {"role": "user", "content": turn["text"]}


def first_halves(items: list, source=lambda c: c.set) -> list:
    """The first half (rounded up) of each source's conversations, in order: a warm-up that leaves
    the second halves unseen, to measure what a warm store gives on text it has not met."""
    by_source: dict = {}
    for c in items:
        by_source.setdefault(source(c), []).append(c)
    return [c for group in by_source.values() for c in group[: (len(group) + 1) // 2]]
