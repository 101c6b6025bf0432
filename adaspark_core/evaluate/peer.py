"""llama.cpp's own ``llama-server`` as a peer arm of ``adaspark compare`` (``llama:SPEC``).

The server process (its binary, built by ``make peer``, its command line, start, ``/health`` and
stop) is engine/llama_server.py's. This module owns the arm: the flags a spec gives, starting its
server lazily on the arm's first reply, the request, reading the stream and stopping it again.

Arm specs (colons, because ``--arms`` is a comma-separated list):

- ``llama:ar``: plain decoding, no speculation (the server's ``--spec-type none``).
- ``llama:SPEC``: speculation of the server's ``--spec-type SPEC`` with its default sizes, for the
  draft-model-free types ``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``, ``ngram-mod`` and
  ``ngram-cache``. (Of the ``draft-*`` types only ``draft-simple`` is offered, as ``llama:draft``
  below; the others need heads made for the model: MTP, EAGLE-3, DFlash, DSpark.)
- ``llama:SPEC:N:M``: the same with its two size flags (vendored ``common/arg.cpp``):

  =================  =================================  =================================
  SPEC               N                                  M
  =================  =================================  =================================
  ngram-simple       ``--spec-ngram-simple-size-n``     ``--spec-ngram-simple-size-m``
  ngram-map-k        ``--spec-ngram-map-k-size-n``      ``--spec-ngram-map-k-size-m``
  ngram-map-k4v      ``--spec-ngram-map-k4v-size-n``    ``--spec-ngram-map-k4v-size-m``
  ngram-mod          ``--spec-ngram-mod-n-match``       ``--spec-ngram-mod-n-max``
  =================  =================================  =================================

  N is the length of the n-gram looked up, M the most draft tokens proposed (server defaults:
  12 and 48 for the ngram-map family, 24 and 64 for ngram-mod). ngram-mod drafts only when it
  finds at least ``--spec-ngram-mod-n-min`` tokens (default 48); with M given, that minimum is
  min(48, M), which is what the default does whenever M is at least 48. ``ngram-cache`` has no
  size flags (it drafts 8 tokens from 1- to 4-grams).
- ``llama:draft:N`` and ``llama:draft:N:P``: the server's draft-model speculation (``--spec-type
  draft-simple``) on the draft file of the compare run's ``--drafter model:FILE``, the draft model
  our own arms then draft with; N is the most draft tokens a round, P the least probability the
  draft model's greedy pick needs for drafting to go on (server default 0: it drafts N). The flags
  (vendored ``common/arg.cpp``; its older ``--draft-max``/``--draft-min`` are removed there and
  refused, ``--draft-p-min`` is an alias of ``--spec-draft-p-min``)::

      --spec-type draft-simple --spec-draft-n-max N --spec-draft-n-min 0 [--spec-draft-p-min P]
      -md FILE -td T -tbd T -ngld 0

  The type must be named: with ``-md`` alone this server loads the draft model but infers a type
  from the draft file only for MTP, DFlash and DSpark drafts, so it decodes without speculating.
  The draft runs on the CPU (``-ngld 0``) with the target's threads; this version has no draft
  context-size flag: the server sizes the draft context as the target's (``common/speculative.cpp``).
  A run without a model drafter refuses these arms.

Each arm runs its own server on 127.0.0.1 at a free port with the compare run's model file,
context size and threads, one slot, no web UI, flash attention off (as our engine: with it on, a
row's logits depend on the batch), no prompt cache (``--cache-ram 0``, ``cache_prompt: false``: a
reply prefills its whole prompt, as our arms' replies do) and greedy sampling (top-k 1,
temperature 0), or at ``compare --temperature`` llama.cpp's sampler at our settings (its drafts are
accepted while they equal what its sampler draws, lossless as ours). A reply under a JSON schema
sends it as ``json_schema``, which the server turns into its GBNF grammar. ngram-mod keeps its
n-gram table across requests (a server-wide cache, by design), so it also finds text of earlier
replies, and with ``--repeat`` a reply's own earlier decode.

Timing is on the client clock, exactly as for our arms (``generation.Stats``): a reply's decode
speed is the tokens after the first delta over the time from the first delta that carried tokens
to the last one; a reply that came as one delta has none. The request streams
(``stream: true``), and the arrival time of every server-sent event is read here, in the client,
so the server's HTTP and JSON costs count as our own arms' Python costs do. What is a delta? The
server sends one event per token, also under speculation, where the tokens one verify accepted
come as a burst of events microseconds apart; our arms emit a round's tokens as one delta. So
events are grouped into the server's rounds: with ``timings_per_token`` every event carries the
server's ``predicted_ms``, the time of the round that produced it, which is the same for every
token of one round and differs between rounds. A delta is a run of events with the same
``predicted_ms``; its time is the arrival of its last event. (The speed itself would come out
the same timed per event, since the server's first delta is always the one token sampled from
the prompt's logits; the grouping makes the delta counts and the trace, tokens so far at each
delta, mean what they mean for our arms, whose trace has one point per round.) The
end-of-generation token is neither counted nor timed (our arms do not emit it). Tokens are counted
by the server's ``tokens_predicted``, because the server holds back the event of a token after
which the text ends inside a UTF-8 character and sends that text with the next token's event;
the token ids of such a reply are then fetched by a second, untimed request without streaming.

The Answer's trace has one point per such delta. The server's own timings
(``predicted_per_second``, ``draft_n``, ``draft_n_accepted``) are kept on the arm
(``last_timings``), not in the Answer: ``Answer.widths`` is our verified widths only.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from adaspark_core.base.errors import InputError
from adaspark_core.base.sampling import Sampling
from adaspark_core.engine import llama_server
from adaspark_core.engine.llama_server import HOST, LlamaServer, free_port, server_binary
from adaspark_core.evaluate.answer import Answer, trace_point

PREFIX = "llama:"

DRAFT_KIND = "draft"  # llama:draft:N[:P], the server's --spec-type DRAFT_TYPE on the run's draft model
DRAFT_TYPE = "draft-simple"
# --spec-type -> its (N, M) size flags, or None for a type without size flags.
SPEC_TYPES: dict[str, tuple[str, str] | None] = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m"),
    "ngram-mod": ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max"),
    "ngram-cache": None,
}
MAX_SIZE = 1024  # the vendored server refuses sizes above this
NGRAM_MOD_N_MIN = 48  # the vendored server's default --spec-ngram-mod-n-min
REPLY_TIMEOUT_S = 900.0  # per socket read: a long reply on a slow machine still streams within it


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A parsed ``llama:`` arm: the server's spec type (None: plain decoding) and sizes (N, M), or
    for ``llama:draft`` the most draft tokens and the least probability (N, P; P None: the default)."""

    name: str
    spec_type: str | None
    sizes: tuple[int, int] | None = None
    draft: tuple[int, float | None] | None = None

    @property
    def needs_draft(self) -> bool:
        """Whether the server runs a draft model (``draft_args``), which the compare run must name."""
        return self.spec_type == DRAFT_TYPE

    def server_args(self) -> list[str]:
        """The speculation flags; a draft arm's draft model flags are ``draft_args``."""
        if self.spec_type is None:
            return []
        args = ["--spec-type", self.spec_type]
        if self.draft is not None:
            n, p = self.draft
            args += ["--spec-draft-n-max", str(n), "--spec-draft-n-min", "0"]  # 0 is the default: stated
            if p is not None:
                args += ["--spec-draft-p-min", str(p)]
            return args
        if self.sizes is not None:
            flags = SPEC_TYPES[self.spec_type]
            assert flags is not None
            n, m = self.sizes
            args += [flags[0], str(n), flags[1], str(m)]
            if self.spec_type == "ngram-mod":
                args += ["--spec-ngram-mod-n-min", str(min(NGRAM_MOD_N_MIN, m))]
        return args


