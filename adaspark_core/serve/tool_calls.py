"""Tool calls as OpenAI's chat API has them (``tools``, ``tool_choice``, a reply's ``tool_calls``).

A model calls a tool by writing the call in its chat template's own format; which one is told by
the template (``format_of``), as llama-server's ``--jinja`` tells it:

- ``hermes`` (Qwen2.5, Hermes 2 and 3): ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``,
  one block per call;
- ``mistral``: ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``;
- ``llama3`` (Llama 3.1 to 3.3 JSON tool calling): the reply is ``{"name": N, "parameters": {...}}``,
  perhaps after ``<|python_tag|>``.

``tool_choice`` ``required`` or a named function starts the assistant's reply with the format's
opening, and the rest of the reply is decoded under the grammar of one call (``call_schema``: the
call object of one of the functions offered, or of the one named, its arguments following the
function's parameters), so even a small model writes a call that parses and follows its schema; the
closing markup is the server's (``ToolReply.suffix``). Pure functions: the model's template is
rendered by the engine, the grammar compiled by decode/grammar.py, and the HTTP layer streams what
``ToolStream`` lets out.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "function"


# Hermes-style models (Qwen2.5 among them) do not always write the template's ``<tool_call>``: a
# call may stand bare, in a fenced code block or in another tag; llama-server's Hermes parser takes
# all of these, and so does this one.
_FENCES = ("", "```\n", "```json\n", "```xml\n")
_TAGS = ("", "<tool_call>", "<function_call>", "<tool>", "<tools>", "<response>", "<json>", "<xml>", "<JSON>")
_FENCE = re.compile(r"```(?:json|xml)?\n")
_TAG = re.compile(r"<(tool_call|function_call|tool|tools|response|json|xml|JSON)>")
_WINDOW = 64  # characters a call's start is looked for in (its markup and ``{"name"``, spaced out)


def _canonical(s: str) -> str:
    """``s`` without the whitespace a call's start may hold (after a fence's newline)."""
    head = ""
    if s.startswith("```"):
        nl = s.find("\n")
        if nl < 0:
            return s
        head, s = s[: nl + 1], s[nl + 1:]
    return head + re.sub(r"\s+", "", s)


@dataclass(frozen=True)
class ToolFormat:
    """How a model's replies hold calls: ``starts`` are the ways a call may begin (without
    whitespace; nothing before the first call is a call), ``parse`` reads the calls from there on."""

    name: str
    starts: tuple[str, ...]
    args_key: str  # the call object's arguments field

    @property
    def opening(self) -> str:
        """The markup before a call's object (a required call's reply starts with it)."""
        return {"hermes": "<tool_call>\n", "mistral": "[TOOL_CALLS][", "llama3": ""}[self.name]

    @property
    def closing(self) -> str:
        """The markup after a lone call's object."""
        return {"hermes": "\n</tool_call>", "mistral": "]", "llama3": ""}[self.name]

    def value_start(self, text: str) -> int | None:
        """Where the JSON of the first call in ``text`` begins (past its markup), or None while no
        call has begun: under ``auto`` a lazy grammar holds the reply from there (``calls_schema``),
        as llama-server's does from the same openings."""
        at = self.call_start(text)
        if at < 0:
            return None
        return at + len("[TOOL_CALLS]") if self.name == "mistral" else text.index("{", at)

    def calls_schema(self, functions: list[dict]) -> dict:
        """The JSON schema of the value a call's opening begins: one call object (a list of them
        after Mistral's ``[TOOL_CALLS]``)."""
        one = self.call_schema(functions)
        return {"type": "array", "minItems": 1, "items": one} if self.name == "mistral" else one

    def call_schema(self, functions: list[dict]) -> dict:
        """The JSON schema of one call object of these functions (OpenAI's ``function`` dicts):
        the name one of theirs, the arguments that function's parameters."""
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", self.args_key],
                  "properties": {"name": {"const": f["name"]}, self.args_key: f.get("parameters") or {"type": "object"}}}
                 for f in functions]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def call_start(self, text: str, begin: int = 0, partial: bool = False) -> int:
        """Where the first call of ``text`` (from ``begin``) starts, or -1. ``partial``: also where
        the text ends in what may still become a call's start (a stream holds it back)."""
        firsts = {c[0] for c in self.starts}
        for p in range(begin, len(text)):
            if text[p] not in firsts:
                continue
            head = _canonical(text[p: p + _WINDOW])
            if any(head.startswith(c) for c in self.starts):
                return p
            if partial and p + _WINDOW >= len(text) and any(c.startswith(head) for c in self.starts):
                return p
        return -1

    def parse(self, text: str) -> list[dict] | None:
        """The calls ``text`` (from the first call's start on) holds, as (name, arguments object)
        dicts; None unless all of it is calls in this format."""
        if self.name == "hermes":
            objects = _hermes_objects(text)
        elif self.name == "mistral":
            body = _json(text.removeprefix("[TOOL_CALLS]"))
            objects = body if isinstance(body, list) and body else None
        else:
            objects = [_json(text.removeprefix("<|python_tag|>"))]
        calls = []
        for o in objects or [None]:
            if (not isinstance(o, dict) or set(o) != {"name", self.args_key} or not isinstance(o["name"], str)
                    or not isinstance(o[self.args_key], dict)):
                return None
            calls.append({"name": o["name"], "arguments": o[self.args_key]})
        return calls


