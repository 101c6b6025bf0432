"""``adaspark compare``: several arms over the same conversations in one run (paper 4.1, App. A).

Every arm answers every turn with its own earlier replies as history, the arms taking turns in an
order that reverses from one turn to the next (so drift on the machine falls on all of them). A
reply's decode speed is on the client clock: the tokens after the first delta over the time from
the first delta to the last. AdaSpark's arms run through the scheduler (``generation.Generation``);
``pld:N`` is llama-cpp-python's own prompt-lookup decoding (``LlamaPromptLookupDecoding`` with
``num_pred_tokens`` N) through its high-level ``Llama`` API, the peer a user of that API has today;
``llama:SPEC`` is llama.cpp's own llama-server with its ``--spec-type`` SPEC (adaspark_core/evaluate/peer.py).

A conversation with a ``response_format`` (the JSON extraction workload, json_workload.py) is answered
under its JSON schema by every arm: ours through a grammar (decode/grammar.py), llama-server through
its own (``json_schema``); ``pld:N`` takes no grammar and is refused. Every such reply is checked
against its schema (``json_valid``).

A tool turn (ToolACE) gives two timed replies when the model calls a tool: the call, then the answer
after the recorded result is returned as a ``tool`` message; a reply that calls nothing ends the turn.
Where the model's chat template takes tools (``Chat.calls``: its call format), a conversation's tools
and calls go through the template and the reply's calls are read with the server's parser, as
``adaspark serve`` and llama-server ``--jinja`` do (``tool_calls`` counts the replies whose calls
parse); otherwise the tools are listed in a system message and a call is told by its look.

Every reply also keeps its delta trace, ``[[tokens so far, seconds since the first delta], ...]`` on
the client clock (our arms' led by the decode's start, ``[0, seconds before the first delta]``),
from which stats.py measures every pair of replies over their common first N tokens (capped replies
included, and replies our arms emitted in one round). ``warm`` passes run the learning arms over the
whole workload before the measured pass, untimed and unrecorded, so they are measured from a warm
store; the learners are the arms' own, so what the warm pass taught them carries into the measured
pass.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Callable

import orjson

from adaspark_core.base.errors import InputError
from adaspark_core.base.files import replace
from adaspark_core.base.sampling import Sampling
from adaspark_core.candidates.memory import NgramMemory
from adaspark_core.decode.arms import Arm, parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.grammar import ANY_OBJECT, Grammar, LazyGrammar, follows_schema
from adaspark_core.evaluate.answer import Answer, trace_point
from adaspark_core.evaluate.peer import LlamaServerArm, draft_model_path
from adaspark_core.evaluate.testset import Conversation, user_message
from adaspark_core.evaluate.tracesim import Trace, write_trace
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundLog

SUBSETS = ("eval", "short", "all")


# --- workloads ------------------------------------------------------------------------------------


def subset(convs: list[Conversation], which: str, already_eval: bool) -> list[Conversation]:
    """The paper's subsets of one source's conversations. ``eval``: the first conversation of
    every category of a multi-category source, the first half of a single-category one (a file
    that already is the evaluation subset, as ../shared/testset, is kept whole); ``short``: the
    first two turns of the first conversation; ``all``: everything."""
    if which == "all" or not convs:
        return convs
    if which == "short":
        c = convs[0]
        return [dataclasses.replace(c, turns=c.turns[:2])]
    if which != "eval":
        raise InputError(f"unknown subset {which!r}: use {', '.join(SUBSETS)}")
    if already_eval:
        return convs
    kinds = {c.kind for c in convs}
    if len(kinds) > 1:
        seen, out = set(), []
        for c in convs:
            if c.kind not in seen:
                seen.add(c.kind)
                out.append(c)
        return out
    return convs[: (len(convs) + 1) // 2]


def prompt_conversation(path, text: str) -> Conversation:
    """A prompt file as a one-turn conversation of its own source."""
    return Conversation("prompts", str(path), "prompt", ({"kind": "prompt", "type": "first", "text": text},))


_CALL = re.compile(r'<tool_call>|"name"\s*:', re.S)


def looks_like_tool_call(text: str) -> bool:
    """Whether a reply calls a tool: a <tool_call> tag or a JSON object naming a function."""
    return bool(_CALL.search(text))


def reply_schema(conv: Conversation) -> dict | None:
    """The JSON schema a conversation's replies follow (its ``response_format``: a ``json_schema``'s
    schema, any object for ``json_object``); None for free text."""
    if conv.response_format is None:
        return None
    return (conv.response_format.get("json_schema") or {}).get("schema") or ANY_OBJECT


def system_messages(conv: Conversation) -> list[dict]:
    """The tools a conversation offers, as a system message every arm sees alike (for a chat
    template that takes no tools)."""
    if not conv.tools:
        return []
    schemas = orjson.dumps(conv.tools).decode()
    return [{"role": "system", "content": "You can call these tools. To call one, reply with a JSON object "
             f'{{"name": ..., "arguments": {{...}}}}.\nTools: {schemas}'}]


@dataclasses.dataclass(frozen=True)
class Chat:
    """How a conversation's messages become prompts and a reply's calls are read. ``render``: the
    model's chat template, ``(messages)`` or, with tools, ``(messages, tools)`` to tokens.
    ``calls``: where the template takes tools, the server's reader of a reply's calls (text to
    content and OpenAI ``tool_calls``; the tools and calls then go through the template, as the
    server renders them); None: tools as a system message, calls told by their look."""

    render: Callable
    calls: Callable[[str], tuple[str, list[dict]]] | None = None
    # Where the template takes tools: a conversation's tools to the lazy grammar our arms decode
    # its replies under, as the server does under ``tool_choice: auto`` (where a call's JSON
    # begins in a reply's text, the schema of its calls: decode/grammar.LazyGrammar)
    held: Callable[[list[dict]], tuple[Callable[[str], int | None], dict]] | None = None

    def lazy(self, conv: Conversation) -> tuple[Callable[[str], int | None], dict] | None:
        """The lazy grammar a tool conversation's replies decode under in our arms, or None."""
        return self.held(list(conv.tools)) if self.held is not None and self.calls is not None and conv.tools else None

    def history(self, conv: Conversation) -> list[dict]:
        """The messages before a conversation's first turn."""
        return [] if self.calls is not None else system_messages(conv)

    def prompt(self, conv: Conversation, messages: list[dict]) -> list[int]:
        if self.calls is not None and conv.tools:
            return self.render(messages, list(conv.tools))
        return self.render(messages)

    def read(self, conv: Conversation, text: str) -> tuple[dict, int | None]:
        """(the reply as an assistant message, how many calls it makes: None outside a tool
        conversation; without a reader, 1 for a reply that looks like a call). Read by the server's
        reader, a reply keeps its first call only (``parallel_tool_calls: false``), the one the
        recorded result answers."""
        if not conv.tools:
            return {"role": "assistant", "content": text}, None
        if self.calls is None:
            return {"role": "assistant", "content": text}, int(looks_like_tool_call(text))
        content, calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, 0
        return {"role": "assistant", "content": content or None, "tool_calls": calls[:1]}, len(calls)

    def result(self, reply: dict, result) -> dict:
        """The recorded tool result, as the message answering the reply's call."""
        if "tool_calls" in reply:
            return {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": str(result)}
        return {"role": "tool", "content": str(result)}


# --- arms -----------------------------------------------------------------------------------------


class SchedulerArm:
    """An AdaSpark arm. A learning arm has learners of its own, fresh or restored: it learns only
    from its own requests."""

    def __init__(self, arm: Arm, target, drafter=None, learners: Learners | None = None,
                 memory: NgramMemory | None = None, sampling: Sampling | None = None):
        self.arm, self.target, self.drafter = arm, target, drafter
        self.name = arm.name
        self.learners = (learners or Learners()) if arm.learns else None
        self.memory = memory  # the arm's own n-gram memory of its earlier replies
        self.sampling = sampling  # every reply sampled with these settings and seed (sampling.py)
        self.log = None

    def answer(self, prompt: list[int], max_tokens: int, request_id: str, remember: bool = True,
               schema: dict | None = None, lazy: tuple[Callable[[str], int | None], dict] | None = None) -> Answer:
        """One reply; under ``schema`` (a JSON schema) decoded under its grammar, or under a
        ``lazy`` one (where a held value begins, its schema: tool calls), a fresh one per reply,
        as a server builds one per request."""
        # a sampled reply learns in the sampled regime (Learners.regime)
        learners = self.learners.regime(self.sampling is not None) if self.learners is not None else None
        grammar = (Grammar.for_schema(self.target.model, schema) if schema is not None else
                   LazyGrammar(self.target.model, *lazy) if lazy is not None else None)
        gen = Generation(self.target, prompt, self.arm, max_tokens, request_id=request_id,
                         learners=learners, drafter=self.drafter, log=self.log, memory=self.memory,
                         remember=remember, sampling=self.sampling, grammar=grammar)
        for _ in gen:  # the generation stamps each round's delta on its clock (Stats.delta)
            pass
        st = gen.stats
        text = b"".join(map(self.target.piece, gen.tokens)).decode("utf-8", "replace")
        return Answer(gen.tokens, text, st.decode_tps, gen.finish, {str(w): n for w, n in sorted(st.widths.items())},
                      [trace_point(n, t) for n, t in st.trace()] or None, gen.end_token)


class PromptLookupArm:
    """llama-cpp-python's prompt-lookup decoding of ``n`` tokens a step (engine/prompt_lookup.py).
    All pld arms share one decoder."""

    def __init__(self, n: int, decoder, is_eog: Callable[[int], bool]):
        self.name = f"pld:{n}"
        self.n = n
        self.decoder = decoder
        self.is_eog = is_eog

    def answer(self, prompt: list[int], max_tokens: int, request_id: str, clock=time.perf_counter) -> Answer:
        dec = self.decoder
        tokens: list[int] = []
        times: list[float] = []
        finish = "length"
        for tok in dec.generate(prompt, self.n):
            if self.is_eog(tok):
                finish = "stop"
                break
            tokens.append(tok)
            times.append(clock())
            if len(tokens) >= max_tokens:
                break
            if len(prompt) + len(tokens) >= dec.n_ctx:
                finish = "context"
                break
        tok_s = (len(tokens) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
        text = dec.detokenize(tokens).decode("utf-8", "replace")
        # Llama.generate yields token by token: every token is a delta.
        trace = [trace_point(i + 1, t - times[0]) for i, t in enumerate(times)]
        return Answer(tokens, text, tok_s, finish, trace=trace or None)


def make_arms(specs: list[str], target, drafter, prompt_lookup: Callable[[], object], is_eog: Callable[[int], bool],
              learners_factory: Callable[[], Learners] = Learners, model_path=None, n_ctx: int | None = None,
              threads: int | None = None, memory_mb: float = 0.0, sampling: Sampling | None = None,
              schemas: bool = False, device_args: tuple[str, ...] = (),
              peer_device_args: list[tuple[str, ...]] | None = None) -> list:
    """The arms ``specs`` name, in order; ar is always first (the baseline). A ``llama:`` arm is
    llama.cpp's own llama-server (adaspark_core/evaluate/peer.py), run on ``model_path`` with ``n_ctx`` and
    ``threads`` (a ``llama:draft`` arm also on the draft file of ``drafter``, a model drafter);
    call ``close_arms`` when the run ends. ``prompt_lookup()`` makes the decoder the ``pld:N`` arms
    share (engine/prompt_lookup.py), only if one is named. ``memory_mb`` > 0: each learning arm with
    n-gram candidates keeps an n-gram memory of its own replies, of that cap (memory.py).
    ``sampling``: every AdaSpark arm, ar included, samples its replies with it (the same seed, so
    they sample the same text), and llama-server peers with llama.cpp's own sampler at the same
    settings (another sample of the same distribution); the pld peer decodes greedily and is
    refused. ``schemas``: the workload's replies follow JSON schemas (``reply_schema``), which the
    pld peer cannot decode under: refused too, before its model is loaded. ``device_args``: the
    run's device layout as llama-server's options, so the peers' layers run where ours do;
    ``peer_device_args``: the k-th llama-server arm's own, in place of it (a llama.cpp RPC server
    serves one client at a time, so each llama-server arm needs servers of its own)."""
    llama = [s.strip() for s in specs if s.strip().startswith("llama:")]
    if peer_device_args is not None and len(peer_device_args) != len(llama):
        raise InputError(f"--peer-rpc: one list of servers for each llama-server arm ({len(llama)}), "
                         f"not {len(peer_device_args)}")
    peers = [s.strip() for s in specs if s.strip().startswith("pld:")]
    if sampling is not None and peers:
        raise InputError(f"arm {peers[0]} decodes greedily: compare it at temperature 0")
    if schemas and peers:
        raise InputError(f"arm {peers[0]} (llama-cpp-python's prompt lookup) takes no grammar: leave the pld arms "
                         f"out of --arms for replies under JSON schemas")
    names = [s.strip() for s in specs if s.strip()]
    if "ar" in names:
        names.remove("ar")
    names.insert(0, "ar")
    if len(set(names)) != len(names):
        raise InputError("an arm is named twice")
    arms, decoder = [], None
    for spec in names:
        if spec.isdigit() and any(n.startswith("llama:") for n in names):  # llama:ngram-mod,8,16 split up
            raise InputError(f"arm {spec!r}: a llama-server arm's sizes go after colons, e.g. llama:ngram-mod:8:16")
        if spec.startswith("llama:"):

            if model_path is None or n_ctx is None:
                raise InputError(f"arm {spec}: a llama-server arm needs the model file and context size")
            # the reply's text made from its tokens as SchedulerArm makes it, so texts compare alike
            arms.append(LlamaServerArm(spec, model_path, n_ctx, threads, is_eog,
                                       detokenize=lambda toks: b"".join(map(target.piece, toks)).decode("utf-8", "replace"),
                                       sampling=sampling, draft_path=draft_model_path(drafter),
                                       device_args=device_args if peer_device_args is None
                                       else peer_device_args[sum(isinstance(a, LlamaServerArm) for a in arms)]))
            continue
        m = re.fullmatch(r"pld:(\d+)", spec)
        if m:
            if int(m.group(1)) < 1:
                raise InputError(f"arm {spec}: prompt lookup proposes at least one token")
            decoder = decoder or prompt_lookup()
            arms.append(PromptLookupArm(int(m.group(1)), decoder, is_eog))
            continue
        arm = parse_arm(spec)
        if arm.picks_only and drafter is None:
            raise InputError("arm block-chain verifies a model drafter's block: give --drafter")
        remembers = arm.learns and arm.uses_ngram and memory_mb > 0
        arms.append(SchedulerArm(arm, target, drafter, learners_factory() if arm.learns else None,
                                 NgramMemory(memory_mb) if remembers else None, sampling))
    return arms


def close_arms(arms: list) -> None:
    """Stop what the arms run outside this process (the llama-server peers); safe to call twice."""
    for a in arms:
        close = getattr(a, "close", None)
        if close is not None:
            close()


# --- the run ----------------------------------------------------------------------------------------


def run(convs: list[Conversation], arms: list, chat_prompt: Callable[..., list[int]] | Chat, n_ctx: int,
        max_tokens: int, repeat: int = 1, progress: Callable[[], None] | None = None, warm: int = 0,
        log_dir: Path | None = None, warm_convs: list[Conversation] | None = None) -> list[dict]:
    """Every arm over every conversation; one record per (arm, conversation, turn, reply), in the
    format adaspark_core/evaluate/stats.py reads. ``chat_prompt``: a ``Chat``, or the model's chat
    template alone (messages to tokens). ``repeat``: replies are decoded that many times and the
    median speed kept, with that run's trace (greedy decoding gives the same text each time).

    ``warm``: first run the learning arms (those with learners: adaspark, cost, pinned:N; a sampling
    arm samples, with the seed ``warm_seed`` gives each pass) over the whole workload (or over
    ``warm_convs``, e.g. ``testset.first_halves(convs)`` for a held-out measurement) that many times,
    untimed and unrecorded (request ids ``warm<k>:...``), so the measured pass starts from the store
    they learned. Each record says whether its conversation was in the warm passes (``warmed``).
    ``log_dir``: a round log per scheduler arm of the measured pass, ``<arm>.jsonl`` (``:`` as
    ``_``), and of the warm passes, ``warm-<arm>.jsonl``; each file is started afresh. A log holds
    one arm, so ``adaspark replay`` drives one set of fresh learners through it, as the run did
    (after the warm log, if any). With ``log_dir`` the baseline's prompts and replies also go to
    ``traces.jsonl`` (``adaspark simulate``, tracesim.py)."""
    chat = chat_prompt if isinstance(chat_prompt, Chat) else Chat(chat_prompt)
    learning = [a for a in arms if getattr(a, "learners", None) is not None]
    warmed = convs if warm_convs is None else warm_convs
    logs = _Logs(log_dir, [a for a in arms if isinstance(a, SchedulerArm)])
    try:
        if warm > 0 and learning:
            logs.open([a for a in learning if a in logs.arms], warm=True)
            _warm_passes(warm, warmed, learning, chat, n_ctx, max_tokens, progress)
            logs.close()
        logs.open(logs.arms, warm=False)
        records = _pass(convs, arms, chat, n_ctx, max_tokens, repeat, progress, "", logs.traces())
    finally:
        logs.close()
    _mark_same_text(records, arms[0].name)
    seen = {c.name for c in warmed} if warm > 0 else set()
    for r in records:
        r["warmed"] = r["conversation"] in seen
    return records


def _warm_passes(warm: int, convs: list[Conversation], learning: list, chat: Chat, n_ctx: int, max_tokens: int,
                 progress) -> None:
    """``warm`` untimed passes of the ``learning`` arms over ``convs`` (request ids ``warm<k>:...``),
    an arm that samples doing so at its own settings, with the seed ``warm_seed`` gives the pass."""
    sampled = [(a, getattr(a, "sampling", None)) for a in learning]
    try:
        for k in range(warm):
            # A sampled arm warms at its own settings with another seed: its sampled regime
            # learns this distribution's acceptance, not the very replies it is timed on.
            for a, how in sampled:
                if how is not None:
                    a.sampling = dataclasses.replace(how, seed=warm_seed(how.seed, k))
            _pass(convs, learning, chat, n_ctx, max_tokens, 1, progress, f"warm{k + 1}:")
    finally:
        for a, how in sampled:
            a.sampling = how


class _Logs:
    """The round logs of a run's scheduler ``arms`` in ``log_dir`` (none without one): a pass's
    are opened before it and closed after it, each file started afresh."""

    def __init__(self, log_dir: Path | None, arms: list[SchedulerArm]):
        self.dir, self.arms = log_dir, arms
        self.opened: list[RoundLog] = []
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)

    def open(self, which: list[SchedulerArm], warm: bool) -> None:
        if self.dir is None:
            return
        for a in which:
            a.log = RoundLog(log_path(self.dir, a.name, warm), fresh=True)  # a rerun into the same folder starts afresh
            self.opened.append(a.log)

    def traces(self) -> Path | None:
        """The file the measured pass's baseline prompts and replies go to, emptied."""
        if self.dir is None:
            return None
        traces = Path(self.dir) / TRACES
        replace(traces, b"")  # started afresh, as the logs are
        return traces

    def close(self) -> None:
        for a in self.arms:
            a.log = None
        while self.opened:
            self.opened.pop().close()


TRACES = "traces.jsonl"


def warm_seed(seed: int | None, k: int) -> int | None:
    """The seed of warm pass ``k`` (0-based) of an arm sampling with ``seed``: another sample of
    the same distribution (the measured pass's seed plus k + 1, wrapped to 63 bits); None stays
    None (every reply draws its own)."""
    return None if seed is None else (seed + k + 1) % (1 << 63)


def log_path(log_dir: Path, arm: str, warm: bool = False) -> Path:
    """``DIR/chain_3.jsonl``, ``DIR/warm-adaspark.jsonl``: one round log per arm and pass."""
    return Path(log_dir) / f"{'warm-' if warm else ''}{arm.replace(':', '_').replace('/', '_')}.jsonl"


def steps(convs: list[Conversation], arms: list, warm: int = 0, warm_convs: list[Conversation] | None = None) -> int:
    """The progress steps ``run`` takes: one per (arm, turn) of the measured and warm passes."""
    turns = sum(len(c.turns) for c in convs)
    warm_turns = turns if warm_convs is None else sum(len(c.turns) for c in warm_convs)
    learning = sum(1 for a in arms if getattr(a, "learners", None) is not None)
    return turns * len(arms) + warm * learning * warm_turns


def _pass(convs: list[Conversation], arms: list, chat: Chat, n_ctx: int, max_tokens: int, repeat: int,
          progress, tag: str, traces: Path | None = None) -> list[dict]:
    """One pass of ``arms`` over the workload; ``tag`` prefixes the request ids. ``traces``: the
    file the first arm's prompts and replies are appended to."""
    records: list[dict] = []
    for ci, conv in enumerate(convs):
        history = {a.name: chat.history(conv) for a in arms}
        schema, lazy = reply_schema(conv), chat.lazy(conv)
        alive = {a.name: True for a in arms}
        for ti, turn in enumerate(conv.turns):
            order = arms if (ci + ti) % 2 == 0 else arms[::-1]
            for arm in order:
                if progress:
                    progress()
                if not alive[arm.name]:
                    continue
                messages = history[arm.name] + [user_message(turn)]
                for reply in (0, 1):
                    prompt = chat.prompt(conv, messages)
                    if len(prompt) + max_tokens >= n_ctx:
                        alive[arm.name] = False  # the conversation no longer fits: it ends here
                        break
                    ans = _answer(arm, prompt, max_tokens, f"{tag}{conv.name}/{ti}/{reply}", repeat, schema, lazy)
                    said, calls = chat.read(conv, ans.text)
                    if traces is not None and arm is arms[0]:
                        write_trace(traces, Trace(f"{conv.name}/{ti}/{reply}", conv.set, conv.name, ti, reply,
                                                  list(prompt), list(ans.tokens), ans.finish, ans.end, max_tokens))
                    records.append({"arm": arm.name, "source": conv.set, "conversation": conv.name, "turn": ti,
                                    "reply": reply, "tok_s": ans.tok_s, "tokens": len(ans.tokens),
                                    "capped": ans.finish == "length", "context": len(prompt), "finish": ans.finish,
                                    "widths": ans.widths, "text": ans.text, "trace": getattr(ans, "trace", None),
                                    "json_valid": None if schema is None else follows_schema(ans.text, schema),
                                    "tool_calls": calls})
                    messages = messages + [said]
                    if reply == 1 or turn.get("result") is None or not calls:
                        break
                    messages = messages + [chat.result(said, turn["result"])]
                history[arm.name] = messages
    return records


def left_out(convs: list[Conversation], records: list[dict], baseline: str) -> int:
    """The turns of ``convs`` the baseline never decoded: a conversation ends where its next
    prompt and the reply cap no longer fit the context (``_pass``)."""
    done = {(r["conversation"], r["turn"]) for r in records if r["arm"] == baseline}
    return sum(len(c.turns) for c in convs) - len(done)


def _answer(arm, prompt, max_tokens, request_id, repeat, schema=None, lazy=None) -> Answer:
    """``arm``'s reply (the median of ``repeat`` runs); under ``schema``, or in our arms under the
    ``lazy`` grammar of a tool conversation's calls (llama-server's arms are sent no lazy grammar)."""
    ours = isinstance(arm, SchedulerArm)
    # A repeat must not find its own reply in the arm's n-gram memory: only the last run adds it.
    answers = [arm.answer(prompt, max_tokens, request_id, **({"remember": k == repeat - 1} if ours else {}),
                          **({"schema": schema} if schema is not None else {}),  # pld:N takes none
                          **({"lazy": lazy} if ours and lazy is not None else {}))
               for k in range(repeat)]
    first = answers[0]
    if repeat > 1:
        # The median run's speed and its trace, so the first-N ratio measures the same run.
        timed = sorted((a for a in answers if a.tok_s is not None), key=lambda a: a.tok_s)
        mid = timed[len(timed) // 2] if timed else None
        first.tok_s = mid.tok_s if mid else None
        first.trace = getattr(mid, "trace", None) if mid else getattr(first, "trace", None)
    return first


def _mark_same_text(records: list[dict], baseline: str) -> None:
    base = {(r["conversation"], r["turn"], r["reply"]): r["text"] for r in records if r["arm"] == baseline}
    for r in records:
        key = (r["conversation"], r["turn"], r["reply"])
        r["same_text_as_baseline"] = None if r["arm"] == baseline or key not in base else r["text"] == base[key]
