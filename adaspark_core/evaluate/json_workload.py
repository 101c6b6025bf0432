"""The JSON extraction workload: the test set's documents (earnings reports, LongBench documents,
Spec-Bench passages, ToolACE tool results) turned into structured-output requests, each a prompt
that quotes one document and an OpenAI ``response_format`` whose JSON Schema the reply must
follow, so adaspark, plain decoding and llama-server decode the same schemas under a grammar.
Built, not stored: the same test set gives the same requests."""

from __future__ import annotations

import re
from pathlib import Path

import orjson

from adaspark_core.evaluate.testset import SOURCE_ORDER, Conversation, default_dir, load_sources

SET_NAME = "jsonextract"
# A document is cut to this many UTF-8 bytes, not characters: a byte-level BPE spends at most a
# token a byte, so the document costs at most 6,000 tokens on any such model (some 1,500 for
# English), leaving room in the 8,192-token context the engine opens at most for the instruction,
# the schema and the reply. In characters, the meeting transcript's 6,000 Chinese ones were 10,217
# tokens of the default SmolLM2, past its context; cut at 6,000 bytes, its whole prompt is 3,605.
MAX_DOCUMENT_BYTES = 6000
# The caps that bound every reply: strings at most LONG characters (or an enum), lists at most
# ITEMS entries, so no schema lets a model run on.
LONG, ITEMS = 200, 8


def _string(max_length: int = LONG) -> dict:
    return {"type": "string", "maxLength": max_length}


def _list(items: dict, max_items: int = ITEMS) -> dict:
    return {"type": "array", "items": items, "maxItems": max_items}


def _object(**properties: dict) -> dict:
    """OpenAI's strict style: every property required, no others."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


_YEAR = {"type": "integer", "minimum": 1900, "maximum": 2100}
_NUMBER = {"type": "number"}

# name -> (instruction, schema). The instruction names the fields in words, as a person asking for
# them would; {what} is the kind of document, {question} the source's own question about it.
_TEMPLATES = {
    "financial_report": (
        "Extract the key figures of the {what} below as JSON: the company, the latest fiscal year it "
        "reports, up to 8 reported metrics with their year, value and unit, and a short answer to the "
        "question: {question}",
        _object(company=_string(80), fiscal_year=_YEAR,
                metrics=_list(_object(metric=_string(80), year=_YEAR, value=_NUMBER,
                                      unit=_enum("USD", "USD thousands", "USD millions", "USD billions",
                                                 "percent", "shares", "years", "other"))),
                answer=_string()),
    ),
    "financial_table": (
        "Extract the table in the {what} below as JSON: its column headers and up to 8 of its rows, each "
        "with its label and its cells as written.",
        _object(columns=_list(_string(40)), rows=_list(_object(label=_string(120), cells=_list(_string(40))))),
    ),
    "article": (
        "Extract from the {what} below as JSON: a title, a summary of at most 200 characters, and the "
        "people, organisations, places and dates it names (at most 8 of each).",
        _object(title=_string(120), summary=_string(), people=_list(_string(60)),
                organisations=_list(_string(100)), places=_list(_string(60)), dates=_list(_string(40))),
    ),
    "paper": (
        "Extract from the {what} below as JSON: its title, authors, institutions, the datasets and "
        "methods it uses (at most 8 of each), and a short answer to the question: {question}",
        _object(title=_string(), authors=_list(_string(60)), institutions=_list(_string(120)),
                datasets=_list(_string(80)), methods=_list(_string(80)), answer=_string()),
    ),
    "code": (
        "Extract the outline of the {what} below as JSON: its language, namespace or package, up to 8 "
        "imports, and up to 8 of the types it declares with up to 8 of their methods each.",
        _object(language=_enum("C#", "Java", "Python", "C", "C++", "JavaScript", "Go", "other"),
                namespace=_string(120), imports=_list(_string(100)),
                types=_list(_object(name=_string(80), kind=_enum("class", "interface", "enum", "struct"),
                                    methods=_list(_string(80))))),
    ),
    "meeting": (
        "Extract from the {what} below as JSON, writing in the transcript's language: its topic, the "
        "speakers with their roles, up to 5 key points, and a summary of at most 200 characters.",
        _object(topic=_string(120), speakers=_list(_object(speaker=_string(40), role=_string(80))),
                key_points=_list(_string(), 5), summary=_string()),
    ),
    "passages": (
        "Using only the {what} below, answer the question as JSON: a short answer, up to 5 supporting "
        "facts quoted from the passages, and up to 8 figures they give. Question: {question}",
        _object(answer=_string(), facts=_list(_string(), 5),
                figures=_list(_object(quantity=_string(80), value=_NUMBER, unit=_string(40)))),
    ),
}

# The sets and kinds whose first turn holds a document: (set, kind) -> (template names, what the
# document is, the text just before and just after it, and the text just before and just after
# the source's own question at the end of the turn, or None). The markers come from the sources'
# own task prompts: what lies outside them is that task, not the document. Not documents: wildchat
# and speedbench (chat and task prompts; its rag item is Spec-Bench's movie reviews, its
# summarisation a placeholder) and the rest of Spec-Bench. ToolACE's recorded tool results are
# documents of their own (_tool_requests).
_DOCUMENTS = {
    ("convfinqa", "finance"): (("financial_report", "financial_table"), "excerpt from a company's financial filing",
                               ("Context: ", "\nConversations:"), ("Question: ", "\nAnswer:")),
    ("longbench", "gov_report"): (("article",), "government report", ("Report:\n", "\n\nNow, write"), None),
    ("longbench", "qasper"): (("paper",), "scientific article", ("Article: ", "\n\n Answer the question"),
                              ("Question: ", "\n\nAnswer:")),
    ("longbench", "lcc"): (("code",), "source file", ("given below. \n", "Next line of code:"), None),
    ("longbench", "repobench-p"): (("code",), "source files", ("given below. \n", "Next line of code:"), None),
    ("longbench", "vcsum"): (("meeting",), "meeting transcript", ("会议记录：\n", "\n\n会议总结："), None),
    ("longbench", "multi_news"): (("article",), "news passages", ("News:\n", "\n\nNow, write"), None),
    ("specbench", "summarization"): (("article",), "news article", ("Summarize: ", None), None),
    # the passages, then the question on the last line
    ("specbench", "rag"): (("passages",), "retrieved passages", (None, "\n"), ("\n", None)),
}
# The sets that hold documents, in the test set's order.
_DOCUMENT_SETS = tuple(s for s in SOURCE_ORDER if s == "toolace" or any(k[0] == s for k in _DOCUMENTS))


def cut(text: str, limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The text, or its beginning of at most ``limit`` UTF-8 bytes ending at the last paragraph,
    line or sentence end in its second half (a boundary so the model sees no broken sentence; the
    second half so a far boundary does not waste the budget), else just the whole characters that
    fit."""
    data = text.encode()
    if len(data) <= limit:
        return text
    head = data[:limit].decode(errors="ignore")  # drops a character the limit splits
    for sep in ("\n\n", "\n", "。", ". ", "? ", "! "):
        i = head.rfind(sep)
        if i >= len(head) // 2:
            return head[: i + len(sep)].rstrip()
    return head