def _hermes_objects(text: str) -> list | None:
    """The call objects of Hermes-style calls, each perhaps fenced and tagged (its tag closed,
    its fence closed), with only whitespace between them; None if anything else is there."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while True:
        pos = len(text) - len(text[pos:].lstrip())
        if pos == len(text):
            return out or None
        fence = _FENCE.match(text, pos)
        pos = fence.end() if fence else pos
        tag = _TAG.match(text, pos)
        pos = tag.end() if tag else pos
        try:
            obj, pos = decoder.raw_decode(text, len(text) - len(text[pos:].lstrip()))
        except ValueError:
            return None
        for close in ((f"</{tag.group(1)}>",) if tag else ()) + (("```",) if fence else ()):
            pos = len(text) - len(text[pos:].lstrip())
            if not text.startswith(close, pos):
                return None
            pos += len(close)
        out.append(obj)


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", tuple(f + t + '{"name"' for f in _FENCES for t in _TAGS), "arguments"),
    ToolFormat("mistral", ("[TOOL_CALLS]",), "arguments"),
    ToolFormat("llama3", ('{"name"', '<|python_tag|>{"name"'), "parameters"))}


def format_of(template: str) -> ToolFormat | None:
    """The tool-call format a chat template asks its model for, by the markup it shows the model
    (None: one this server does not read)."""
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or '"parameters"' in template:
        return FORMATS["llama3"]
    return None


def _json(text: str):
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


# --- what a request offers ----------------------------------------------------------------------

@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (as the template takes them) and its choice: ``none``, ``auto``,
    ``required`` or ``function``, the one named ``forced``."""

    tools: list[dict] = field(default_factory=list)
    choice: str = NONE
    forced: str | None = None  # the function a named choice forces

    @property
    def on(self) -> bool:
        return bool(self.tools) and self.choice != NONE