def parse_peer(spec: str) -> PeerSpec:
    """``llama:ar``, ``llama:SPEC``, ``llama:SPEC:N:M`` or ``llama:draft:N[:P]``; anything else is one
    InputError line."""
    name = spec.strip()
    if not name.startswith(PREFIX):
        raise InputError(f"arm {name!r} is not a llama-server arm (llama:ar, llama:SPEC, llama:SPEC:N:M "
                         f"or llama:draft:N[:P])")
    if "," in name:
        raise InputError(f"arm {name!r}: a llama-server arm's sizes go after colons, {PREFIX}SPEC:N:M")
    parts = name[len(PREFIX):].split(":")
    kind, nums = parts[0], parts[1:]
    if kind == "ar" and not nums:
        return PeerSpec(name, None)
    if kind == DRAFT_KIND:
        return _parse_draft(name, nums)
    if kind not in SPEC_TYPES:
        raise InputError(f"arm {name!r}: unknown llama-server spec type {kind!r}; use ar, {DRAFT_KIND}:N[:P] "
                         f"or one of {', '.join(SPEC_TYPES)}")
    if not nums:
        return PeerSpec(name, kind)
    if SPEC_TYPES[kind] is None:
        raise InputError(f"arm {name!r}: {kind} takes no sizes; use {PREFIX}{kind}")
    if len(nums) != 2 or not all(x.isdigit() for x in nums):
        raise InputError(f"arm {name!r}: give both sizes as whole numbers, {PREFIX}{kind}:N:M")
    n, m = int(nums[0]), int(nums[1])
    if not (1 <= n <= MAX_SIZE and 1 <= m <= MAX_SIZE):
        raise InputError(f"arm {name!r}: sizes N and M must be between 1 and {MAX_SIZE}")
    return PeerSpec(name, kind, (n, m))


