"""OpenAI's completion API as ``adaspark serve`` speaks it: requests read and checked, responses
and stream chunks shaped, errors in OpenAI's form. Pure functions; the HTTP layer is
serve/http_app.py.

A request field AdaSpark does not know is refused (400), and so is a known OpenAI field at a
value it cannot honour (``n`` > 1, penalties, logprobs): a client is never answered as if its
option had been applied. ``tools`` and ``tool_choice`` go through the model's chat template, and
the calls the model writes come back as ``tool_calls`` (serve/tool_calls.py). ``response_format``
``json_object`` and ``json_schema`` decode the reply under the schema's grammar
(decode/grammar.py): it is compact JSON that follows the schema, unless the token cap cuts it
(finish_reason "length"). Extensions of llama.cpp's servers are taken too: ``top_k``, ``min_p``.

Decoding: ``temperature`` 0 (the server's default when a request sets none, ``--temperature``)
is greedy and speculative; above 0 the request is sampled, also speculatively, by draws keyed by
its ``seed`` and the position (adaspark_core/base/sampling.py), and its ``adaspark`` field says so. ``max_tokens`` unset: a chat reply runs to its end token or
the context; a completion stops at 16 tokens, OpenAI's default.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

import orjson

from adaspark_core.base import sampling
from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.grammar import ANY_OBJECT
from adaspark_core.serve.service import INTERRUPTED, Reply
from adaspark_core.serve.stdin_api import normalize_messages, reply_cap, stop_strings
from adaspark_core.serve.tool_calls import ToolError, ToolRequest, openai_calls, read_tools

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
EXTENSION = "adaspark"  # the response field with AdaSpark's own statistics

# What a finished reply's finish becomes in OpenAI's vocabulary: a full context is a length stop,
# as OpenAI reports it; a reply cut short by shutdown or a departed client says so.
FINISH_REASON = {"stop": "stop", "length": "length", "context": "length", INTERRUPTED: INTERRUPTED}


class APIError(Exception):
    """A request answered with an OpenAI-shaped error: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    messages: list[dict] | None
    prompt: str | list[int] | None  # text, or token ids
    max_tokens: int | None  # None: to the end token or the context
    stops: tuple[str, ...]
    sampling: Sampling | None  # None: greedy (speculative)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    tools: ToolRequest = ToolRequest()  # the functions the model may call, and the choice
    parallel_tool_calls: bool = True  # false: at most one call a reply
    json_schema: dict | None = None  # response_format's: the reply is JSON under its grammar; None: text


# --- reading a request ----------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reply_cap(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    try:
        return reply_cap(name, v)
    except ValueError as e:
        raise bad(name, str(e)) from None


def _neutral(body: dict, name: str, allowed: tuple, why: str) -> None:
    """An OpenAI field AdaSpark takes only at a value that asks for nothing it cannot do."""
    v = body.get(name)
    if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
        raise bad(name, f"{name} {orjson.dumps(v).decode()[:40]} is not supported: {why}")


COMMON = {"model", "max_tokens", "stop", "seed", "temperature", "top_p", "top_k", "min_p", "stream",
          "stream_options", "n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "user"}
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "store", "metadata"}
COMPLETION_ONLY = {"prompt", "echo", "suffix", "best_of"}