class ToolError(ValueError):
    """A request's tools or tool choice that cannot be taken: ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def read_tools(tools, tool_choice) -> ToolRequest:
    """``tools`` and ``tool_choice`` of a request, checked; ToolError naming the first thing wrong."""
    if tools is None or tools == []:
        if tool_choice not in (None, NONE, AUTO):
            raise ToolError("tool_choice", "tool_choice asks for a tool call, and the request has no tools")
        return ToolRequest()
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of functions")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) or set(t) != {"type", "function"}:
            raise ToolError("tools", f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise ToolError("tools", f"tools.{i}.function.name must be 1-64 letters, digits, _ . or -")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolError("tools", f"tools.{i}.function.{unknown[0]} is not a field of a function")
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolError("tools", f"tools.{i}.function.description must be text")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ToolError("tools", f"tools.{i}.function.parameters must be a JSON schema object")
        if fn["name"] in names:
            raise ToolError("tools", f"tools.{i}: a second function named {fn['name']}")
        names.append(fn["name"])
    forced = None
    if tool_choice is None:
        choice = AUTO
    elif tool_choice in (NONE, AUTO, REQUIRED):
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str)):
        choice, forced = NAMED, tool_choice["function"]["name"]
        if forced not in names:
            raise ToolError("tool_choice", f"tool_choice names {forced}, which is not one of the tools")
    else:
        raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    return ToolRequest(tools, choice, forced)


@dataclass(frozen=True)
class ToolReply:
    """How one reply's calls are read back: the model's format, what the reply was started with
    (a required call's opening, part of the call's text) and what closes it (a required call's
    closing, which its grammar leaves to the server), and whether it may hold several calls."""

    fmt: ToolFormat
    prefix: str = ""
    parallel: bool = True
    suffix: str = ""

    def split(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) of the whole reply (``split_reply``); one call at most unless parallel."""
        content, calls = split_reply(self.prefix + text + self.suffix, self.fmt)
        if not calls:
            return self.prefix + text, []
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> "ToolStream":
        return ToolStream(self.fmt, self.prefix, self.parallel, self.suffix)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its prompt and reply: the tools the template shows, the
    text the reply starts with, how its calls are read back (None: the reply is text) and the
    schema of its calls: without ``opens``, of the one call the reply must be (``required``, a
    named function); with it (``auto``), of each call's JSON, which begins where ``opens`` finds it
    in the reply's text (a lazy grammar, decode/grammar.LazyGrammar, as llama-server's for ``auto``)."""

    tools: list[dict] | None = None
    reply_start: str = ""
    reply: ToolReply | None = None
    call_schema: dict | None = None
    opens: Callable[[str], int | None] | None = None


def prepare(request: ToolRequest, model, parallel: bool = True) -> ToolPlan:
    """The ``ToolPlan`` of a chat request's tools on ``model`` (its chat template). ToolError if
    the template shows no tools or calls them in a format this server does not read."""
    if not request.on:
        return ToolPlan()
    name = getattr(model, "path", None)
    name = getattr(name, "name", "the model")
    if not model.takes_tools():
        raise ToolError("tools", f"the chat template of {name} takes no tools (give one that does: --chat-template-file)")
    fmt = format_of(model.chat_template)
    if fmt is None:
        raise ToolError("tools", f"the chat template of {name} calls tools in a format this server does not read "
                        f"(it reads {', '.join(FORMATS)})")
    if request.choice == AUTO:
        functions = [t["function"] for t in request.tools]
        return ToolPlan(request.tools, "", ToolReply(fmt, "", parallel), fmt.calls_schema(functions), fmt.value_start)
    functions = [t["function"] for t in request.tools if request.forced in (None, t["function"]["name"])]
    return ToolPlan(request.tools, fmt.opening, ToolReply(fmt, fmt.opening, parallel, fmt.closing),
                    fmt.call_schema(functions))


# --- the calls in a reply -----------------------------------------------------------------------

def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def openai_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as a response's ``tool_calls``: arguments as JSON text, each with an id."""
    return [{"id": call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def split_reply(text: str, fmt: ToolFormat) -> tuple[str, list[dict]]:
    """(content, calls) of a whole reply: the calls from the first call's start on, if what follows
    is all calls; else the whole text is content and there are no calls."""
    at = fmt.call_start(text)
    if at < 0:
        return text, []
    calls = fmt.parse(text[at:])
    if calls is None:
        return text, []
    return text[:at].rstrip(), calls


def openai_reply(text: str, fmt: ToolFormat) -> tuple[str, list[dict]]:
    """(content, OpenAI ``tool_calls``) of a whole reply, as a non-streamed response has them."""
    content, calls = split_reply(text, fmt)
    return content, openai_calls(calls)


class ToolStream:
    """A streamed reply's text held back where a call may begin: ``feed`` returns the content that
    can go out now (never the start of a call, nor what may still become one), ``finish`` the rest
    of the content and the calls, read as ``split_reply`` reads the whole reply."""

    def __init__(self, fmt: ToolFormat, prefix: str = "", parallel: bool = True, suffix: str = ""):
        self.fmt, self.parallel, self.suffix = fmt, parallel, suffix
        self.text = prefix  # the reply so far (with what a required call started it with)
        self.sent = 0  # characters of it already out as content

    def feed(self, piece: str) -> str:
        self.text += piece
        at = self.fmt.call_start(self.text, self.sent, partial=True)
        end = len(self.text) if at < 0 else at
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = split_reply(self.text + self.suffix, self.fmt)
        if not calls:
            return self.text[self.sent:], []
        return content[self.sent:], calls if self.parallel else calls[:1]