def _parse_draft(name: str, nums: list[str]) -> PeerSpec:
    """``llama:draft:N[:P]`` after its kind: N a whole number >= 1 (the server has no upper bound),
    P a number in [0, 1]."""
    usage = f"{PREFIX}{DRAFT_KIND}:N or {PREFIX}{DRAFT_KIND}:N:P"
    if len(nums) not in (1, 2) or not nums[0].isdigit():
        raise InputError(f"arm {name!r}: give the most draft tokens N as a whole number, {usage}")
    n = int(nums[0])
    if n < 1:
        raise InputError(f"arm {name!r}: N, the most draft tokens, must be at least 1")
    if len(nums) == 1:
        return PeerSpec(name, DRAFT_TYPE, draft=(n, None))
    try:
        p = float(nums[1])
    except ValueError:
        p = math.nan
    if not 0.0 <= p <= 1.0:  # nan fails too
        raise InputError(f"arm {name!r}: P, the least probability a drafted token needs, must be a number "
                         f"from 0 to 1, {usage}")
    return PeerSpec(name, DRAFT_TYPE, draft=(n, p))


def draft_model_path(drafter) -> Path | None:
    """The draft GGUF of the compare run's model drafter (``--drafter model:FILE``), which a
    ``llama:draft`` arm gives the server; None without a drafter or for another kind (a DSpark
    drafter is a head on the target's hidden states, not a model llama-server can draft with)."""
    if drafter is None or getattr(drafter, "name", None) != "model":
        return None
    return Path(drafter.model.path)


def server_command(binary: Path, spec: PeerSpec, model_path, n_ctx: int, threads: int, port: int,
                   draft_path=None, device_args: tuple[str, ...] = ()) -> list[str]:
    """The server's command line for one arm; ``draft_path``: the draft model of a ``llama:draft``
    arm; ``device_args``: the run's device layout as llama-server's options (DeviceLayout.server_args)."""
    if spec.needs_draft != (draft_path is not None):
        raise ValueError(f"{spec.name}: a draft model path goes with, and only with, a llama:draft arm")
    return llama_server.server_command(binary, model_path, n_ctx, threads, port,
                                       spec.server_args() + list(device_args), draft_path)


def request_body(prompt: list[int], max_tokens: int, stream: bool = True, sampling: Sampling | None = None,
                 schema: dict | None = None) -> dict:
    """A /completion request for one reply: the prompt's exact token ids, no prompt cache; greedy,
    or with ``sampling`` llama.cpp's chain of the samplers ours has, in our order (top-k, top-p,
    min-p, temperature; top_k 0 is off in both) and the seed. The server draws with its own
    generator, so the text is another sample of the same distribution, not ours. ``schema``: the
    reply follows this JSON schema (the server turns ``json_schema`` into its GBNF grammar)."""
    body = {"prompt": list(prompt), "n_predict": max_tokens, "stream": stream, "cache_prompt": False,
            "temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "seed": 0, "repeat_penalty": 1.0,
            "return_tokens": True, "timings_per_token": stream}
    if sampling is not None:
        body.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    min_p=sampling.min_p, seed=sampling.seed if sampling.seed is not None else 0,
                    samplers=["top_k", "top_p", "min_p", "temperature"])
    if schema is not None:
        body["json_schema"] = schema
    return body


