"""A running decoder: the model, its target, the drafter, the learners with their store, and the
round log, opened from options and closed (saved) in one place. ``decode``, ``serve-stdin``,
``compare`` and ``profile`` are each a few lines around a Runtime.

    with Runtime.open(EngineOptions(model=...), Speculation.of("adaspark"), log=path) as rt:
        gen = rt.generation(rt.chat([{"role": "user", "content": text}]), max_tokens=256)
        text = rt.run(gen, on_text=print)

The model is a GGUF file (llama.cpp) or ``sim:CURVE`` (engine/simlm.py: a simulated model on a
virtual clock, for testing everything around the engine without llama.cpp).
"""

from __future__ import annotations

import codecs
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from adaspark_core.base.errors import InputError
from adaspark_core.base.paths import is_sim
from adaspark_core.base.sampling import Sampling
from adaspark_core.candidates.memory import NgramMemory
from adaspark_core.candidates.memory_file import load as load_memory
from adaspark_core.candidates.memory_file import memory_path
from adaspark_core.candidates.memory_file import save as save_memory
from adaspark_core.candidates.ngram import KeptIndexes
from adaspark_core.decode.arms import Arm, Speculation
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.grammar import Grammar, LazyGrammar
from adaspark_core.engine import simlm
from adaspark_core.engine.devices import DeviceLayout, on_server_lost
from adaspark_core.learn.learned import Learners
from adaspark_core.store.fingerprint import fingerprint, fingerprint_key
from adaspark_core.store.record import RoundLog
from adaspark_core.store.store import Store, default_store_path


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What the model options of every command name (``--model``, ``--n-ctx``, ``--threads``,
    ``--drafter``, ``--block``, ``--draft-top-k``), by name only."""

    model: str | Path | None = None  # a GGUF file, sim:CURVE, or None for the default model
    n_ctx: int | None = None
    threads: int | None = None
    drafter: str = "none"
    block: int | None = None
    draft_top_k: int = 8  # candidates a model drafter keeps per position (K; not sampling's top-k)
    reuse_prefix: bool = False  # keep the committed KV across requests (serving several in a row)
    parallel: int = 1  # requests decoded together, each in a slot of one context (decode/batch.py)
    chat_template: str | None = None  # a Jinja chat template in place of the model's (--chat-template-file)
    layout: DeviceLayout = DeviceLayout()  # where the model's layers run (--n-gpu-layers, --device, ...)


def open_model(spec: str | Path | None, chat_template: str | None = None, layout: DeviceLayout = DeviceLayout()):
    """The model ``--model`` names: a SimModel for ``sim:CURVE``, else a loaded GGUF (the default
    model when None) on ``layout``. llama.cpp is imported only here, so a simulated run never loads it."""
    if spec is not None and is_sim(str(spec)):  # a file named so is ./sim:NAME
        if chat_template is not None:
            raise InputError(f"a simulated model ({spec}) has its own chat markup: no --chat-template-file")
        if not layout.local_cpu:
            raise InputError(f"a simulated model ({spec}) runs on no device: no --n-gpu-layers, --device, "
                             "--tensor-split or --rpc")
        return simlm.SimModel(str(spec))
    from adaspark_core.engine.llama import LlamaModel
    from adaspark_core.engine.models import resolve_model

    return LlamaModel(resolve_model(spec), chat_template=chat_template, layout=layout)


def _drafter(spec: str, model, target, opts: EngineOptions):
    if isinstance(model, simlm.SimModel):
        if spec not in (None, "", "none"):
            raise InputError(f"a simulated model ({model.path}) takes no drafter: use --drafter none")
        return None
    from adaspark_core.candidates.drafters import make_drafter

    return make_drafter(spec, target, opts.threads, opts.block, opts.draft_top_k)


def _batch_engine(model, opts: EngineOptions):
    """The slots ``--parallel`` asks for: llama.cpp models only, no model drafter (a drafter keeps
    one request's state)."""
    if isinstance(model, simlm.SimModel):
        raise InputError(f"a simulated model ({model.path}) decodes one request at a time: use --parallel 1")
    if opts.drafter not in (None, "", "none"):
        raise InputError("a model drafter follows one request: --parallel above 1 needs --drafter none")
    from adaspark_core.engine.llama_batch import LlamaBatch

    return LlamaBatch(model, opts.parallel, n_ctx=opts.n_ctx, threads=opts.threads, reuse_prefix=opts.reuse_prefix)


def _check_log(log: Path, rt: "Runtime") -> None:
    """Refuse a round log that names a file the runtime reads or keeps (the model, the drafter,
    the store and its memory): appending to it would ruin it, and the next save would replace the
    log. InputError naming both."""
    mine = {"the model file": rt.model.path, "the store": rt.store.path if rt.store else None,
            "the store's n-gram memory": memory_path(rt.store.path) if rt.store else None,
            "the drafter file": getattr(getattr(rt.drafter, "model", None), "path", None)}
    real = os.path.realpath(log)
    for what, path in mine.items():
        if path is not None and os.path.realpath(path) == real:
            raise InputError(f"the round log {log} is {what}; name another file for --log")


# Between a server's replies the n-gram memory file is rewritten whole, and a reply's end waits for
# it (and, batched, so does every other request; ARCHITECTURE.md, section 5, has the times).
# A write slower than MEMORY_SLOW_S is therefore repeated at most every MEMORY_EVERY_S while
# serving; the server's last save, and every save outside a server, write it whenever it changed.
MEMORY_SLOW_S = 0.005
MEMORY_EVERY_S = 30.0


class Runtime:
    """Owns what it opened. ``save()`` writes the learned state (learning arms only); ``close()``
    releases the store, closes the log, and frees the drafter and the target. Closing does not
    save: a request that failed on bad input leaves no store behind."""

    def __init__(self, model, target, drafter, spec: Speculation | None, store: Store | None,
                 learners: Learners | None, log: RoundLog | None, threads: int | None):
        self.model, self.target, self.drafter, self.spec = model, target, drafter, spec
        self.store, self.learners, self.log = store, learners, log
        self.threads = threads
        self.memory: NgramMemory | None = None  # kept beside the store (memory.py)
        self._memory_written = -float("inf")  # when the memory file was last written (monotonic s)
        self._memory_write_s = 0.0  # and how long that took
        # With --parallel N: the N slots of one context (the first is ``target``) and the engine
        # that verifies them together (engine/llama_batch.py LlamaBatch); alone: [target] and None.
        self.slots: list = []
        self.engine = None
        # Each slot's last n-gram index, which its next request extends where its prompt goes on
        # from that request's text (candidates/ngram.py KeptIndexes).
        self.kept_indexes = KeptIndexes()
        self._forget_hook: Callable[[], None] | None = None  # takes back on_server_lost's hook

    @property
    def arm(self) -> Arm | None:
        return self.spec.arm if self.spec is not None else None

    @classmethod
    def open(cls, opts: EngineOptions, spec: Speculation | str | Arm | None = None, store: Path | None = None,
             log: Path | None = None, model=None) -> "Runtime":
        """Everything the options name, opened in the order that finds bad input soonest: the arm
        (``spec``: a Speculation, or an arm with every other setting at its default; None: no arm),
        the model (``model`` if already loaded), its target, the drafter, the store (learning arms
        only: it is keyed by the model, the drafter and the machine) with its n-gram memory (arms
        with n-gram candidates, the spec's ``memory_mb`` > 0: its cap), the log. What was opened
        before an error is closed again."""
        spec = Speculation.of(spec) if spec is not None else None
        the_arm = spec.arm if spec is not None else None
        rt = cls(None, None, None, spec, None, None, None, opts.threads)
        try:
            rt.model = model if model is not None else open_model(opts.model, opts.chat_template, opts.layout)
            if opts.parallel > 1:
                rt.engine = _batch_engine(rt.model, opts)
                rt.slots = rt.engine.slots
                rt.target = rt.slots[0]
            else:
                rt.target = rt.model.target(n_ctx=opts.n_ctx, threads=opts.threads, reuse_prefix=opts.reuse_prefix)
                rt.slots = [rt.target]
            rt.drafter = _drafter(opts.drafter, rt.model, rt.target, opts)
            if the_arm is not None and the_arm.learns:
                layout = getattr(rt.model, "layout", DeviceLayout())  # a simulated model has none
                fp = fingerprint(rt.model.path, rt.drafter.model.path if rt.drafter is not None else None,
                                 layout=layout.fingerprint())
                rt.store = Store.open(store or default_store_path(fp), fp)
                rt.learners = Learners.from_store(rt.store, spec.learners)
                if the_arm.uses_ngram and spec.memory_mb > 0:
                    rt.memory = load_memory(rt.store.path, fingerprint_key(fp), spec.memory_mb, rt.model.n_vocab)
                if layout.rpc:
                    rt._forget_hook = on_server_lost(rt.save)  # what was learned outlives a lost server
            if log is not None:
                _check_log(log, rt)
                rt.log = RoundLog(log)
        except BaseException:
            rt.close()
            raise
        return rt

    # --- requests -----------------------------------------------------------------------------

    def tokens(self, text: str) -> list[int]:
        """Raw text as the model's tokens (no chat template)."""
        return self.model.tokenize(text)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, reply_start: str = "") -> list[int]:
        """Messages (and ``tools``) through the model's chat template, ready for the assistant's
        reply, which starts with ``reply_start``."""
        return self.model.chat_prompt(messages, tools, reply_start)

    def json_grammar(self, schema: dict) -> Grammar:
        """A request's grammar of JSON replies following ``schema`` on the runtime's model;
        InputError for a schema that cannot be compiled."""
        return Grammar.for_schema(self.model, schema)

    def lazy_grammar(self, opens: Callable[[str], int | None], schema: dict) -> LazyGrammar:
        """A request's grammar of JSON values following ``schema`` from each place ``opens`` finds
        one begun in its reply (tool calls under ``auto``); InputError for a schema it cannot compile."""
        return LazyGrammar(self.model, opens, schema)

    def generation(self, prompt: list[int], max_tokens: int, request_id: str = "r0",
                   sampling: Sampling | None = None, target=None,
                   grammar: Grammar | LazyGrammar | None = None) -> Generation:
        """One request on the runtime's arm, learners, drafter and log. A simulated target brings
        its virtual clock; a real one is timed on the wall clock. A sampled request (``sampling``)
        speculates as a greedy one does, with draws speculation cannot change (sampling.py), and
        learns into the sampled regime's learners (Learners.regime). ``target``: the slot it
        decodes in (one of ``slots``), by default the runtime's target. ``grammar``: its reply's
        (structured output, ``json_grammar``; tool calls under ``auto``, ``lazy_grammar``)."""
        clock = getattr(self.target, "clock", time.perf_counter)
        learners = self.learners.regime(sampling is not None) if self.learners is not None else None
        return Generation(target or self.target, prompt, self.spec, max_tokens, request_id=request_id,
                          log=self.log, clock=clock, drafter=self.drafter, learners=learners,
                          memory=self.memory, sampling=sampling, kept_indexes=self.kept_indexes, grammar=grammar)

    def run(self, gen: Generation, on_text: Callable[[str], None] | None = None,
            stop: Callable[[], str | None] | None = None) -> str:
        """Decode ``gen``, passing each round's text to ``on_text`` as it comes (a UTF-8
        sequence may span tokens: it is held until whole). ``stop()`` is asked after every round
        and ends the reply early when it gives a finish ("stop", "interrupted"; Generation.end).
        Returns the whole text."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts: list[str] = []

        def out(text: str) -> None:
            parts.append(text)
            if text and on_text is not None:
                on_text(text)

        rounds = iter(gen)
        try:
            for emitted in rounds:
                out(utf8.decode(b"".join(map(self.model.piece, emitted))))
                if stop is not None and (finish := stop()):
                    gen.end(finish)
                    break
        finally:
            rounds.close()  # the reply's last round learns when its generator ends (generation.Generation)
        out(utf8.decode(b"", final=True))
        return "".join(parts)

    def save(self, rounds: int = 0, requests: int = 0, between_replies: bool = False) -> None:
        """Write the learners into their store (atomically), counting the requests and rounds they
        have seen since the last save, and the n-gram memory beside it if it changed. A server
        saving ``between_replies`` writes a memory whose last write was slow only every
        MEMORY_EVERY_S (a crash then loses the replies ended since the last write, at most that
        span of them; the learners are always written). OutputError if the store cannot be written."""
        if self.learners is None:
            return
        self.learners.to_store(self.store)
        self.store.bump(requests=requests, rounds=rounds)
        self.store.save()
        if self.memory is None or not self.memory.dirty:
            return
        now = time.monotonic()
        if between_replies and self._memory_write_s > MEMORY_SLOW_S and now - self._memory_written < MEMORY_EVERY_S:
            return
        save_memory(self.memory, self.store.path, fingerprint_key(self.store.fingerprint))
        self._memory_written = time.monotonic()
        self._memory_write_s = self._memory_written - now

    # --- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything, in the order it was opened backwards; safe to call twice."""
        if self._forget_hook is not None:
            self._forget_hook = self._forget_hook()
        for part in (self.log, self.store, self.drafter, self.target, self.engine):
            if part is not None:
                part.close()
        self.log = self.store = self.drafter = self.target = self.engine = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