def _between(text: str, markers: tuple[str | None, str | None]) -> str:
    """The text after the first start marker and before the last end marker (None, or a marker
    the text lacks: the text's own start or end): the document, without the task around it."""
    start, end = markers
    i = text.find(start) + len(start) if start and start in text else 0
    j = text.rfind(end) if end and end in text[i:] else len(text)
    return text[i:j].strip()


def _question(text: str, markers: tuple[str, str | None]) -> str:
    """The text after the last start marker, up to the end marker after it (None: to the end): the
    question comes last, after a document that may hold the same marker."""
    start, end = markers
    after = text.rpartition(start)[2]
    return (after.partition(end)[0] if end else after).strip()


def _prompt(instruction: str, what: str, document: str, schema: dict) -> str:
    # The schema in the prompt too, as agents and OpenAI's examples do: models copy its key names.
    return (f"{instruction}\n\n{what[0].upper()}{what[1:]}:\n\"\"\"\n{cut(document)}\n\"\"\"\n\n"
            f"Reply with JSON matching this schema:\n{orjson.dumps(schema).decode()}")


def _request(name: str, kind: str, text: str, schema_name: str, schema: dict) -> Conversation:
    response_format = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": schema, "strict": True}}
    return Conversation(SET_NAME, name, kind, ({"kind": "extraction", "type": "first", "text": text},),
                        response_format=response_format)


def _document_requests(c: Conversation) -> list[Conversation]:
    templates, what, doc_markers, question_markers = _DOCUMENTS[(c.set, c.kind)]
    text = c.turns[0]["text"]
    document = _between(text, doc_markers)
    question = _question(text, question_markers) if question_markers else ""
    out = []
    for t in templates:
        instruction, schema = _TEMPLATES[t]
        prompt = _prompt(instruction.format(what=what, question=question), what, document, schema)
        out.append(_request(f"{c.name}-{t}", t, prompt, t, schema))
    return out


def result_schema(value) -> dict:
    """The strict schema of a tool result's fields, inferred from the recorded value: its keys
    required and no others, lists capped at ITEMS of the first entry's shape, strings at LONG."""
    if isinstance(value, dict):
        return _object(**{k: result_schema(v) for k, v in value.items()})
    if isinstance(value, list):
        return _list(result_schema(value[0]) if value else _string())
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return _NUMBER
    if value is None:
        return {"type": "null"}
    return _string()


def _tool_requests(c: Conversation) -> list[Conversation]:
    """One request per recorded tool result: pull its fields out of the returned JSON, as an agent
    does before acting on a result."""
    out = []
    for turn in c.turns:
        for call in orjson.loads(turn.get("result") or "[]"):
            instruction = (f"The tool {call['name']} was called for the request \"{turn['text']}\". Extract the "
                           "fields of its result below as JSON.")
            schema = result_schema(call["results"])
            prompt = _prompt(instruction, "tool result", orjson.dumps(call["results"]).decode(), schema)
            schema_name = re.sub(r"[^a-z0-9]+", "_", call["name"].lower()).strip("_")[:64] or "tool_result"
            out.append(_request(f"{c.name}-result{len(out) + 1}", "tool_result", prompt, schema_name, schema))
    return out


def extraction_set(conversations: list[Conversation]) -> list[Conversation]:
    """The extraction requests the documents of these conversations give, in their order; the
    conversations that hold no document give none."""
    out: list[Conversation] = []
    for c in conversations:
        if c.set == "toolace":
            out += _tool_requests(c)
        elif (c.set, c.kind) in _DOCUMENTS:
            out += _document_requests(c)
    return out


def load_json_workload(dir: Path | None = None) -> list[Conversation]:
    """The extraction requests of the test set in ``dir`` (default: testset.default_dir())."""
    return extraction_set(load_sources(list(_DOCUMENT_SETS), dir or default_dir()))