# --- the stream ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Streamed:
    """One streamed reply as the client saw it."""

    tokens: list[int] = field(default_factory=list)  # ids as streamed, end-of-generation left out
    text: str = ""
    deltas: list[tuple[int, float]] = field(default_factory=list)  # (tokens, arrival of its last event)
    generated: int = 0  # tokens the server generated, end-of-generation left out
    finish: str | None = None
    timings: dict | None = None
    ids_complete: bool = True  # False: the server held back a token's event (see the module doc)

    @property
    def tok_s(self) -> float | None:
        if len(self.deltas) < 2:
            return None
        span = self.deltas[-1][1] - self.deltas[0][1]
        return (sum(n for n, _ in self.deltas) - self.deltas[0][0]) / span if span > 0 else None

    def trace(self) -> list[tuple[int, float]]:
        """(tokens so far, seconds since the first delta) per delta, as compare's traces."""
        out, n = [], 0
        for k, t in self.deltas:
            n += k
            out.append((n, t - self.deltas[0][1]))
        return out


def finish_reason(final: dict) -> str:
    """Our finish reasons from the server's final event."""
    stop = final.get("stop_type")
    if stop in ("eos", "word"):
        return "stop"
    if stop == "limit":
        return "context" if final.get("truncated") else "length"
    raise InputError(f"llama-server ended a reply without a reason (stop_type {stop!r})")


