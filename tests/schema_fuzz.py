"""Seeded JSON Schemas for the structured-output fuzz (response_format json_schema), and their checks.

`schemas(n, seed)` returns n distinct schemas of the kind agents and OpenAI's strict structured outputs
send: the root is an object; properties are strings (plain with maxLength, enum, a simple anchored
pattern, format date), integers, numbers, booleans, null, const, nullable types (["string", "null"]),
anyOf of two types, nested objects (up to depth 3, the root being depth 1) and arrays of any of those
but null and const (with maxItems, some with minItems). Some objects require every property, some only
a few; every object has additionalProperties false. Names come from pools of realistic words per kind
(price is a number, tags an array), so a model can write them. `features(schema)` names what a schema
uses (FEATURES lists them all), for the coverage test.

Every schema bounds the length of every valid instance, so a small model decoding under the schema's
grammar cannot write forever: a string has a maxLength <= 40, or is an enum, a const, a date or a
pattern of bounded length; an array has a maxItems <= 4; an object has additionalProperties false. Numbers
need more than the keywords one would expect, because llguidance lets a model write digits without
end: an integer without minimum and maximum (1111...), a number even with them (0.1111...). So every
integer has a minimum and a maximum, and every number also a multipleOf 0.5, which stops its decimals
at one digit. 0.5 and not 0.01 because jsonschema checks a float multipleOf in floats (0.07 / 0.01 is
not a whole number, so it rejects 0.07 while the grammar accepts it); halves are exact in floats.
`max_chars(schema)` is the length of the longest compact instance (string characters counted once
each, as for text that needs no escapes); the generator keeps it <= MAX_CHARS. A token holds at least
one character of ASCII text, so max_chars also bounds the tokens of an ASCII reply. Written with
words, the longest instances of schemas(240) take 130 (Qwen2.5) to 151 (SmolLM2) tokens at most,
~40 at the median.

What llguidance (1.9.1, whitespace_flexible False) does that the generator follows:
- it writes an object's properties in the schema's order, so examples keep that order;
- it ignores no keyword silently: an unimplemented one (propertyNames) is a grammar error, and the
  tests require every schema to compile without errors or warnings, so nothing is filtered here;
- format date is enforced as a calendar date (2024-02-30 is rejected), as jsonschema's format checker
  does, which `validate` turns on;
- a decimal multipleOf fixes the fraction digits in its own way: with 0.25, 0.5 is rejected (only
  0.50 passes); with 0.5, 1.0 and 2.5 pass, which is what json.dumps writes for halves.
"""

import json
import random
import string
from datetime import date, timedelta

from jsonschema import Draft202012Validator

MAX_CHARS = 400  # the longest compact instance of any schema, in characters (see the module's text)

# The pools: a name and what a model would expect under it.
STRINGS = ["name", "city", "title", "country", "author", "email", "company", "comment", "street", "summary",
           "description", "language"]
MAX_LENGTHS = [8, 12, 16, 20, 24, 32, 40]
ENUMS = {"status": ["open", "closed", "pending", "archived"], "color": ["red", "green", "blue", "black"],
         "size": ["S", "M", "L", "XL"], "priority": ["low", "medium", "high"], "unit": ["kg", "lb", "g"],
         "currency": ["USD", "EUR", "GBP", "JPY"], "level": ["beginner", "intermediate", "expert"],
         "weekday": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}
# name: (pattern, the length of its longest match, a matching string from a random.Random)
PATTERNS = {
    "code": ("^[A-Z]{2}-[0-9]{3}$", 6,
             lambda r: "".join(r.choices(string.ascii_uppercase, k=2)) + "-" + "".join(r.choices(string.digits, k=3))),
    "zip": ("^[0-9]{5}$", 5, lambda r: "".join(r.choices(string.digits, k=5))),
    "hex": ("^#[0-9a-f]{6}$", 7, lambda r: "#" + "".join(r.choices("0123456789abcdef", k=6))),
    "sku": ("^[A-Z]{3}[0-9]{4}$", 7,
            lambda r: "".join(r.choices(string.ascii_uppercase, k=3)) + "".join(r.choices(string.digits, k=4))),
    "username": ("^[a-z][a-z0-9_]{2,11}$", 12, lambda r: r.choice(string.ascii_lowercase)
                 + "".join(r.choices(string.ascii_lowercase + string.digits + "_", k=r.randint(2, 11)))),
    "phone": ("^\\+[0-9]{8,12}$", 13, lambda r: "+" + "".join(r.choices(string.digits, k=r.randint(8, 12)))),
}
DATES = ["date", "birthday", "due", "start", "end", "published", "deadline"]
INTEGERS = {"age": (0, 120), "year": (1900, 2100), "count": (0, 1000), "quantity": (1, 99), "rating": (1, 5),
            "population": (0, 10_000_000), "floor": (-3, 200), "temperature": (-60, 60), "pages": (1, 5000)}
