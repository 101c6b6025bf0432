"""The request format of ``adaspark serve-stdin``: one JSON object per line.

    {"id": "a1", "prompt": "raw text", "max_tokens": 64}
    {"id": 7, "messages": [{"role": "user", "content": "..."}, ...], "stream": true}

``id`` (a string or an integer) is echoed on every response line; ``prompt`` is sent as is,
``messages`` through the model's chat template (a multi-turn conversation carries its own
history: the client feeds each reply back as an assistant message); exactly one of the two.
``max_tokens`` (default: the server's) caps the reply; ``stream`` asks for one line per delta
before the final line; ``stop`` (a string or a list) cuts the reply before the first stop string;
``temperature`` (default 0: greedy), ``top_k``, ``top_p``, ``min_p`` and ``seed`` sample it
(adaspark_core/base/sampling.py). Any other field is refused, so a misspelt option is not silently
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from adaspark_core.base import sampling
from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.grammar import ANY_OBJECT

FIELDS = ("id", "prompt", "messages", "max_tokens", "stream", "stop", "json_schema", *sampling.FIELDS)
ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
MAX_ID_CHARS = 200
# The most a request may ask for as its reply's cap: the context ends every reply long before,
# and past 2^31 the number is not a count (llama.cpp's n_predict is a 32-bit integer).
MAX_TOKENS = (1 << 31) - 1


class RequestError(ValueError):
    """A request the server cannot serve; ``id`` is the request's id when it could be read."""

    def __init__(self, message: str, id: str | int | None = None):
        super().__init__(message)
        self.id = id


@dataclass(frozen=True, slots=True)
class Request:
    id: str | int | None
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    stream: bool
    stops: tuple[str, ...] = ()
    sampling: Sampling | None = None  # None: greedy
    json_schema: dict | None = None  # the reply is JSON under its grammar (decode/grammar.py); None: text

    @property
    def name(self) -> str:
        """The request's name in the round log."""
        return str(self.id)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(line: bytes | str, default_max_tokens: int, number: int) -> Request:
    """The request on one input line; RequestError naming what is wrong. ``number``: the line's
    request number, the id of a request that has none."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"not a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"a request is a JSON object, not {type(obj).__name__}")
    rid = obj.get("id", f"req-{number}")
    if not (isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS or _is_int(rid)):
        raise RequestError(f"id must be a non-empty string of at most {MAX_ID_CHARS} characters or an integer")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                           f"(a request has {', '.join(FIELDS)})", rid)
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("a request has either a prompt or messages", rid)
    if prompt is not None and not (isinstance(prompt, str) and prompt.strip()):
        raise RequestError("prompt must be non-empty text", rid)
    if messages is not None:
        try:
            messages = normalize_messages(messages)
        except ValueError as e:
            raise RequestError(str(e), rid) from None
    try:
        max_tokens = reply_cap("max_tokens", obj.get("max_tokens", default_max_tokens))
    except ValueError as e:
        raise RequestError(str(e), rid) from None
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", rid)
    try:
        stops = stop_strings(obj.get("stop"))
        how = sampling.from_fields(obj)
    except ValueError as e:
        raise RequestError(str(e), rid) from None
    schema = obj.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise RequestError("json_schema must be a JSON schema object ({} for any object)", rid)
    return Request(rid, prompt, messages, max_tokens, stream, stops, how, None if schema is None else schema or ANY_OBJECT)


def reply_cap(name: str, v) -> int:
    """``v``, the field ``name``, as a reply's cap in tokens; ValueError saying which bound it
    breaks. (A JSON integer past 64 bits reaches here as a float: it is too large, not "not an
    integer".)"""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v > MAX_TOKENS:
            raise ValueError(f"{name} must be at most {MAX_TOKENS}")
        if v < 1:
            raise ValueError(f"{name} must be at least 1")
    if not _is_int(v):
        raise ValueError(f"{name} must be an integer from 1 to {MAX_TOKENS}")
    return v


MAX_STOPS = 16


def stop_strings(v) -> tuple[str, ...]:
    """A request's ``stop``: a string or a list of them (None: none); ValueError otherwise."""
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(x, str) and x for x in stops):
        raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return tuple(stops)


def normalize_messages(messages) -> list[dict]:
    """Chat messages as the chat template takes them: {role, content[, name]} with text content.
    Content may also be a list of text parts ({"type": "text", "text": ...}), as OpenAI's API
    sends it; they are joined. An assistant message may carry ``tool_calls`` (then its content may
    be null), each call's arguments JSON text made the object templates render; a tool message
    its ``tool_call_id``. ValueError naming the first thing wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be an object with role and content")
        role = m.get("role")
        role = ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES + tuple(ALIASES))}")
        own = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
        extra = sorted(set(m) - {"role", "content", "name"} - own)
        if extra:
            raise ValueError(f"message {i}: field {extra[0]} is not supported in a {role} message")
        content = m.get("content")
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2
                for p in content):
            content = "".join(p["text"] for p in content)
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be text or a list of text parts")
        if "name" in m and not isinstance(m["name"], str):
            raise ValueError(f"message {i}: name must be text")
        if "tool_call_id" in m and not isinstance(m["tool_call_id"], str):
            raise ValueError(f"message {i}: tool_call_id must be text")
        norm = {**m, "role": role, "content": content}
        if "tool_calls" in m:
            norm["tool_calls"] = _calls(m["tool_calls"], i)
        out.append(norm)
    return out


def _calls(calls, i: int) -> list[dict]:
    """An assistant message's tool calls as templates render them: arguments an object (OpenAI
    sends them as JSON text; Qwen's and Hermes' templates write them with ``tojson``)."""
    if not isinstance(calls, list):
        raise ValueError(f"message {i}: tool_calls must be a list")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ValueError(f"message {i}: tool_calls.{k} must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": \"JSON text\"}}")
        try:
            arguments = orjson.loads(fn["arguments"])
        except orjson.JSONDecodeError:
            raise ValueError(f"message {i}: tool_calls.{k}.function.arguments is not JSON text") from None
        out.append({**c, "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out