def parse(raw: bytes, chat: bool, default_temperature: float = 0.0) -> CompletionRequest:
    """A request body of /v1/chat/completions (``chat``) or /v1/completions; APIError (400)
    naming the first field that is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(body).__name__}")
    known = COMMON | (CHAT_ONLY if chat else COMPLETION_ONLY)
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(unknown[0], f"unknown field {unknown[0]} (this endpoint takes {', '.join(sorted(known))})",
                  code="unknown_field")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", "model must be text")
    _neutral(body, "n", (1,), "one choice per request")
    _neutral(body, "presence_penalty", (0, 0.0), "no repetition penalties")
    _neutral(body, "frequency_penalty", (0, 0.0), "no repetition penalties")
    _neutral(body, "logit_bias", ({},), "no logit bias")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "user must be text")
    if chat:
        _neutral(body, "logprobs", (False,), "no log probabilities")
        _neutral(body, "top_logprobs", (0,), "no log probabilities")
        json_schema = _response_format(body.get("response_format"))
        try:
            tools = read_tools(body.get("tools"), body.get("tool_choice"))
        except ToolError as e:
            raise bad(e.param, str(e)) from None
        if json_schema is not None and tools.on:
            raise bad("response_format", "response_format JSON with tools is not supported: a reply is either "
                                         "tool calls or JSON (use tool_choice none, or no response_format)")
        if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
            raise bad("parallel_tool_calls", "parallel_tool_calls must be true or false")
        _neutral(body, "store", (False,), "nothing is stored")
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise bad("metadata", "metadata must be an object")
        try:
            messages = normalize_messages(body.get("messages"))
        except ValueError as e:
            raise bad("messages", str(e)) from None
        prompt = None
        max_tokens = _reply_cap(body, "max_completion_tokens", None)
        max_tokens = _reply_cap(body, "max_tokens", max_tokens)
    else:
        _neutral(body, "logprobs", (0,), "no log probabilities")
        _neutral(body, "echo", (False,), "the reply alone is returned")
        _neutral(body, "suffix", ("",), "no insertion")
        _neutral(body, "best_of", (1,), "one candidate per request")
        messages, tools, json_schema = None, ToolRequest(), None
        prompt = _prompt(body.get("prompt"))
        max_tokens = _reply_cap(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    return CompletionRequest(chat, messages, prompt, max_tokens, _stops(body.get("stop")),
                             _sampling(body, default_temperature), bool(stream), _include_usage(body), tools,
                             body.get("parallel_tool_calls") is not False, json_schema)


_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _response_format(v) -> dict | None:
    """The JSON schema OpenAI's ``response_format`` asks the reply to follow (None: text):
    {"type": "text"}, {"type": "json_object"} (any object; with llama.cpp's extension, a
    ``schema`` beside it) or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}}. A schema is compiled later, on the model's vocabulary (a schema the grammar
    engine refuses is a 400 then)."""
    if v is None:
        return None
    where = "response_format"
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise bad(where, 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                         '{"type": "json_schema", "json_schema": {...}}')
    kind = v["type"]
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}[kind]
    if extra := sorted(set(v) - allowed):
        raise bad(where, f"response_format of type {kind} has no field {extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = v.get("schema")
    else:
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise bad(where, "response_format.json_schema must be an object with a name and a schema")
        if extra := sorted(set(spec) - {"name", "schema", "strict", "description"}):
            raise bad(where, f"response_format.json_schema has no field {extra[0]}")
        if not isinstance(spec.get("name"), str) or not _SCHEMA_NAME.fullmatch(spec["name"]):
            raise bad(where, "response_format.json_schema.name must be 1-64 letters, digits, _ or -")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise bad(where, "response_format.json_schema.strict must be true or false")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise bad(where, "response_format.json_schema.description must be text")
        schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise bad(where, "the response_format's schema must be a JSON object")
    return schema or ANY_OBJECT


def _prompt(v) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
        v = v[0]  # one prompt in a batch of one
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(_is_int(t) and t >= 0 for t in v):
        return v
    if isinstance(v, list) and len(v) > 1:
        raise bad("prompt", "one prompt per request (send several requests)")
    raise bad("prompt", "prompt must be non-empty text or a list of token ids")


def _stops(v) -> tuple[str, ...]:
    try:
        return stop_strings(v)
    except ValueError as e:
        raise bad("stop", str(e)) from None


def _sampling(body: dict, default_temperature: float) -> Sampling | None:
    try:
        return sampling.from_fields(body, default_temperature)
    except sampling.FieldError as e:
        raise bad(e.field, str(e)) from None


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not body.get("stream"):
        raise bad("stream_options", "stream_options is only for stream: true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(opts.get("include_usage", False), bool):
        raise bad("stream_options", "stream_options takes include_usage (true or false)")
    return opts.get("include_usage", False)


# --- writing a response ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> "Envelope":
        return cls(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), model, chat)

    def _wrap(self, choice: dict, stream: bool, **extra) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice] if choice is not None else [], **extra}

    def response(self, reply: Reply, calls: list[dict] | None = None, content: str | None = None) -> dict:
        """The whole reply in one response. ``content``: the reply's text as the client sees it
        where it is not ``reply.text`` (a reply that may call tools: the text before its
        ``calls``, null if none, with the finish ``tool_calls``)."""
        finish = FINISH_REASON[reply.finish]
        text = reply.text if content is None else content
        if self.chat and calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": openai_calls(calls)}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": reply.text, "logprobs": None, "finish_reason": finish}
        return self._wrap(choice, False, usage=usage(reply), **{EXTENSION: extension(reply)})

    def chunk(self, text: str, first: bool = False) -> dict:
        """A streamed piece of the reply (the first chat chunk also carries the role)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return self._wrap(choice, True)

    def calls_chunk(self, calls: list[dict], first: bool = False) -> dict:
        """The tool calls of a streamed reply, each whole in one delta (index, id, name, arguments)."""
        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(openai_calls(calls))]}
        if first:
            delta = {"role": "assistant", "content": None, **delta}
        return self._wrap({"index": 0, "delta": delta, "finish_reason": None}, True)

    def last_chunk(self, reply: Reply, called: bool = False) -> dict:
        """The chunk that ends a stream: the finish reason (``called``: tool_calls) and AdaSpark's
        statistics."""
        finish = "tool_calls" if called else FINISH_REASON[reply.finish]
        choice = ({"index": 0, "delta": {}, "finish_reason": finish} if self.chat else
                  {"index": 0, "text": "", "logprobs": None, "finish_reason": finish})
        return self._wrap(choice, True, **{EXTENSION: extension(reply)})

    def usage_chunk(self, reply: Reply) -> dict:
        """stream_options.include_usage: one more chunk, with no choices and the usage."""
        return self._wrap(None, True, usage=usage(reply))


def usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.stats.generated,
            "total_tokens": reply.prompt_tokens + reply.stats.generated}


def extension(reply: Reply) -> dict:
    return {"finish": reply.finish, **reply.stats_json()}