NUMBERS = {"price": (0, 10_000), "weight": (0, 500), "score": (0, 100), "latitude": (-90, 90),
           "longitude": (-180, 180), "distance": (0, 1000), "height": (0, 300), "discount": (0, 100)}
BOOLEANS = ["active", "verified", "available", "done", "public", "paid", "urgent"]
NULLS = ["reserved", "placeholder"]
CONSTS = {"version": 2, "kind": "record", "schema": "v1", "source": "api", "currency": "EUR"}
ANY_OFS = ["value", "answer", "result", "reference", "amount", "key"]
OBJECTS = ["address", "owner", "location", "details", "settings", "contact", "metadata", "customer", "dimensions"]
ARRAYS = ["tags", "items", "values", "entries", "results", "options", "records", "steps", "members", "events"]

# The kinds of property, with how often the generator picks each; an array's items are any but null and const.
KINDS = {"string": 3, "enum": 2, "pattern": 1, "date": 1, "integer": 2, "number": 2, "boolean": 2, "null": 0.5,
         "const": 1, "nullable": 1.5, "anyOf": 1, "object": 1.5, "array": 2}
ITEM_KINDS = [k for k in KINDS if k not in ("null", "const", "array")]
SCALARS = {"string": STRINGS, "integer": INTEGERS, "number": NUMBERS, "boolean": BOOLEANS}  # nullable and anyOf
NAMES = {"string": STRINGS, "enum": list(ENUMS), "pattern": list(PATTERNS), "date": DATES, "integer": list(INTEGERS),
         "number": list(NUMBERS), "boolean": BOOLEANS, "null": NULLS, "const": list(CONSTS),
         "nullable": [name for pool in SCALARS.values() for name in pool], "anyOf": ANY_OFS, "object": OBJECTS,
         "array": ARRAYS}
MAX_DEPTH = 3
FEATURES = ([*KINDS] + [f"array of {k}" for k in ITEM_KINDS]
            + [f"object depth {MAX_DEPTH}", "minItems", "required all", "required some", "additionalProperties false"])