def events(lines: Iterable[bytes]) -> Iterable[dict]:
    """The JSON objects of a server-sent-event stream (``data: {...}`` lines; comments, pings and
    other fields skipped). An error event is an InputError."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, ":" pings, "event:" names
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise InputError(f"llama-server sent a line that is not JSON: {payload[:80]!r}") from None
        if isinstance(obj, dict) and "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise InputError(f"llama-server: {' '.join(str(msg).split())}")  # one line
        yield obj


def read_stream(lines: Iterable[bytes], is_eog: Callable[[int], bool], clock=time.perf_counter) -> Streamed:
    """Read a streamed /completion reply, reading ``clock`` as each event arrives (module doc)."""
    out = Streamed()
    text: list[str] = []
    group_key = object()  # the current delta's predicted_ms; a fresh object matches nothing
    seen = 0  # the server's tokens_predicted so far (end-of-generation included)
    eog_seen = False
    for obj in events(lines):
        now = clock()
        if obj.get("stop") is True:  # the final event: stop reason and the server's totals
            out.finish = finish_reason(obj)
            out.timings = obj.get("timings")
            total = obj.get("tokens_predicted")
            if isinstance(total, int) and total > seen:
                # events held back at the end (a token ending inside a UTF-8 character, then the
                # end of generation, whose own event was then held back too): counted, not timed
                out.ids_complete = False
                out.generated += total - seen - (obj.get("stop_type") == "eos" and not eog_seen)
            break
        toks = obj.get("tokens") or []
        if not toks:
            continue  # a progress or begin event
        n_pred = obj.get("tokens_predicted")
        n_new = n_pred - seen if isinstance(n_pred, int) else len(toks)
        seen += n_new
        ids = [t for t in toks if not is_eog(t)]
        eog_seen = eog_seen or len(ids) < len(toks)
        if not ids:
            continue  # end-of-generation: not counted, not timed
        n_new -= len(toks) - len(ids)
        if n_new > len(ids):
            out.ids_complete = False
        out.tokens += ids
        text.append(obj.get("content", ""))
        out.generated += n_new
        timings = obj.get("timings") or {}
        key = timings.get("predicted_ms", object())  # no timings: every event is its own delta
        if out.deltas and key == group_key:
            n, _ = out.deltas[-1]
            out.deltas[-1] = (n + n_new, now)
        else:
            out.deltas.append((n_new, now))
        group_key = key
    if out.finish is None:
        raise InputError("llama-server's stream ended without its final event")
    out.text = "".join(text)
    return out


class LlamaServerArm:
    """A compare arm answered by llama.cpp's llama-server (module doc). Its server starts on the
    first reply and stops at ``close()``, which the compare command calls when the run ends."""

    def __init__(self, spec: str, model_path, n_ctx: int, threads: int | None, is_eog: Callable[[int], bool],
                 detokenize: Callable[[list[int]], str] | None = None, binary: str | os.PathLike | None = None,
                 sampling: Sampling | None = None, draft_path=None, device_args: tuple[str, ...] = ()):
        self.spec = parse_peer(spec)
        self.device_args = tuple(device_args)  # the run's device layout: the server's layers go where ours do
        self.sampling = sampling  # every reply sampled with these settings (request_body)
        self.name = self.spec.name
        if self.spec.needs_draft and draft_path is None:
            raise InputError(f"arm {self.name} runs llama.cpp's draft-model speculation on the compare run's "
                             f"draft model: give --drafter model:FILE")
        # the draft model of a llama:draft arm only: the other arms ignore the run's drafter
        self.draft_path = draft_path if self.spec.needs_draft else None
        self.binary = server_binary(binary)  # fail before the run, not at this arm's first reply
        self.model_path, self.n_ctx, self.threads = model_path, n_ctx, threads
        self.is_eog, self.detokenize = is_eog, detokenize
        self.server: LlamaServer | None = None
        self.last_timings: dict | None = None  # the server's own, of the last reply

    def command(self, port: int) -> list[str]:
        threads = self.threads
        if threads is None:
            from adaspark_core.engine.bindings import default_threads

            threads = default_threads()
        return server_command(self.binary, self.spec, self.model_path, self.n_ctx, threads, port, self.draft_path,
                              self.device_args)

    def _server(self) -> LlamaServer:
        if self.server is None or not self.server.alive():
            if self.server is not None:
                raise InputError(f"llama-server for {self.name} has died: {self.server.log_tail()}")
            port = free_port()
            self.server = LlamaServer(self.command(port), port, self.name)
            self.server.start()
        return self.server

    def _post(self, conn: http.client.HTTPConnection, server: LlamaServer, body: dict) -> http.client.HTTPResponse:
        try:
            conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except OSError as e:
            raise InputError(f"llama-server for {self.name} did not answer ({e}): {server.log_tail()}") from None
        if resp.status != 200:
            detail = " ".join(resp.read(2000).decode("utf-8", "replace").split())
            raise InputError(f"llama-server for {self.name} answered HTTP {resp.status}: {detail}")
        return resp

    def answer(self, prompt: list[int], max_tokens: int, request_id: str, clock=time.perf_counter,
               schema: dict | None = None):
        """One reply; under ``schema`` (a JSON schema) decoded under the server's grammar of it."""
        server = self._server()
        conn = http.client.HTTPConnection(HOST, server.port, timeout=REPLY_TIMEOUT_S)
        try:
            resp = self._post(conn, server, request_body(prompt, max_tokens, sampling=self.sampling, schema=schema))
            got = read_stream(iter(resp.readline, b""), self.is_eog, clock)
        except OSError as e:
            raise InputError(f"llama-server for {self.name} broke off a reply ({e}): {server.log_tail()}") from None
        finally:
            conn.close()
        tokens = got.tokens
        if not got.ids_complete:
            tokens = self._ids(server, prompt, max_tokens, got.generated, schema) or tokens
        self.last_timings = got.timings
        text = self.detokenize(tokens) if self.detokenize is not None else got.text
        return Answer(tokens, text, got.tok_s, got.finish, trace=[trace_point(n, t) for n, t in got.trace()] or None)

    def _ids(self, server: LlamaServer, prompt: list[int], max_tokens: int, expected: int,
             schema: dict | None) -> list[int] | None:
        """The reply's token ids from an untimed request without streaming (its final message carries
        them all), for a reply whose stream held one back; the same request, so the same reply, but
        for the server's speculation under a grammar, which can part at a near tie (a reply of 908
        tokens came back with 1,024): then None, and the reply keeps the ids its stream gave."""
        conn = http.client.HTTPConnection(HOST, server.port, timeout=REPLY_TIMEOUT_S)
        try:
            final = json.loads(self._post(conn, server, request_body(prompt, max_tokens, False, self.sampling,
                                                                     schema)).read())
        except OSError as e:
            raise InputError(f"llama-server for {self.name} broke off a reply ({e}): {server.log_tail()}") from None
        finally:
            conn.close()
        ids = [t for t in final.get("tokens") or [] if not self.is_eog(t)]
        return ids if len(ids) == expected else None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