def schemas(n: int, seed: int = 0) -> list[dict]:
    """n distinct schemas, the same for the same seed; schemas(k, seed) is a prefix of schemas(n, seed), k < n."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        schema = _object(rng, depth=1, room=MAX_CHARS, n_props=rng.randint(2, 7))
        if schema is None:  # no property fitted: most unlikely at the root
            continue
        key = json.dumps(schema, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(schema)
    return out


def _object(rng: random.Random, depth: int, room: int, n_props: int) -> dict | None:
    """An object of up to n_props properties whose longest instance fits in room characters, or None."""
    props: dict[str, dict] = {}
    room -= 2  # the braces
    for _ in range(n_props):
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        names = [name for name in NAMES[kind] if name not in props]
        if not names:
            continue
        name = rng.choice(names)
        key_chars = len(json.dumps(name)) + 1 + (1 if props else 0)  # "name": and the comma before it
        value = _value(rng, kind, depth, room - key_chars, name)
        if value is not None:
            props[name] = value
            room -= key_chars + max_chars(value)
    if not props:
        return None
    required = [name for name in props if rng.random() < 0.5] if rng.random() < 0.5 else list(props)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, kind: str, depth: int, room: int, name: str | None = None) -> dict | None:
    """A schema of this kind whose longest instance fits in room characters, or None. The name (a random
    one of the kind's pool if None) picks the enum values, range or pattern."""
    name = name or rng.choice(NAMES[kind])
    if kind == "string":
        schema = {"type": "string", "maxLength": min(rng.choice(MAX_LENGTHS), room - 2)}
        if schema["maxLength"] < 4:
            return None
    elif kind == "enum":
        values = ENUMS[name]
        schema = {"type": "string", "enum": sorted(rng.sample(values, rng.randint(2, len(values))), key=values.index)}
    elif kind == "pattern":
        schema = {"type": "string", "pattern": PATTERNS[name][0]}
    elif kind == "date":
        schema = {"type": "string", "format": "date"}
    elif kind in ("integer", "number"):
        low, high = (INTEGERS if kind == "integer" else NUMBERS)[name]
        schema = {"type": kind, "minimum": low, "maximum": high}
        if kind == "number":
            schema["multipleOf"] = 0.5
    elif kind in ("boolean", "null"):
        schema = {"type": kind}
    elif kind == "const":
        schema = {"const": CONSTS[name]}
    elif kind == "nullable":
        base = next(k for k, pool in SCALARS.items() if name in pool)
        schema = _value(rng, base, depth, room, name)
        if schema is None:
            return None
        schema["type"] = [base, "null"]
    elif kind == "anyOf":
        branches = [_value(rng, k, depth, room) for k in rng.sample([*SCALARS, "null"], 2)]
        if None in branches:
            return None
        schema = {"anyOf": branches}
    elif kind == "object":
        if depth == MAX_DEPTH:
            return None
        schema = _object(rng, depth + 1, min(room, rng.randint(40, 160)), n_props=rng.randint(1, 4))
    else:  # array
        item_kind = rng.choice([k for k in ITEM_KINDS if k != "object" or depth < MAX_DEPTH])
        schema = None
        for max_items in range(rng.randint(1, 4), 0, -1):
            # 2 brackets + max_items items + (max_items - 1) commas <= room
            items = _value(rng, item_kind, depth, (room - 1) // max_items - 1)
            if items is not None:
                schema = {"type": "array", "items": items, "maxItems": max_items}
                if rng.random() < 0.4:
                    schema["minItems"] = rng.randint(1, max_items)
                break
    return schema if schema is not None and max_chars(schema) <= room else None


def max_chars(schema: dict) -> int:
    """The length of the longest compact JSON instance of a schema from this generator, each string
    character counted once (a character that needs an escape, like a quote, takes 2 or 6)."""
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    if "anyOf" in schema:
        return max(max_chars(branch) for branch in schema["anyOf"])
    if isinstance(schema["type"], list):  # nullable: the base type or null
        return max(max_chars({**schema, "type": t}) for t in schema["type"])
    kind = schema["type"]
    if kind == "string":
        if "pattern" in schema:
            return 2 + next(longest for pattern, longest, _ in PATTERNS.values() if pattern == schema["pattern"])
        return 2 + (len("2024-01-01") if "format" in schema else schema["maxLength"])
    if kind in ("integer", "number"):  # no leading zeros; a number may add ".5" or ".0"
        return max(len(str(schema["minimum"])), len(str(schema["maximum"]))) + (2 if kind == "number" else 0)
    if kind in ("boolean", "null"):
        return len("false") if kind == "boolean" else len("null")
    if kind == "object":
        props = schema["properties"]
        return 2 + sum(len(json.dumps(name)) + 1 + max_chars(value) for name, value in props.items()) + len(props) - 1
    return 2 + schema["maxItems"] * (max_chars(schema["items"]) + 1) - 1  # array


def features(schema: dict, depth: int = 1) -> set[str]:
    """The FEATURES a schema uses, anywhere in it; depth is that of an object made here (the root's is 1)."""
    found = {_kind(schema)} if depth > 1 else set()
    if "anyOf" in schema:
        return found.union(*(features(branch, depth) for branch in schema["anyOf"]))
    if schema.get("type") == "object":
        props = schema["properties"]
        found |= {"required all" if len(schema["required"]) == len(props) else "required some"}
        found |= {"additionalProperties false"} if schema["additionalProperties"] is False else set()
        found |= {f"object depth {depth}"} if depth == MAX_DEPTH else set()
        return found.union(*(features(value, depth + 1) for value in props.values()))
    if schema.get("type") == "array":
        found |= {f"array of {_kind(schema['items'])}"} | ({"minItems"} if "minItems" in schema else set())
        return found | features(schema["items"], depth)
    return found


def _kind(schema: dict) -> str:
    """The KINDS entry a property's schema was made as."""
    for keyword, kind in [("const", "const"), ("enum", "enum"), ("anyOf", "anyOf"), ("pattern", "pattern"),
                          ("format", "date")]:
        if keyword in schema:
            return kind
    return "nullable" if isinstance(schema["type"], list) else schema["type"]


def example(schema: dict, rng: random.Random):
    """A random valid instance of a schema from this generator; its properties in the schema's order,
    as llguidance writes them. Strings mix words with characters that need escapes or are not ASCII."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return example(rng.choice(schema["anyOf"]), rng)
    kind = schema["type"]
    if isinstance(kind, list):
        return example({**schema, "type": rng.choice(kind)}, rng)
    if kind == "string":
        if "pattern" in schema:
            return next(sample for pattern, _, sample in PATTERNS.values() if pattern == schema["pattern"])(rng)
        if "format" in schema:
            return (date(1990, 1, 1) + timedelta(days=rng.randrange(20_000))).isoformat()
        text = " ".join(rng.choices(STRINGS + BOOLEANS + ['"', "\\", "\n", "é", "€", "😀"], k=schema["maxLength"]))
        return text[:rng.randint(0, schema["maxLength"])]
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return rng.randint(2 * schema["minimum"], 2 * schema["maximum"]) / 2  # a multiple of 0.5
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "object":
        return {name: example(value, rng) for name, value in schema["properties"].items()
                if name in schema["required"] or rng.random() < 0.5}
    return [example(schema["items"], rng) for _ in range(rng.randint(schema.get("minItems", 0), schema["maxItems"]))]


def validate(instance, schema: dict) -> None:
    """Raise ValueError listing every place the instance breaks the schema (formats such as date
    checked too, as the grammar does); return None if it is valid."""
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(instance), key=lambda error: error.json_path)
    if errors:
        raise ValueError(f"{len(errors)} error(s) against the schema: "
                         + "; ".join(f"at {error.json_path}: {error.message}" for error in errors))
